"""The instant-link evaluator times unequal micro-batches (issue 34 point 5 needs many quick simulations of one
schedule under reordered micro-batches): both of its paths give the event engine's trace, float for float --
step, every action's times, every transfer (with each micro-batch's bytes) and every rank's memory timeline."""

from __future__ import annotations

import random

import pytest

from evenpipe.schedule import build_schedule
from evenpipe.sim import free
from evenpipe.sim.costs import SimCosts, StageCosts
from evenpipe.sim.dispatch import simulate
from evenpipe.sim.engine import simulate_events

FAMILIES = ["gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "zb-v", "v-half", "dualpipev"]


def _costs(num_stages: int, num_microbatches: int, seed: int) -> SimCosts:
    rng = random.Random(seed)
    rows = [[StageCosts(forward=rng.uniform(0.5, 2.0), backward_input=rng.uniform(0.5, 3.0),
                        backward_weight=rng.uniform(0.0, 1.0), activation_bytes=rng.uniform(1.0, 5.0),
                        output_bytes=rng.uniform(0.0, 1.0), checkpoint_bytes=0.3, weight_grad_bytes=0.2)
             for _ in range(num_stages)] for _ in range(num_microbatches)]
    return SimCosts.per_microbatch(rows)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_both_free_paths_equal_the_engine_on_unequal_microbatches(family: str, recompute: bool) -> None:
    sched = build_schedule(family, num_ranks=4, num_microbatches=8, recompute=recompute)
    costs = _costs(sched.num_stages, 8, seed=len(family) + recompute)
    assert costs.microbatch_stages is not None
    ref = simulate_events(sched, costs)
    for trust in (True, False):
        got = free.run(sched, costs, trust_validation=trust)
        assert got.evaluator == "free"
        assert got.step_time == ref.step_time
        assert got.memory == ref.memory
        assert got.transfers == ref.transfers
        assert [got.action_times(r) for r in range(4)] == [ref.action_times(r) for r in range(4)]
    assert simulate(sched, costs).evaluator == "free"
