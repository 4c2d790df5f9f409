"""BPipe's eviction plan by each micro-batch's bytes (issue 34 point 3): weights count a micro-batch's activation
units, the evictor evicts by them, and the simulated bytes keep to the budget."""

from __future__ import annotations

import random

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule, held_units
from evenpipe.schedule.ir import ActionKind
from evenpipe.schedule.validate import validate
from evenpipe.sim import simulate
from evenpipe.sim.costs import SimCosts, StageCosts


def _evictions(schedule) -> int:  # type: ignore[no-untyped-def]
    return sum(a.kind is ActionKind.EVICT for acts in schedule.actions for a in acts)


def _bytes_costs(weights: tuple[float, ...], num_stages: int) -> SimCosts:
    return SimCosts.per_microbatch([[StageCosts(forward=w, backward_input=2 * w, activation_bytes=w)
                                     for _ in range(num_stages)] for w in weights])


def test_whole_weights_are_the_unweighted_plan() -> None:
    plain = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    same = build_schedule("bpipe", num_ranks=4, num_microbatches=8, bpipe_weights=(1.0,) * 8)
    assert same.actions == plain.actions


def test_small_micro_batches_need_fewer_evictions() -> None:
    # 1F1B on 4 ranks: rank 0 holds up to 4 consecutive micro-batches. With weights 1, .5, .5, 1, .5, .5, ...
    # any 4 consecutive ones weigh at most 3 units, the budget: rank 0 need evict nothing (the middle pair still
    # moves one micro-batch to balance), where whole units evict on every steady-state forward.
    weights = tuple(1.0 if m % 3 == 0 else 0.5 for m in range(12))
    plain = build_schedule("bpipe", num_ranks=4, num_microbatches=12, bpipe_budget=3)
    weighted = build_schedule("bpipe", num_ranks=4, num_microbatches=12, bpipe_budget=3, bpipe_weights=weights)
    validate(weighted)
    rank0 = sum(a.kind is ActionKind.EVICT for a in weighted.actions[0])
    assert rank0 == 0 < sum(a.kind is ActionKind.EVICT for a in plain.actions[0])
    assert _evictions(weighted) < _evictions(plain)
    assert max(held_units(weighted, weights)) <= 3


@pytest.mark.parametrize("P", [4, 6, 8])
def test_simulated_bytes_keep_to_the_budget(P: int) -> None:
    rng = random.Random(P)
    for M in (P, 2 * P + 1):
        weights = tuple(rng.choice((0.25, 0.5, 0.75, 1.0)) for _ in range(M))
        sched = build_schedule("bpipe", num_ranks=P, num_microbatches=M, bpipe_weights=weights)
        validate(sched)
        budget = sched.meta["budget"]
        trace = simulate(sched, _bytes_costs(weights, P))
        for r, m in enumerate(trace.memory):  # bytes are weights: one unit is a weight-1 micro-batch's
            assert max(level for _, level in m.points) <= budget + 1e-9, (P, M, r)


def test_bad_weights_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="need 4 micro-batch weights") as err:
        build_schedule("bpipe", num_ranks=4, num_microbatches=4, bpipe_weights=(1.0, 0.0, 1.0, 1.0, 1.0))
    assert "\n" not in str(err.value)
