"""Golden comparison: the dataflow evaluation (``evenpipe.sim.fast``) returns the event engine's trace exactly.

The event engine (``simulate_events``) is the reference. On random schedules of every family (with recomputation,
BPipe, host offload, and compute-only ones whose messages are implicit) under random costs and links, ``simulate`` must return a trace equal to the reference
field by field (float equality), and the dataflow path must really be taken wherever it promises to be: on
instant links with integer byte counts it never falls back.
"""

from __future__ import annotations

import random

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import ScheduleFamily, build_schedule
from evenpipe.schedule.build import add_offload, compute_order
from evenpipe.schedule.comm import derive_communication
from evenpipe.schedule.ir import Schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim import Link, SimCosts, StageCosts, simulate
from evenpipe.sim.engine import simulate_events
from evenpipe.sim.fast import simulate_fast
from evenpipe.sim.free import simulate_free
from evenpipe.sim.links import simulate_links
from evenpipe.sim.trace import Trace

FAMILIES = [f for f in ScheduleFamily]
LINKS = ["free", "latency", "slow", "mixed"]


def _shape(rng: random.Random) -> tuple[ScheduleFamily, int, int, int | None]:
    """A random family, ranks, micro-batches and chunks (interleaved: micro-batches a multiple of the ranks)."""
    fam = rng.choice(FAMILIES)
    p, m = rng.randint(1, 6), rng.randint(1, 12)
    v = rng.randint(2, 3) if fam.has_chunks else None
    if fam is ScheduleFamily.INTERLEAVED:
        m = max(p, m - m % p)
    return fam, p, m, v


def _schedule(rng: random.Random, compute_only: bool = True) -> Schedule:
    """A random schedule of any family: with recomputation, BPipe, host offload and (``compute_only``) sometimes
    compute actions only."""
    while True:
        fam, p, m, v = _shape(rng)
        try:
            if rng.random() < 0.15 and not fam.has_chunks:
                compute = compute_order(fam, num_ranks=p, num_microbatches=m)
                return derive_communication(add_offload(compute, ranks={0}))
            transforms = fam.traits.transforms
            if compute_only and rng.random() < 0.15:  # compute only: messages become implicit, unserialised transfers
                return build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v).compute_only()
            return build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v,
                                  recompute=rng.random() < 0.3,
                                  bpipe=fam is ScheduleFamily.BPIPE or (rng.random() < 0.3 and any(
                                      t.value == "bpipe" for t in transforms)))
        except ConfigError:
            continue


