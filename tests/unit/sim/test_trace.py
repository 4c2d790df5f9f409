"""Trace built by hand, as the runtime builds measured ones."""

from __future__ import annotations

import pytest

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.sim import ActionRecord, MemoryTimeline, Trace, TransferRecord


def test_derived_numbers_of_a_hand_built_trace() -> None:
    sched = Schedule.from_text("# m ranks=2 microbatches=1 layout=0,1\n0: 0F0 0SEND_F0@1 0B0\n1: 1RECV_F0@0 1F0 1B0")
    recs = (
        (ActionRecord(rank=0, index=0, action=sched.actions[0][0], start=0.0, end=1.0),
         ActionRecord(rank=0, index=1, action=sched.actions[0][1], start=1.0, end=1.5),
         ActionRecord(rank=0, index=2, action=sched.actions[0][2], start=4.0, end=6.0)),
        (ActionRecord(rank=1, index=0, action=sched.actions[1][0], start=0.0, end=1.5),
         ActionRecord(rank=1, index=1, action=sched.actions[1][1], start=1.5, end=2.5),
         ActionRecord(rank=1, index=2, action=sched.actions[1][2], start=2.5, end=4.0)),
    )
    xfer = TransferRecord(src=0, dst=1, kind=ActionKind.SEND_F, stage=0, microbatch=0, num_bytes=8.0, start=1.0,
                          end=1.5, exposed_s=0.5)
    memory = (MemoryTimeline(rank=0, points=((0.0, 0.0), (0.0, 4.0), (6.0, 0.0))),
              MemoryTimeline(rank=1, points=((0.0, 0.0), (1.5, 2.0), (4.0, 0.0))))
    trace = Trace(schedule=sched, actions=recs, transfers=(xfer,), memory=memory, unit_bytes=(4.0, 4.0),
                  step_time=6.0, source="measured")
    assert trace.busy_time(0) == pytest.approx(3.0) and trace.busy_time(1) == pytest.approx(2.5)
    assert trace.bubble_fraction == pytest.approx(1 - 5.5 / 12)
    assert trace.peak_activations == (1.0, 0.5)
    assert trace.peak_activation_bytes == (4.0, 2.0)
    assert trace.memory[1].peak_time == 1.5
    assert trace.exposed_transfers == (xfer,) and trace.exposed_transfer_time == 0.5
    assert [r.action.kind for r in trace.compute_records()] == [ActionKind.FORWARD, ActionKind.BACKWARD] * 2
    assert recs[0][2].duration == 2.0 and xfer.label == "0SEND_F0 0->1"
    assert trace.num_actions == 6 and trace.num_ranks == 2


def test_trace_round_trips_json_and_refuses_foreign_text() -> None:
    import json

    import pytest

    from evenpipe.errors import ConfigError
    from evenpipe.schedule import build_schedule
    from evenpipe.sim import SimCosts, Trace, simulate
    from evenpipe.sim.costs import Link
    for name in ("bpipe", "zb-h1", "interleaved"):
        s = build_schedule(name, num_ranks=4, num_microbatches=8)
        t = simulate(s, SimCosts.uniform(num_stages=s.num_stages, output_bytes=3.0,
                                         link=Link(latency_s=0.1, bandwidth_bytes_per_s=10.0)))
        assert Trace.from_json(t.to_json()) == t
    doc = json.loads(t.to_json())
    for bad, match in ((dict(doc, version=2), "version 2"), (dict(doc, format="x"), "not an evenpipe trace"),
                       ({k: v for k, v in doc.items() if k != "memory"}, "damaged")):
        with pytest.raises(ConfigError, match=match):
            Trace.from_json(json.dumps(bad))


def test_trace_names_its_evaluator_in_json_and_reads_old_json_without_it() -> None:
    import json
    import pickle

    from evenpipe.schedule import build_schedule
    from evenpipe.sim import SimCosts, Trace, simulate
    from evenpipe.sim.engine import simulate_events
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    costs = SimCosts.uniform(num_stages=2)
    quick, reference = simulate(s, costs), simulate_events(s, costs)
    assert quick.evaluator == "free" and reference.evaluator == "events"
    assert quick == reference  # provenance is not content
    back = Trace.from_json(quick.to_json())
    assert back.evaluator == "free" and pickle.loads(pickle.dumps(quick)).evaluator == "free"
    old = {k: v for k, v in json.loads(quick.to_json()).items() if k != "evaluator"}
    assert Trace.from_json(json.dumps(old)).evaluator == ""
