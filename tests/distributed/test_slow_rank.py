"""A rank emulated slower (``train --emulate-slow-rank``) computes slower, and the detector names it and writes a
re-planned layout giving it fewer blocks (issue 35 points 5 and 6). Ratios only: no wall-clock thresholds."""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from harness import run_train

pytestmark = pytest.mark.distributed

SLOW_FROM = 6  # 0-based step the slowdown starts: after the detector's warm-up (steps 2..6 in 1-based numbers)


def test_an_emulated_slow_rank_is_slower_and_named(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run.json"
    summary, _ = run_train(["--model", "gpt-tiny", "--stages", "2", "--microbatches", "4", "--steps", "16",
                            "--random-tokens", "--timeout", "60", "--emulate-slow-rank", f"1:2.0@{SLOW_FROM}"],
                           out, timeout_s=240)
    watch = summary["slow_ranks"]
    steps = watch["rank_compute_s"]
    assert len(steps) == 16 and all(len(s) == 2 for s in steps)

    def median(rank: int, rows: list[list[float]]) -> float:
        return statistics.median(r[rank] for r in rows)
    before, after = steps[1:SLOW_FROM], steps[SLOW_FROM:]
    ratio = (median(1, after) / median(1, before)) / (median(0, after) / median(0, before))
    assert ratio > 1.2, (ratio, steps)
    named = [a for a in watch["alarms"] if a["rank"] == 1]
    assert named and named[0]["factor"] > 1.3 and named[0]["step"] > SLOW_FROM, watch["alarms"]
    assert watch["longest_streak"][1] >= watch["patience"], watch["longest_streak"]
    replan = json.loads((tmp_path / "replan.json").read_text())
    assert replan["rank"] == 1 and sum(replan["layout"]) == sum(replan["previous_layout"])
    assert replan["layout"][1] < replan["previous_layout"][1], replan
