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
        return {"baseline": {**_summary(base, [{"rank": 3}], None),
                             "slow_ranks": {"alarms": [{"rank": 3}], "longest_streak": [0, 1, 0, 4], "patience": 4}}, "slow_even": _summary(even, [], replan),
                "slow_replanned": _summary(fixed, [], None)}[name]
    monkeypatch.setattr(bench_uneven, "train", train)
    monkeypatch.setattr(bench_uneven, "predicted_step", lambda args, s, slow: (0.1, [2, 2, 2, 2]))
    args = argparse.Namespace(slow_rank=1, factor=1.5, slow_from=6, steps=12, false_alarm_steps=12)
    result = bench_uneven.uneven(args, tmp_path)
    assert result["recovery"] == pytest.approx((0.20 - 0.12) / (0.20 - 0.10))
    assert result["detected_after_steps"] == 3 and result["false_alarms"] == 1
    assert result["false_alarm_longest_streak"] == [0, 1, 0, 4] and result["patience"] == 4
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


def _brute_recovery(blocks: int, ranks: int, slow: int, factor: float) -> float:
    """Recovery of the best whole-block layout, by trying every layout (each rank >= 1 block)."""
    import itertools
    cost = [factor if r == slow else 1.0 for r in range(ranks)]
    best = min(max(n * c for n, c in zip(split, cost)) for split in itertools.product(range(1, blocks), repeat=ranks)
               if sum(split) == blocks)
    even = blocks // ranks
    return (even * factor - best) / (even * factor - even)


@pytest.mark.parametrize("blocks,ranks", [(8, 2), (10, 2), (8, 4), (16, 4)])
def test_recovery_bounds_whole_blocks_match_a_brute_force_and_stay_under_the_ideal(blocks: int, ranks: int) -> None:
    b = bench_uneven.recovery_bounds(blocks, ranks, 1, 1.5)
    assert b["layout"] == pytest.approx(_brute_recovery(blocks, ranks, 1, 1.5))
    assert b["layout"] <= b["ideal"] + 1e-9 and sum(b["best_layout"]) == blocks


def test_recovery_bound_at_two_ranks_is_60_percent() -> None:
    """8 blocks, rank 1 1.5x: even 4+4 takes 6 (rank 1), balanced n0 = 1.5 n1 gives n1 = 3.2 and 4.8, against 4
    unslowed: (6 - 4.8) / (6 - 4) = 0.6; whole blocks 5+3 take max(5, 4.5) = 5: 0.5."""
    b = bench_uneven.recovery_bounds(8, 2, 1, 1.5)
    assert b["ideal"] == pytest.approx(0.6) and b["layout"] == pytest.approx(0.5) and b["best_layout"] == [5, 3]


def _result(stages: int, blocks: int, steps: int = 200) -> dict:
    return {"stages": stages, "factor": 1.5, "false_alarm_steps": steps,
            "recovery_bounds": bench_uneven.recovery_bounds(blocks, stages, 1, 1.5)}


def test_notes_name_the_targets_a_run_cannot_show() -> None:
    (two,) = bench_uneven.target_notes(_result(2, 8), 8)
    assert "P=2" in two and "60%" in two and "70%" in two
    (coarse,) = bench_uneven.target_notes(_result(4, 8), 8)
    assert "8 blocks on 4 ranks" in coarse and "0%" in coarse
    assert bench_uneven.target_notes(_result(4, 32), 32) == []
    assert "12 steps" in bench_uneven.target_notes(_result(4, 32, steps=12), 32)[0]
    assert bench_uneven.core_note(2, 2) == [] and "4 training processes on 2 cores" in bench_uneven.core_note(4, 2)[0]


def test_best_microbatches_takes_the_largest_simulated_gain() -> None:
    import bench_latency
    import bench_latency_measured
    M, gains = bench_latency_measured.best_microbatches(2, 1.0, blocks=4)
    assert set(gains) == {2, 4, 8, 16} and gains[M] == max(gains.values())
    base, ours = bench_latency.compare(2, 4, 1.0)
    assert gains[4] == pytest.approx(1 - min(t for t, _ in ours) / min(t for t, _ in base))
    M1, gains1 = bench_latency_measured.best_microbatches(2, 1.0, blocks=2)  # too few blocks for the V
    base1, ours1 = bench_latency.compare(2, M1, 1.0)
    assert gains1[M1] == pytest.approx(1 - ours1[0][0] / min(base1[0][0], base1[2][0]))


def test_split_note_only_when_the_split_backward_costs_more_here() -> None:
    import bench_latency_measured
    (note,) = bench_latency_measured.split_note({"F": 2.5, "B": 4.0, "I": 1.6, "W": 3.0}, {"1f1b": -0.05, "zb-h1": 0.12})
    assert "15% more" in note and "1f1b -5.0%" in note and "zb-h1 +12.0%" in note
    assert bench_latency_measured.split_note({"F": 2.5, "B": 4.0, "I": 2.0, "W": 2.0}, {"1f1b": 0.1}) == []
    assert bench_latency_measured.split_note({"F": 2.5, "B": 4.0}, {"1f1b": 0.1}) == []


@pytest.mark.parametrize("stages,link", [(2, "0-1:5.0"), (4, "1-2:5.0")])
def test_the_slow_link_is_the_middle_one_and_the_gain_is_given_against_each(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, stages: int, link: str) -> None:
    step = {"1f1b": 0.20, "zb-h1": 0.25, "latency-aware": 0.18}
    seen = []

    def train(args, out, name, steps, *extra):
        seen.append(extra)
        return _summary([step[extra[1]]] * 3, [], None)
    monkeypatch.setattr(bench_uneven, "train", train)
    args = argparse.Namespace(stages=stages, link_delay_ms=5.0, link_steps=4)
    result = bench_uneven.latency(args, tmp_path)
    assert result["link"] == link and all(e[-1] == link for e in seen)
    assert result["gain"] == pytest.approx(0.1) and result["gain_vs"]["zb-h1"] == pytest.approx(0.28)
