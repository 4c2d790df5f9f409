"""Unequal micro-batches (issue 34): each (stage, micro-batch) has its own durations and bytes in the simulator,
hand-computed small cases, every family valid and timed by its micro-batches, equal ones on the fast path."""

from __future__ import annotations

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule
from evenpipe.schedule.family import ScheduleFamily
from evenpipe.schedule.ir import ActionKind
from evenpipe.schedule.validate import validate
from evenpipe.sim import simulate
from evenpipe.sim.costs import Link, SimCosts, StageCosts
from evenpipe.sim.engine import simulate_events


def _rows(scales: list[float], num_stages: int, *, split: bool = False) -> list[list[StageCosts]]:
    """Micro-batch m: forward ``scales[m]``, backward twice that (split evenly into I and W when ``split``),
    activations ``scales[m]`` bytes, output message ``scales[m]`` bytes, on every stage."""
    return [[StageCosts(forward=f, backward_input=f if split else 2 * f, backward_weight=f if split else 0.0,
                        activation_bytes=f, weight_grad_bytes=f / 2, output_bytes=f)
             for _ in range(num_stages)] for f in scales]


def _times(trace) -> list[tuple[list[float], list[float]]]:  # type: ignore[no-untyped-def]
    return [trace.action_times(r) for r in range(trace.num_ranks)]


def _peaks(trace) -> list[float]:  # type: ignore[no-untyped-def]
    return [max(level for _, level in m.points) for m in trace.memory]


def test_gpipe_two_ranks_by_hand() -> None:
    # F: 1, 3, 1; B: 2, 6, 2. Rank 0 forwards 0-1, 1-4, 4-5; rank 1 forwards 1-2, 4-7, 7-8, backs 8-10, 10-16,
    # 16-18; rank 0 backs 10-12, 16-22, 22-24.
    sched = build_schedule("gpipe", num_ranks=2, num_microbatches=3)
    trace = simulate(sched, SimCosts.per_microbatch(_rows([1.0, 3.0, 1.0], 2)))
    assert trace.step_time == 24.0
    spans = {(r.rank, r.action.kind, r.action.microbatch): (r.start, r.end) for r in trace.compute_records()}
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    assert [spans[(1, F, m)] for m in range(3)] == [(1.0, 2.0), (4.0, 7.0), (7.0, 8.0)]
    assert [spans[(0, B, m)] for m in range(3)] == [(10.0, 12.0), (16.0, 22.0), (22.0, 24.0)]
    assert _peaks(trace) == [5.0, 5.0]  # GPipe holds all three: 1 + 3 + 1


def test_one_f_one_b_peak_memory_by_hand() -> None:
    # Rank 0 runs F0 F1 B0 F2 B1 B2: it holds micro-batches 0 and 1 (1 + 4), then 1 and 2 (4 + 2): peak 6.
    # Rank 1 runs F0 B0 F1 B1 F2 B2: one at a time, peak 4.
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    trace = simulate(sched, SimCosts.per_microbatch(_rows([1.0, 4.0, 2.0], 2)))
    assert _peaks(trace) == [6.0, 4.0]


def test_messages_take_their_micro_batch_bytes() -> None:
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    link = Link(latency_s=0.0, bandwidth_bytes_per_s=2.0)
    trace = simulate(sched, SimCosts.per_microbatch(_rows([1.0, 4.0, 2.0], 2), default_link=link))
    sizes = {(t.kind, t.microbatch): t.num_bytes for t in trace.transfers}
    assert sizes[(ActionKind.SEND_F, 1)] == 4.0 and sizes[(ActionKind.SEND_B, 2)] == 2.0
    assert all(t.end - t.start == pytest.approx(t.num_bytes / 2.0) for t in trace.transfers)


def test_equal_rows_are_the_plain_costs_and_the_same_trace() -> None:
    sched = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    stage = StageCosts(forward=1.0, backward_input=2.0, activation_bytes=3.0, output_bytes=1.0)
    plain = SimCosts.from_stages([stage] * 4, default_link=Link(latency_s=0.5))
    same = SimCosts.per_microbatch([[stage] * 4] * 4, default_link=Link(latency_s=0.5))
    assert same.microbatch_stages is None and same == plain
    assert _times(simulate(sched, same)) == _times(simulate(sched, plain))
    # forcing the event engine with per-micro-batch rows that are all alike gives the fast evaluators' trace
    forced = SimCosts(stages=plain.stages, default_link=plain.default_link, microbatch_stages=((stage,) * 4,) * 4)
    fast, events = simulate(sched, plain), simulate(sched, forced)
    assert events.evaluator == "events" and _times(fast) == _times(events)
    assert [m.points for m in fast.memory] == [m.points for m in events.memory]


FAMILIES = [f for f in ScheduleFamily if f is not ScheduleFamily.LATENCY_AWARE] + [ScheduleFamily.LATENCY_AWARE]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_every_family_is_valid_and_timed_by_its_micro_batches(family: ScheduleFamily) -> None:
    P, M = 4, 8
    sched = build_schedule(family, num_ranks=P, num_microbatches=M)
    validate(sched)  # the schedule does not depend on the micro-batches' sizes
    scales = [1.0 + (3 * m) % 5 for m in range(M)]
    split = any(a.kind is ActionKind.BACKWARD_INPUT for acts in sched.actions for a in acts)
    rows = _rows(scales, sched.num_stages, split=split)
    costs = SimCosts.per_microbatch(rows, default_link=Link(latency_s=0.01, bandwidth_bytes_per_s=100.0))
    trace = simulate(sched, costs)
    assert trace.evaluator == "events"
    kinds = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward",
             ActionKind.BACKWARD_INPUT: "backward_input", ActionKind.BACKWARD_WEIGHT: "backward_weight",
             ActionKind.RECOMPUTE: "recompute_time"}
    for rec in trace.compute_records():
        want = getattr(rows[rec.action.microbatch][rec.action.stage], kinds[rec.action.kind])
        assert rec.duration == pytest.approx(want), rec
    assert all(m.points[-1][1] == pytest.approx(0.0, abs=1e-9) for m in trace.memory)  # everything freed
    # a step is at least the longest rank's work, and no rank holds more than every micro-batch it runs
    assert trace.step_time >= max(trace.busy_time(r) for r in range(P)) - 1e-9
    for r, peak in enumerate(_peaks(trace)):
        held = {(s, m) for s in sched.stages_of(r) for m in range(M)}
        assert peak <= sum(rows[m][s].activation_bytes for s, m in held) + 1e-9


def test_bpipe_moves_each_micro_batch_bytes() -> None:
    sched = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    scales = [1.0 + m for m in range(8)]
    trace = simulate(sched, SimCosts.per_microbatch(_rows(scales, 4)))
    moved = [t for t in trace.transfers if t.kind in (ActionKind.EVICT, ActionKind.LOAD)]
    assert moved and all(t.num_bytes == scales[t.microbatch] for t in moved)


def test_wrong_number_of_rows_is_refused_in_one_line() -> None:
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    costs = SimCosts.per_microbatch(_rows([1.0, 2.0], 2))
    with pytest.raises(ConfigError, match="2 micro-batches") as err:
        simulate_events(sched, costs)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="one row per micro-batch"):
        SimCosts.per_microbatch([])
