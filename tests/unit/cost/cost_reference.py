"""Reference data for the cost-model tests: the published tables under ``../shared/reference/`` (relative to the
repository root) when present, else the copies in ``tests/unit/cost/data/``."""

from __future__ import annotations

import csv
import pathlib


HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHARED = REPO.parent / "shared" / "reference"
LOCAL = HERE / "data"


def reference_path(name: str) -> pathlib.Path:
    outside = SHARED / name
    return outside if outside.exists() else LOCAL / name


def read_rows(name: str) -> list[dict[str, str]]:
    with reference_path(name).open() as f:
        return list(csv.DictReader(f))
