"""BPipe as a transform of any schedule (issue 9): pairs from the memory profile, default budget, refusals."""

from __future__ import annotations

import math

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import (ScheduleFamily, bpipe_pairs, build_schedule, compute_order, held_units,
                               held_units_trace, lowest_bpipe_budget, validate)
from evenpipe.sim import SimCosts, simulate

BPIPE_FAMILIES = [("1f1b", None), ("interleaved", 2), ("interleaved", 3), ("zb-h1", None), ("gpipe", None),
                  ("looped-bfs", 2)]


@pytest.mark.parametrize("p", range(2, 9))
def test_pairs_from_the_1f1b_profile_are_x_and_p_minus_1_minus_x(p: int) -> None:
    for m in (p, 2 * p + 1):
        compute = compute_order(ScheduleFamily.ONE_F_ONE_B, num_ranks=p, num_microbatches=m)
        assert bpipe_pairs(compute) == tuple((x, p - 1 - x) for x in range(p // 2))
        assert lowest_bpipe_budget(compute) == math.ceil((p + 1) / 2)


def test_pairs_follow_the_profile_not_the_rank_numbers() -> None:
    """Whatever the ranks are called, the fullest gives to the emptiest."""
    compute = compute_order(ScheduleFamily.ONE_F_ONE_B, num_ranks=4, num_microbatches=8)
    flipped = compute.with_actions(list(reversed(compute.actions)))  # rank 3 now holds 4 units, rank 0 one
    assert held_units(flipped) == [1, 2, 3, 4]
    assert bpipe_pairs(flipped) == ((3, 0), (2, 1))


@pytest.mark.parametrize("family,v", BPIPE_FAMILIES)
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_bpipe_on_any_family_validates_and_meets_its_budget(family: str, v: int | None, p: int, m: int) -> None:
    plain = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v)
    moved = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v, bpipe=True)
    validate(moved)
    budget = moved.meta["budget"]
    assert max(held_units(moved)) <= budget <= max(held_units(plain))
    pairs = bpipe_pairs(plain.compute_only())
    assert budget >= max(math.ceil((held_units(plain)[e] + held_units(plain)[a]) / 2) for e, a in pairs)
    for acts in moved.actions:
        trace = held_units_trace(acts)
        assert min(trace) >= 0 and trace[-1] == 0
    costs = SimCosts.uniform(num_stages=plain.num_stages, num_chunks=plain.num_chunks)
    a, b = simulate(plain, costs), simulate(moved, costs)
    assert b.step_time == pytest.approx(a.step_time)  # free links: balancing costs no time
    assert max(b.peak_activations) <= max(a.peak_activations) + 1e-9


def test_interleaved_with_bpipe_cuts_the_largest_peak_by_more_than_15_percent() -> None:
    plain = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2)
    moved = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2, bpipe=True)
    costs = SimCosts.uniform(num_stages=8, num_chunks=2)
    a, b = simulate(plain, costs), simulate(moved, costs)
    assert max(b.peak_activations) <= 0.85 * max(a.peak_activations)
    assert max(a.peak_activations) == pytest.approx(5.5) and b.peak_activations == pytest.approx([4.0] * 4)
    assert b.step_time == pytest.approx(a.step_time)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 11), (8, 16)])
def test_1f1b_with_bpipe_is_the_bpipe_schedule(p: int, m: int) -> None:
    for recompute in (False, True):
        a = build_schedule("1f1b", num_ranks=p, num_microbatches=m, bpipe=True, recompute=recompute)
        b = build_schedule("bpipe", num_ranks=p, num_microbatches=m, recompute=recompute)
        assert a.actions == b.actions


def test_unmeetable_budget_names_the_smallest_that_works() -> None:
    with pytest.raises(ConfigError, match="budget 6 cannot be met .* the smallest budget that works is 8"):
        build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2, bpipe=True, bpipe_budget=6)
    ok = build_schedule("interleaved", num_ranks=4, num_microbatches=8, num_chunks=2, bpipe=True, bpipe_budget=8)
    assert max(held_units(ok)) == 8


def test_bpipe_is_refused_where_stages_hand_over_locally() -> None:
    with pytest.raises(ConfigError, match="--bpipe does not apply to schedule 'zb-v'; allowed: gpipe, 1f1b"):
        build_schedule("zb-v", num_ranks=4, num_microbatches=8, bpipe=True)
    one = build_schedule("1f1b", num_ranks=1, num_microbatches=4, bpipe=True)  # nobody to pair with: a no-op
    assert one.actions == build_schedule("1f1b", num_ranks=1, num_microbatches=4).actions
