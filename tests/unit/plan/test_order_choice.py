"""Per-batch micro-batch order (issue 34 point 5): the chooser simulates candidates and never returns an order
slower than the given one; it is deterministic; its cost at P=8 with 32 micro-batches is reported, not asserted."""

from __future__ import annotations

import itertools
import random

import pytest

from evenpipe.errors import ConfigError
from evenpipe.plan.order_choice import candidate_orders, choose_order
from evenpipe.schedule import build_schedule
from evenpipe.sim import simulate
from evenpipe.sim.costs import SimCosts, StageCosts


def _rows(sizes: list[float], stages: int) -> list[list[StageCosts]]:
    return [[StageCosts(forward=s, backward_input=2 * s, backward_weight=0.0, activation_bytes=s) for _ in range(stages)]
            for s in sizes]


def _step(schedule, rows, order) -> float:
    return simulate(schedule, SimCosts.per_microbatch([rows[i] for i in order])).step_time


def test_a_long_micro_batch_first_is_moved_off_the_fill() -> None:
    # 1F1B, P=4, one micro-batch 4x the others, given first: every stage's fill waits for it
    sched = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    rows = _rows([4.0] + [1.0] * 7, 4)
    choice = choose_order(sched, rows, max_evaluations=20)
    assert choice.given_s == pytest.approx(_step(sched, rows, range(8)))
    assert choice.predicted_s == pytest.approx(_step(sched, rows, choice.order))
    assert choice.predicted_s < choice.given_s
    assert choice.order[0] != 0 and sorted(choice.order) == list(range(8))


def test_the_choice_is_the_best_order_on_a_small_case() -> None:
    # 5 micro-batches at P=3: every permutation simulated; the chooser, given enough evaluations, finds a best one
    sched = build_schedule("1f1b", num_ranks=3, num_microbatches=5)
    rows = _rows([3.0, 1.0, 2.0, 0.5, 1.5], 3)
    best = min(_step(sched, rows, p) for p in itertools.permutations(range(5)))
    choice = choose_order(sched, rows, max_evaluations=200)
    assert choice.predicted_s <= choice.given_s
    assert choice.predicted_s == pytest.approx(best, rel=0.02)


@pytest.mark.parametrize("family", ["1f1b", "interleaved", "zb-h1", "zb-v", "bpipe"])
def test_never_slower_than_the_given_order_and_deterministic(family: str) -> None:
    rng = random.Random(7)
    sched = build_schedule(family, num_ranks=4, num_microbatches=8)
    rows = _rows([rng.uniform(0.3, 2.0) for _ in range(8)], sched.num_stages)
    a = choose_order(sched, rows, max_evaluations=6)
    b = choose_order(sched, rows, max_evaluations=6)
    assert a.order == b.order and a.predicted_s == b.predicted_s
    assert a.predicted_s <= a.given_s and a.evaluations <= 6


def test_equal_micro_batches_keep_the_given_order() -> None:
    sched = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    choice = choose_order(sched, _rows([1.0] * 8, 4))
    assert choice.order == tuple(range(8)) and choice.gain == 0.0


def test_candidates_start_with_the_given_order_and_put_cheap_ones_at_the_ends() -> None:
    cands = candidate_orders(_rows([5.0, 1.0, 3.0, 2.0], 2))
    assert cands[0] == (0, 1, 2, 3)
    ends = cands[1]
    assert ends[0] == 1 and ends[-1] == 3 and ends[1:3] in ((2, 0), (0, 2))


def test_bad_input_is_one_config_error() -> None:
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    with pytest.raises(ConfigError, match="4 micro-batches, got costs for 3"):
        choose_order(sched, _rows([1.0] * 3, 2))
    with pytest.raises(ConfigError, match="max_evaluations"):
        choose_order(sched, _rows([1.0] * 4, 2), max_evaluations=0)


def test_a_budget_stops_early() -> None:
    ticks = iter(range(1000))
    sched = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    rows = _rows([2.0, 1.0, 0.5, 3.0, 1.0, 1.5, 0.7, 2.2], 4)
    choice = choose_order(sched, rows, max_evaluations=50, budget_s=2.5, clock=lambda: float(next(ticks)))
    assert choice.evaluations <= 3
