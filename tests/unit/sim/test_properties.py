"""Property tests: any generated schedule under random positive costs simulates soundly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from evenpipe.errors import ConfigError
from evenpipe.schedule import ScheduleFamily, build_schedule, held_units
from evenpipe.schedule.ir import Action, ActionKind
from evenpipe.sim import Link, SimCosts, StageCosts, Trace, simulate

FAMILIES = [f.value for f in ScheduleFamily]
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
       recompute=st.booleans(), bpipe=st.booleans(), data=st.data())
def test_random_schedules_simulate_soundly(family: str, p: int, m: int, v: int, recompute: bool, bpipe: bool,
                                           data: st.DataObject) -> None:
    chunks = v if ScheduleFamily.parse(family).has_chunks else None
    if family == "interleaved":
        m = max(p, m - m % p)  # Megatron's rule: M a multiple of P
    try:
        sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=chunks, recompute=recompute,
                               bpipe=bpipe)
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
    _check_moves_land_before_allocation(trace)


def _check_moves_land_before_allocation(trace: Trace) -> None:
    """On every rank: each F/R starts, and each LOAD's transfer starts, no earlier than the arrival of every EVICT
    the rank posted before it; each ACCEPT's transfer starts no earlier than the arrival of every RETURN and
    ACCEPT the rank posted before it."""
    moves = {(t.kind, t.src, t.dst, t.stage, t.microbatch): t for t in trace.transfers
             if t.kind in (ActionKind.EVICT, ActionKind.RETURN)}
    for r in range(trace.num_ranks):
        evicted_by = returned_by = 0.0  # latest arrival among the EVICTs (RETURNs, ACCEPTs) posted so far here
        for rec in trace.records(r):
            a = rec.action
            if a.kind is ActionKind.EVICT:
                evicted_by = max(evicted_by, moves[(a.kind, r, a.peer, a.stage, a.microbatch)].end)
            elif a.kind is ActionKind.RETURN:
                returned_by = max(returned_by, moves[(a.kind, r, a.peer, a.stage, a.microbatch)].end)
            elif a.kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE):
                assert rec.start >= evicted_by - 1e-9, (r, rec)
            elif a.kind is ActionKind.LOAD:
                move = moves[(ActionKind.RETURN, a.peer, r, a.stage, a.microbatch)]
                assert move.start >= evicted_by - 1e-9, (r, rec, move)
            elif a.kind is ActionKind.ACCEPT:
                move = moves[(ActionKind.EVICT, a.peer, r, a.stage, a.microbatch)]
                assert move.start >= returned_by - 1e-9, (r, rec, move)
                returned_by = max(returned_by, move.end)


def _own_and_hosted_peaks(actions: tuple[Action, ...]) -> tuple[int, int]:
    """Program-order peaks of a rank's own units (F and LOAD add, B and EVICT free) and of its hosted units."""
    own = hosted = own_peak = hosted_peak = 0
    for a in actions:
        own += {ActionKind.FORWARD: 1, ActionKind.LOAD: 1, ActionKind.BACKWARD: -1, ActionKind.EVICT: -1}.get(a.kind, 0)
        hosted += {ActionKind.ACCEPT: 1, ActionKind.RETURN: -1}.get(a.kind, 0)
        own_peak, hosted_peak = max(own_peak, own), max(hosted_peak, hosted)
    return own_peak, hosted_peak


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(3, 8), extra=st.integers(0, 16), recompute=st.booleans(), data=st.data())
def test_bpipe_forwards_wait_for_earlier_evictions(p: int, extra: int, recompute: bool, data: st.DataObject) -> None:
    sched = build_schedule("bpipe", num_ranks=p, num_microbatches=p + extra, recompute=recompute)
    stages = [data.draw(stage_costs()) for _ in range(sched.num_stages)]
    link = Link(latency_s=data.draw(st.floats(0, 1)), bandwidth_bytes_per_s=data.draw(st.floats(0.1, 10)))
    trace = simulate(sched, SimCosts.from_stages(stages, default_link=link))
    assert any(t.kind is ActionKind.EVICT for t in trace.transfers)
    _check_moves_land_before_allocation(trace)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 10), m=st.integers(1, 30), recompute=st.booleans(), data=st.data())
def test_bpipe_never_exceeds_its_budget_whatever_the_costs_and_links(p: int, m: int, recompute: bool,
                                                                     data: st.DataObject) -> None:
    # the budget counts activation units, so every stage saves the same bytes; times and links are random
    sched = build_schedule("bpipe", num_ranks=p, num_microbatches=m, recompute=recompute)
    act = data.draw(positive)
    stages = [StageCosts(forward=data.draw(positive), backward_input=data.draw(positive),
                         recompute=data.draw(positive), activation_bytes=act,
                         checkpoint_bytes=data.draw(st.floats(min_value=0.0, max_value=act)),
                         output_bytes=data.draw(positive)) for _ in range(p)]
    link = st.builds(lambda lat, bw: Link(latency_s=lat, bandwidth_bytes_per_s=bw), st.floats(0, 2),
                     st.floats(0.05, 50))
    pairs = st.tuples(st.integers(0, p - 1), st.integers(0, p - 1))
    costs = SimCosts.from_stages(stages, default_link=data.draw(link),
                                 links=data.draw(st.dictionaries(pairs, link, max_size=2 * p)))
    trace = simulate(sched, costs)
    budget = sched.meta["budget"]
    assert isinstance(budget, int)
    for acts, peak, in_order in zip(sched.actions, trace.peak_activation_bytes, held_units(sched)):
        own, hosted = _own_and_hosted_peaks(acts)
        # an evictor never holds more than its program order says; an acceptor's forward may overlap a RETURN in
        # flight, so it is bounded by its own peak plus its hosted peak; the transform keeps both within budget
        bound = own + hosted if any(a.kind is ActionKind.RETURN for a in acts) else in_order
        assert peak <= bound * act * (1 + 1e-9), (peak / act, bound)
        assert in_order <= bound <= budget
    _check_moves_land_before_allocation(trace)
