"""Left shifting a latency-aware order: never a longer step (timed as the simulator times it), the same work on
each rank, the cap kept, and a valid schedule."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from evenpipe.schedule import ActionKind, LinkPlan
from evenpipe.schedule.generate.latency_aware import v_layout
from evenpipe.schedule.generate.latency_comm import place_messages
from evenpipe.schedule.generate.latency_compact import left_shift, timed
from evenpipe.schedule.generate.ordering import compute_schedule
from evenpipe.schedule.generate.zb_h1 import zb_h1
from evenpipe.schedule.generate.zb_v import zb_v
from evenpipe.schedule.validate import validate
from evenpipe.sim import Link, SimCosts, simulate

K = ActionKind


def _order(P: int, M: int, v_shaped: bool) -> tuple[tuple[int, ...], list[list[tuple[ActionKind, int, int]]]]:
    layout = v_layout(P) if v_shaped else tuple(range(P))
    sched = zb_v(num_ranks=P, num_microbatches=M, stage_to_rank=layout) if v_shaped else \
        zb_h1(num_ranks=P, num_microbatches=M)
    return layout, [[(a.kind, a.stage, a.microbatch) for a in acts] for acts in sched.actions]


def _peak(work: list[tuple[ActionKind, int, int]]) -> int:
    held = peak = 0
    for kind, _, _ in work:
        held += 1 if kind is K.FORWARD else -1 if kind is K.BACKWARD_WEIGHT else 0
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("seed", range(10))
def test_never_longer_same_work_within_cap_and_valid(seed: int) -> None:
    rng = random.Random(seed)
    P, M, v_shaped = rng.choice((2, 4, 6)), 0, rng.random() < 0.5
    M = rng.choice((1, 2, 3)) * P
    lat = tuple(tuple(0.0 if a == b else rng.choice((0.0, 0.25, 0.5, 1.0)) for b in range(P)) for a in range(P))
    plan = LinkPlan(forward=rng.choice((0.5, 1.0)), backward_input=1.0, backward_weight=rng.choice((0.5, 1.0)),
                    message=lat)
    layout, work = _order(P, M, v_shaped)
    cap = max(_peak(w) for w in work)
    before = timed(work, layout, plan)
    assert before is not None
    shifted = left_shift(work, layout, plan, cap)
    assert shifted is not None
    new, step = shifted
    assert step <= before.step + 1e-9
    assert [Counter(w) for w in new] == [Counter(w) for w in work]
    assert max(_peak(w) for w in new) <= cap
    compute = compute_schedule("t", num_ranks=P, num_microbatches=M, stage_to_rank=layout, work=new)
    validate(place_messages(compute, plan))


def test_timed_is_the_simulators_step() -> None:
    """One message at a time per link, in the sender's order: the simulator's step for the placed schedule."""
    P, M = 4, 8
    layout, work = _order(P, M, True)
    plan = LinkPlan.uniform(num_ranks=P, latency=0.5)
    new, step = left_shift(work, layout, plan, max(_peak(w) for w in work)) or ([], 0.0)
    full = place_messages(compute_schedule("t", num_ranks=P, num_microbatches=M, stage_to_rank=layout, work=new),
                          plan)
    links = {(a, b): Link(latency_s=0.5) for a in range(P) for b in range(P) if a != b}
    stages = SimCosts.uniform(num_stages=2 * P, num_chunks=2, forward=1.0, backward=1.0, weight=1.0).stages
    assert simulate(full, SimCosts.from_stages(stages, links=links)).step_time == pytest.approx(step)
