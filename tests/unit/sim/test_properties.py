"""Property tests: any generated schedule under random positive costs simulates soundly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule
from evenpipe.schedule.ir import ActionKind
from evenpipe.sim import Link, SimCosts, StageCosts, Trace, simulate

FAMILIES = ["gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "bpipe"]
positive = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


@st.composite
def stage_costs(draw: st.DrawFn) -> StageCosts:
    act = draw(positive)
    return StageCosts(forward=draw(positive), backward_input=draw(positive), backward_weight=draw(positive),
                      recompute=draw(positive), activation_bytes=act,
                      checkpoint_bytes=draw(st.floats(min_value=0.0, max_value=act)),
                      weight_grad_bytes=draw(st.floats(min_value=0.0, max_value=act)), output_bytes=draw(positive))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(family=st.sampled_from(FAMILIES), p=st.integers(1, 16), m=st.integers(1, 64), v=st.integers(1, 4),
       recompute=st.booleans(), data=st.data())
def test_random_schedules_simulate_soundly(family: str, p: int, m: int, v: int, recompute: bool,
                                           data: st.DataObject) -> None:
    chunks = v if family in ("interleaved", "looped-bfs") else 1
    if family == "interleaved":
        m = max(p, m - m % p)  # Megatron's rule: M a multiple of P
    try:
        sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=chunks, recompute=recompute)
    except ConfigError:
        assume(False)  # sizes the family does not support (e.g. interleaved needs M % P == 0)
        return
    stages = [data.draw(stage_costs()) for _ in range(sched.num_stages)]
    link = Link(latency_s=data.draw(st.floats(0, 1)), bandwidth_bytes_per_s=data.draw(st.floats(0.5, 100)))
    trace = simulate(sched, SimCosts.from_stages(stages, default_link=link))

    for mem in trace.memory:
        assert all(b >= 0 for _, b in mem.points)
        assert mem.points[-1][1] == pytest.approx(0.0, abs=1e-6)  # everything saved is freed by the end
    for r, acts in enumerate(sched.actions):
        recs = trace.records(r)
        assert [rec.action for rec in recs] == list(acts)  # every action simulated exactly once, in order
        assert all(0 <= rec.start <= rec.end <= trace.step_time + 1e-9 for rec in recs)
    busiest = max(trace.busy_time(r) for r in range(p))
    assert trace.step_time >= busiest - 1e-9
    assert 0.0 <= trace.bubble_fraction < 1.0
    _check_evictions_land_before_allocation(trace)


def _check_evictions_land_before_allocation(trace: Trace) -> None:
    """Every F/R starts no earlier than the arrival of each EVICT its rank issued before it."""
    evict_end = {(t.src, t.stage, t.microbatch): t.end for t in trace.transfers if t.kind is ActionKind.EVICT}
    for r in range(trace.num_ranks):
        landed_by = 0.0  # latest arrival among the evictions issued so far on this rank
        for rec in trace.records(r):
            if rec.kind is ActionKind.EVICT:
                landed_by = max(landed_by, evict_end[(r, rec.action.stage, rec.action.microbatch)])
            elif rec.kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE):
                assert rec.start >= landed_by - 1e-9, (r, rec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(3, 8), extra=st.integers(0, 16), recompute=st.booleans(), data=st.data())
def test_bpipe_forwards_wait_for_earlier_evictions(p: int, extra: int, recompute: bool, data: st.DataObject) -> None:
    sched = build_schedule("bpipe", num_ranks=p, num_microbatches=p + extra, recompute=recompute)
    stages = [data.draw(stage_costs()) for _ in range(sched.num_stages)]
    link = Link(latency_s=data.draw(st.floats(0, 1)), bandwidth_bytes_per_s=data.draw(st.floats(0.1, 10)))
    trace = simulate(sched, SimCosts.from_stages(stages, default_link=link))
    assert any(t.kind is ActionKind.EVICT for t in trace.transfers)
    _check_evictions_land_before_allocation(trace)
