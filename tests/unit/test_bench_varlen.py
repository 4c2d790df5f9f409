"""``benchmarks/bench_varlen.py``'s arithmetic (mechanics only: no world is started): each policy's real tokens per
second over rounds, the ratios taken round by round, padding, and the written documents file."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_varlen  # noqa: E402


def _row(seconds: float, real: int, computed: int) -> dict:
    return {"seconds": seconds, "real_tokens": real, "computed_tokens": computed, "lengths": [[real]]}


def test_ratios_are_taken_round_by_round() -> None:
    rounds = [{"pad": _row(1.0, 50, 100), "balance": _row(1.0, 100, 100)},
              {"pad": _row(2.0, 50, 100), "balance": _row(1.0, 150, 200)}]
    opts = {"policies": ["pad", "balance"], "profile": None}
    out = bench_varlen.summarize(rounds, opts)
    assert out["policies"]["pad"]["real_tokens_per_s"] == {"median": 37.5, "min": 25.0, "max": 50.0}
    assert out["policies"]["balance"]["padding"] == 1 - 250 / 300
    assert out["policies"]["balance"]["predicted_tokens_per_s"] is None  # no profile
    assert out["ratios"] == {"balance/pad": {"median": 4.0, "min": 2.0, "max": 6.0}}  # medians: 125 / 37.5
    rounds[1]["pad"] = _row(1.0, 100, 100)
    assert bench_varlen.summarize(rounds, opts)["ratios"]["balance/pad"]["median"] == 1.75


def test_documents_file_holds_the_lengths(tmp_path: pathlib.Path) -> None:
    path = bench_varlen.write_documents([3, 1, 5], tmp_path, vocab=7, seed=0)
    tokens = np.fromfile(path, dtype=np.uint16)
    assert len(tokens) == 9 and tokens.max() < 7
    assert np.fromfile(tmp_path / "docs.idx", dtype="<i8").tolist() == [0, 3, 4, 9]