def _plain(sched: Schedule) -> bool:
    """Only computes and explicit activation/gradient messages (what the instant-link path takes)."""
    allowed = {"F", "B", "I", "W", "R", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    kinds = {a.kind.value for acts in sched.actions for a in acts}
    messages_needed = any(sched.stage_to_rank[s] != sched.stage_to_rank[s + 1] for s in range(sched.num_stages - 1))
    return kinds <= allowed and (not messages_needed or bool(kinds & {"SEND_F"}))


def _same_summaries(trace: Trace, reference: Trace) -> None:
    """The summaries a deferred trace knows before its records exist equal the reference's, float for float
    (checked before ``==``, which builds the records)."""
    assert trace.num_transfers == len(reference.transfers)
    assert trace.waited_transfers == tuple(t for t in reference.transfers if t.exposed_s > 0)
    assert [trace.action_times(r) for r in range(trace.schedule.num_ranks)] == \
        [reference.action_times(r) for r in range(reference.schedule.num_ranks)]
    assert trace.exposed_transfer_time == reference.exposed_transfer_time
    assert trace.step_time == reference.step_time
    assert trace.bubble_fraction == reference.bubble_fraction
    assert [trace.busy_time(r) for r in range(trace.schedule.num_ranks)] == \
        [reference.busy_time(r) for r in range(reference.schedule.num_ranks)]


def _costs(rng: random.Random, num_stages: int, num_ranks: int, integer: bool, link: str) -> SimCosts:
    def t() -> float:
        return float(rng.randint(1, 4)) if integer else rng.uniform(0.1, 3.0)

    def nbytes() -> float:
        return float(rng.randint(0, 8)) if integer else rng.uniform(0.0, 5.0)

    stages = []
    for _ in range(num_stages):
        act = nbytes() + 1.0
        stages.append(StageCosts(forward=t(), backward_input=t(), backward_weight=rng.choice([0.0, t()]),
                                 recompute=t(), activation_bytes=act, checkpoint_bytes=min(act, nbytes()),
                                 weight_grad_bytes=min(act, nbytes()), output_bytes=nbytes()))
    default = {"free": Link(), "latency": Link(latency_s=t() / 4),
               "slow": Link(latency_s=0.01, bandwidth_bytes_per_s=rng.uniform(0.5, 4.0)),
               "mixed": Link()}[link]
    links = {}
    if link == "mixed":  # some directed pairs slow, some host links slow
        for _ in range(num_ranks):
            a, b = rng.randrange(num_ranks), rng.randrange(num_ranks)
            links[(a, b)] = Link(latency_s=0.05, bandwidth_bytes_per_s=rng.uniform(1.0, 8.0))
    return SimCosts.from_stages(stages, default_link=default, links=links)


@pytest.mark.parametrize("seed", range(6))
def test_dataflow_matches_event_engine_on_random_schedules(seed: int) -> None:
    rng = random.Random(seed)
    taken = free_taken = trusted = 0
    for case in range(40):
        sched = _schedule(rng)
        integer = rng.random() < 0.5
        link = rng.choice(LINKS)
        costs = _costs(rng, sched.num_stages, sched.num_ranks, integer, link)
        reference = simulate_events(sched, costs)
        fast = simulate_fast(sched, costs)
        if fast is not None:
            taken += 1
            assert fast == reference, f"case {case}: {sched.name} P={sched.num_ranks} M={sched.num_microbatches} " \
                f"link={link} integer={integer}"
        elif integer and link == "free":
            pytest.fail(f"case {case}: {sched.name} fell back on instant links with integer bytes")
        free = simulate_free(sched, costs)
        if free is not None:
            free_taken += 1
            _same_summaries(free, reference)
            trusted += passed_validation(sched)
            assert free == reference, f"case {case}: instant-link path, {sched.name} P={sched.num_ranks}"
            # the path that checks the validator's rules itself gives the same trace
            assert simulate_free(sched, costs, trust_validation=False) == reference
        elif link == "free" and _plain(sched):
            pytest.fail(f"case {case}: {sched.name} left the instant-link path on free links")
        assert simulate(sched, costs) == reference
    assert taken >= 20 and free_taken >= 5 and trusted >= 3  # the comparisons are not vacuous


def test_slow_links_and_cached_shape_reused() -> None:
    # every message takes time on slow links: the dataflow path still answers, identically
    sched = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=2)
    costs = SimCosts.uniform(num_stages=4, num_chunks=2, forward=1.0, backward=2.0, output_bytes=3.0,
                             link=Link(bandwidth_bytes_per_s=2.0))
    first = simulate_fast(sched, costs)
    assert first is not None and first == simulate_events(sched, costs)
    cheaper = SimCosts.uniform(num_stages=4, num_chunks=2, forward=1.0, backward=2.0, output_bytes=1.0,
                               link=Link(bandwidth_bytes_per_s=2.0))
    again = simulate_fast(sched, cheaper)  # same schedule object: compiled shape from the cache
    assert again is not None and again == simulate_events(sched, cheaper)
    assert again.step_time < first.step_time


@pytest.mark.parametrize("family, p, m, v", [("bpipe", 4, 8, None), ("interleaved", 4, 8, 2),
                                             ("interleaved", 4, 8, 3)])
def test_messages_tied_on_one_link_take_the_dataflow_path(family: str, p: int, m: int, v: int | None) -> None:
    # BPipe pairs neighbours (1 <-> 2 at P=4), so an EVICT shares its link with the SEND_F just before it: both
    # become ready at the same instant, reached by the same two ranks in the same order on each. The engine's FIFO
    # then serves them in program order whichever rank it advances first; the dataflow path must agree, not refuse
    sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v, bpipe=family == "interleaved")
    for bandwidth in (1.0, 2.0, 4.0):
        costs = SimCosts.uniform(num_stages=sched.num_stages, num_chunks=v or 1, forward=1.0, backward=2.0,
                                 activation_bytes=2.0 * (v or 1), output_bytes=1.0,
                                 link=Link(bandwidth_bytes_per_s=bandwidth))
        fast = simulate_fast(sched, costs)
        assert fast is not None, f"{family} P={p} fell back at bandwidth {bandwidth}"
        assert fast == simulate_events(sched, costs)


@pytest.mark.parametrize("seed", range(3))
def test_bpipe_on_slow_links_with_integer_costs_matches_engine(seed: int) -> None:
    # integer durations and bytes make equal-time readiness common: every answer of the dataflow path must be the
    # engine's, and most cases must be answered
    rng = random.Random(100 + seed)
    taken = 0
    cases = 30
    for _ in range(cases):
        p = rng.randint(3, 6)
        m = p * rng.randint(1, 3)
        interleaved = rng.random() < 0.5
        sched = build_schedule("interleaved" if interleaved else "bpipe", num_ranks=p, num_microbatches=m,
                               num_chunks=rng.randint(2, 3) if interleaved else None, bpipe=interleaved,
                               recompute=rng.random() < 0.3)
        costs = _costs(rng, sched.num_stages, p, True, rng.choice(["latency", "slow", "mixed"]))
        fast = simulate_fast(sched, costs)
        if fast is not None:
            taken += 1
            assert fast == simulate_events(sched, costs), f"{sched.name} P={p} M={m}"
    assert taken >= cases // 2


