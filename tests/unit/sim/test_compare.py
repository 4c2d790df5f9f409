"""``compare_traces``: figures that mean the same on both sides, for measured traces too."""

from __future__ import annotations

from evenpipe.schedule import build_schedule
from evenpipe.sim import Link, SimCosts, Trace, simulate
from evenpipe.sim.compare import compare_traces


def _traces() -> tuple[Trace, Trace]:
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    slow = SimCosts.uniform(num_stages=2, num_chunks=1, output_bytes=1e6,
                            link=Link(latency_s=1e-3, bandwidth_bytes_per_s=1e8))
    fast = SimCosts.uniform(num_stages=2, num_chunks=1, output_bytes=1e6, link=Link())
    return simulate(schedule, slow), simulate(schedule, fast)


def _as_measured(trace: Trace) -> Trace:
    return Trace(schedule=trace.schedule, transfers=trace.transfers, memory=trace.memory,
                 unit_bytes=trace.unit_bytes, step_time=trace.step_time, source="measured", actions=trace.actions)


def test_messages_compare_by_wait_and_by_span_only_between_unmeasured_traces() -> None:
    slow, fast = _traces()
    names = [c.name for c in compare_traces(slow, fast).per_kind]
    assert names == ["mean FORWARD", "mean BACKWARD", "mean SEND_F transfer", "mean SEND_F wait",
                     "mean SEND_B transfer", "mean SEND_B wait"]
    measured = compare_traces(slow, _as_measured(fast))
    assert [c.name for c in measured.per_kind] == ["mean FORWARD", "mean BACKWARD", "mean SEND_F wait",
                                                  "mean SEND_B wait"]
    wait = next(c for c in measured.per_kind if c.name == "mean SEND_F wait")
    exposed = [t.exposed_s for t in slow.transfers if t.kind.name == "SEND_F"]
    assert wait.predicted == sum(exposed) / len(exposed) > 0 and wait.measured == 0.0 and wait.error is None
