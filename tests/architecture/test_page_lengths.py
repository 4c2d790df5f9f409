"""The two pages a newcomer reads first stay short (issue 32): README.md under 150 lines, BENCHMARKS.md under 400,
every BENCHMARKS.md section naming its date; older passes belong in docs/benchmarks/history.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_is_under_150_lines() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n < 150, f"README.md has {n} lines; move detail into docs/"


def test_benchmarks_is_under_400_lines() -> None:
    n = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert n < 400, f"BENCHMARKS.md has {n} lines; move older passes to docs/benchmarks/history.md"


def test_every_benchmark_section_is_dated() -> None:
    sections = re.split(r"(?m)^## ", (ROOT / "BENCHMARKS.md").read_text())[1:]
    undated = [s.splitlines()[0] for s in sections if not re.search(r"20\d\d-\d\d-\d\d", s)]
    assert not undated, f"sections without a date: {undated}"
