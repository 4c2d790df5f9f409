"""BPipe transform: pairs, budget in program order, loads one slot before use, clear errors."""

from __future__ import annotations

import math

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import (ActionKind, bpipe_partner, bpipe_transform, build_schedule, default_bpipe_budget,
                               held_units, held_units_trace, validate)
from evenpipe.sim import SimCosts, simulate

K = ActionKind


def test_partner() -> None:
    assert [bpipe_partner(r, 4) for r in range(4)] == [3, 2, 1, 0]
    assert [bpipe_partner(r, 5) for r in range(5)] == [4, 3, None, 1, 0]
    assert bpipe_partner(0, 1) is None
    with pytest.raises(ConfigError, match="rank 4 out of range 0..3"):
        bpipe_partner(4, 4)


def test_default_budget() -> None:
    assert [default_bpipe_budget(p) for p in (1, 2, 3, 4, 5, 8, 16)] == [1, 2, 2, 3, 3, 5, 9]


@pytest.mark.parametrize("P", [2, 3, 4, 5, 6, 7, 8, 11, 16])
@pytest.mark.parametrize("factor", [1, 2])
def test_peak_is_ceil_half_and_held_in_program_order(P: int, factor: int) -> None:
    M = factor * P + (P % 3)
    s = build_schedule("bpipe", num_ranks=P, num_microbatches=M)
    budget = math.ceil((P + 1) / 2)
    assert held_units(s) == [budget] * P  # balanced: every rank, own plus hosted
    for acts in s.actions:
        trace = held_units_trace(acts)
        assert min(trace) >= 0 and max(trace) <= budget and trace[-1] == 0
    for r in range(P):
        kinds = {a.kind for a in s.actions[r]}
        partner = bpipe_partner(r, P)
        if partner is None:
            assert not kinds & {K.EVICT, K.ACCEPT, K.LOAD, K.RETURN}
        for a in s.actions[r]:
            if a.kind in (K.EVICT, K.ACCEPT, K.LOAD, K.RETURN):
                assert a.peer == partner
            if a.kind in (K.EVICT, K.LOAD):
                assert r < P / 2  # only the lower half evicts
    # the compute order is 1F1B's: step time is unchanged
    one = build_schedule("1f1b", num_ranks=P, num_microbatches=M)
    assert s.compute_only().actions == one.compute_only().actions


def test_loads_one_compute_slot_before_first_use() -> None:
    for recompute in (False, True):
        s = build_schedule("bpipe", num_ranks=8, num_microbatches=24, recompute=recompute)
        assert any(a.kind is K.LOAD for a in s.actions[0])
        for acts in s.actions:
            for i, a in enumerate(acts):
                if a.kind is not K.LOAD:
                    continue
                later = [b for b in acts[i + 1:] if b.kind.is_compute]
                use = next(j for j, b in enumerate(later) if b.key == a.key)
                assert later[use].kind is (K.RECOMPUTE if recompute else K.BACKWARD)
                assert use <= 1  # at most one compute between the load and the first use
                evicts = [j for j, b in enumerate(acts[:i]) if b.kind is K.EVICT and b.key == a.key]
                assert len(evicts) == 1


def test_impossible_budget_names_the_smallest_that_works() -> None:
    pattern = r"bpipe budget 1 cannot be met .* smallest budget that works is (\d+)"
    with pytest.raises(ConfigError, match=pattern) as info:
        build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_budget=1)
    smallest = int(str(info.value).rsplit(" ", 1)[-1])
    assert smallest > 1
    s = build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_budget=smallest)
    assert max(held_units(s)) <= smallest
    if smallest > 2:
        with pytest.raises(ConfigError):
            build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_budget=smallest - 1)


def test_budget_below_one() -> None:
    with pytest.raises(ConfigError, match="bpipe budget must be >= 1 activation unit, got 0"):
        build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_budget=0)


def test_generous_budget_moves_nothing() -> None:
    s = build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_budget=4)
    assert not any(a.kind is K.EVICT for acts in s.actions for a in acts)
    assert s.meta["budget"] == 4


def test_tighter_budget_than_default_when_possible() -> None:
    s = build_schedule("bpipe", num_ranks=8, num_microbatches=16, bpipe_budget=6)
    assert max(held_units(s)) == 6


def test_transform_of_a_full_1f1b_schedule() -> None:
    one = build_schedule("1f1b", num_ranks=6, num_microbatches=12)
    moved = bpipe_transform(one)
    validate(moved)
    assert moved.actions == build_schedule("bpipe", num_ranks=6, num_microbatches=12).actions
    assert moved.meta["budget"] == 4 and moved.meta["bpipe"] is True and moved.name == "1f1b"


def test_needs_stage_boundaries_that_cross_ranks() -> None:
    v = build_schedule("zb-v", num_ranks=2, num_microbatches=4)
    with pytest.raises(ConfigError, match="stages 1 and 2 of 'zb-v' share rank 1"):
        bpipe_transform(v)


def test_evictor_holds_budget_with_recompute() -> None:
    s = build_schedule("bpipe", num_ranks=6, num_microbatches=13, recompute=True)
    assert max(held_units(s)) == 4


@pytest.mark.parametrize("P,M", [(4, 8), (8, 16), (6, 20)])
def test_evictions_overlap_the_next_compute(P: int, M: int) -> None:
    # with an even P the acceptor has room for the early placement: EVICT(m) right after F(m) and its send
    s = build_schedule("bpipe", num_ranks=P, num_microbatches=M)
    evicted = 0
    for acts in s.actions[: P // 2]:
        computes_since_forward = {}
        count = 0
        for a in acts:
            if a.kind is K.FORWARD:
                computes_since_forward[a.key] = count
            if a.kind.is_compute:
                count += 1
            if a.kind is K.EVICT:
                evicted += 1
                assert count - computes_since_forward[a.key] == 1  # no compute between F and EVICT
    assert evicted > 0


def test_balance_moves_one_more_on_the_middle_pair() -> None:
    one = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    plain = bpipe_transform(one, balance=False)
    balanced = bpipe_transform(one)
    assert held_units(plain) == [3, 3, 2, 3]  # rank 1 never needs room, so rank 2 hosts nothing
    assert held_units(balanced) == [3, 3, 3, 3]
    moved = [a for a in balanced.actions[1] if a.kind is K.EVICT]
    assert len(moved) == 1 and not any(a.kind is K.EVICT for a in plain.actions[1])
    validate(plain)
    validate(balanced)


@pytest.mark.parametrize("P", range(2, 9))
def test_program_order_count_is_what_the_simulator_measures(P: int) -> None:
    # free links, F=1, B=2: every rank's simulated peak (own plus hosted) is exactly its held_units
    for M in (1, P, P + 2, 2 * P + 1, 3 * P):
        for recompute in (False, True):
            s = build_schedule("bpipe", num_ranks=P, num_microbatches=M, recompute=recompute)
            costs = SimCosts.uniform(num_stages=P, checkpoint_bytes=1.0 if recompute else None)
            assert simulate(s, costs).peak_activations == pytest.approx(held_units(s)), (M, recompute)