def test_only_a_schedule_that_passed_the_validator_takes_the_trusted_instant_link_path() -> None:
    from evenpipe.errors import ScheduleValidationError
    from evenpipe.schedule.validate import validate

    derived = derive_communication(compute_order(ScheduleFamily.ONE_F_ONE_B, num_ranks=3, num_microbatches=4))
    assert not passed_validation(derived)  # derived, never validated: the checking path
    validate(derived)
    assert passed_validation(derived)
    costs = SimCosts.uniform(num_stages=3, output_bytes=2.0)
    assert simulate_free(derived, costs) == simulate_free(derived, costs, trust_validation=False) \
        == simulate_events(derived, costs)
    broken = derived.with_actions([acts[::-1] for acts in derived.actions])  # every rank backwards
    with pytest.raises(ScheduleValidationError):
        validate(broken)
    assert not passed_validation(broken)


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_link_path_matches_event_engine_on_random_validated_schedules(seed: int) -> None:
    # validated schedules of computes and plain messages on links that take time: sim/links.py answers, and
    # its trace is the engine's field for field (it may decline only on a FIFO order it cannot vouch for)
    rng = random.Random(100 + seed)
    taken = plain = 0
    for case in range(40):
        sched = _schedule(rng)
        link = rng.choice(["latency", "slow", "mixed"])
        costs = _costs(rng, sched.num_stages, sched.num_ranks, rng.random() < 0.5, link)
        trace = simulate_links(sched, costs)
        if not (passed_validation(sched) and _one_pass(sched)):
            assert trace is None, f"case {case}: {sched.name} is not a validated schedule of the one-pass kinds"
        if passed_validation(sched) and _plain(sched):
            plain += 1
            taken += trace is not None
        if trace is not None:
            reference = simulate_events(sched, costs)
            _same_summaries(trace, reference)
            assert trace == reference, f"case {case}: {sched.name} P={sched.num_ranks} {link}"
    assert plain >= 10 and taken >= 0.8 * plain  # not vacuous: the path answers for most of them


def _one_pass(sched: Schedule) -> bool:
    """Computes, explicit activation/gradient messages and BPipe moves only (what sim/links.py takes)."""
    moves = {"EVICT", "ACCEPT", "RETURN", "LOAD"}
    return _plain(sched.with_actions([[a for a in acts if a.kind.value not in moves] for acts in sched.actions]))


@pytest.mark.parametrize("seed", range(3))
def test_one_pass_link_path_matches_event_engine_on_bpipe_schedules(seed: int) -> None:
    # BPipe on 1F1B, GPipe, interleaved and ZB-H1, with and without recomputation, on instant, slow and mixed
    # links, integer costs (so that same-time memory changes sum exactly and ties are common): the one-pass path
    # answers for most and its trace is the engine's field for field; with real-valued bytes it declines
    rng = random.Random(300 + seed)
    taken = cases = 0
    while cases < 30:
        p = rng.randint(2, 7)
        fam = rng.choice(["bpipe", "gpipe", "interleaved", "zb-h1"])
        m = p * rng.randint(1, 3) if fam == "interleaved" else p * rng.randint(1, 3) + rng.randint(0, 2)
        try:
            sched = build_schedule(fam, num_ranks=p, num_microbatches=m, bpipe=True, recompute=rng.random() < 0.3,
                                   num_chunks=rng.randint(2, 3) if fam == "interleaved" else None)
        except ConfigError:
            continue
        if not any(a.kind.value == "EVICT" for acts in sched.actions for a in acts):
            continue
        cases += 1
        link = rng.choice(["free", "latency", "slow", "mixed"])
        costs = _costs(rng, sched.num_stages, p, True, link)
        trace = simulate_links(sched, costs)
        if trace is not None:
            taken += 1
            reference = simulate_events(sched, costs)
            _same_summaries(trace, reference)
            assert trace == reference, f"{sched.name} P={p} M={m} {link}"
            assert any(t.kind.value == "EVICT" for t in trace.transfers)
        elif link == "free":
            pytest.fail(f"{sched.name} P={p} M={m}: declined on instant links with integer costs")
    print(f"one-pass path answered {taken} of {cases} BPipe cases")
    assert taken >= 0.7 * cases
