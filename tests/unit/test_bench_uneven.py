"""``benchmarks/bench_uneven.py``: recovery, detection and false alarms from its three runs (mechanics only:
training and simulation are replaced by fakes)."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_uneven  # noqa: E402


def _summary(steps: list[float], alarms: list[dict], replan: dict | None) -> dict:
    return {"prediction": {"measured_steps_s": steps}, "slow_ranks": {"alarms": alarms}, "replan": replan}


def test_recovery_detection_and_false_alarms_from_the_runs(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: pathlib.Path) -> None:
    base = [0.10] * 11  # steps 1..11 (0-based)
    even = [0.10] * 5 + [0.20] * 6  # slowed from 0-based step 6; the first slowed steps before detection
    fixed = [0.12] * 11
    seen: list[tuple[str, tuple[str, ...]]] = []
    replan = {"step": 9, "rank": 1, "factor": 1.9, "layout": [3, 1, 2, 2], "layout_arg": "3,1,2,2"}

    def train(args, out, name, steps, *extra):
        seen.append((name, extra))
        return {"baseline": _summary(base, [{"rank": 3}], None), "slow_even": _summary(even, [], replan),
                "slow_replanned": _summary(fixed, [], None)}[name]
    monkeypatch.setattr(bench_uneven, "train", train)
    monkeypatch.setattr(bench_uneven, "predicted_step", lambda args, s, slow: (0.1, [2, 2, 2, 2]))
    args = argparse.Namespace(slow_rank=1, factor=1.5, slow_from=6, steps=12, false_alarm_steps=12)
    result = bench_uneven.uneven(args, tmp_path)
    assert result["recovery"] == pytest.approx((0.20 - 0.12) / (0.20 - 0.10))
    assert result["detected_after_steps"] == 3 and result["false_alarms"] == 1
    assert ("slow_replanned", ("--emulate-slow-rank", "1:1.5", "--layout", "3,1,2,2")) in seen
    assert seen[1] == ("slow_even", ("--emulate-slow-rank", "1:1.5@6"))


def test_a_slow_rank_never_named_skips_the_replanned_run(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: pathlib.Path) -> None:
    names: list[str] = []

    def train(args, out, name, steps, *extra):
        names.append(name)
        return _summary([0.1] * 5 if name == "baseline" else [0.1, 0.1, 0.2, 0.2, 0.2], [], None)
    monkeypatch.setattr(bench_uneven, "train", train)
    monkeypatch.setattr(bench_uneven, "predicted_step", lambda args, s, slow: (0.1, [2, 2]))
    args = argparse.Namespace(slow_rank=1, factor=1.5, slow_from=3, steps=6, false_alarm_steps=6)
    result = bench_uneven.uneven(args, tmp_path)
    assert names == ["baseline", "slow_even"] and result["recovery"] is None and result["detected_rank"] is None
    assert result["runs"]["slow_even"]["measured_step_s"] == pytest.approx(0.2)


def test_measured_takes_the_median_from_a_step_on() -> None:
    s = _summary([1.0, 2.0, 3.0, 4.0, 5.0], [], None)  # 0-based steps 1..5
    assert bench_uneven.measured(s) == 3.0 and bench_uneven.measured(s, 4) == 4.5
