"""A step-time bound from the schedule's compute order simulated on free links: tighter than the stage-cost bounds
of :mod:`evenpipe.plan.bounds` wherever the order itself idles ranks (memory-capped V schedules, uneven stages).

In the estimate's step every compute starts no earlier than its rank's previous compute ends and than the compute
that produces its input ends (a message leaves after its producer and takes no less than no time); BPipe's and host
offload's moves, link queues and latencies only add waits. So simulating the compute order alone (with full
recomputation's ``R``, as the estimate's schedule inserts them) with every message instant gives each rank an end
no later than the estimate's. That costs a simulation, though no messages are derived and nothing is validated
(several times cheaper than an estimate): a search asks it only of fitting configurations the other bounds could
not skip.
"""

from __future__ import annotations

from typing import Sequence

from evenpipe.cost import ParallelConfig, Recompute
from evenpipe.cost.microbatch_costs import config_sim_costs
from evenpipe.cost.source import CostSource
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan.bounds import bound_with_ends, step_bound
from evenpipe.schedule import Schedule, add_recompute, compute_order
from evenpipe.schedule.memo import Memo
from evenpipe.sim.costs import StageCosts
from evenpipe.sim.rules import KB, KF, KI, KR, KW

__all__ = ["order_bound", "order_ends", "free_ends"]

_ends: Memo[tuple[float, ...]] = Memo(1 << 12)


def order_bound(source: CostSource, cfg: ParallelConfig) -> float:
    """:func:`~evenpipe.plan.bounds.step_bound` with each rank's end at least its end in :func:`order_ends`
    (:func:`~evenpipe.plan.bounds.step_bound` alone for unequal micro-batches, or where the order cannot be
    built: the estimate reports that)."""
    if cfg.microbatch_shapes is not None:
        return step_bound(source, cfg)
    try:
        ends = order_ends(source, cfg)
    except EvenpipeError:
        return step_bound(source, cfg)
    return bound_with_ends(source, cfg, ends)


def order_ends(source: CostSource, cfg: ParallelConfig) -> tuple[float, ...]:
    """Per pipeline rank, when its last compute ends in ``cfg``'s compute order on free links (remembered on the
    order and the stage costs)."""
    plan = source.plan_durations(cfg)
    full = cfg.recompute is Recompute.FULL
    stages = config_sim_costs(source, cfg).stages
    key = (cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks, plan, full, stages)

    def run() -> tuple[float, ...]:
        order = compute_order(cfg.schedule, num_ranks=cfg.pp, num_microbatches=cfg.num_microbatches,
                              num_chunks=cfg.chunks, plan_durations=plan)
        return free_ends(add_recompute(order) if full else order, stages)
    return _ends.get(key, run)


def free_ends(order: Schedule, stages: Sequence[StageCosts]) -> tuple[float, ...]:
    """Per rank, when its last compute ends when every compute starts as soon as its rank's previous compute and
    the compute producing its input end: a forward after the previous stage's forward of its micro-batch, a
    backward (``B`` or ``I``) after the next stage's; ``W`` and ``R`` after their rank's previous compute only.
    (Each rank is advanced until it waits for a compute not yet timed; that compute wakes it.)"""
    cols = order.columns
    num_stages = len(stages)
    times = {KF: [st.forward for st in stages], KB: [st.backward for st in stages],
             KI: [st.backward_input for st in stages], KW: [st.backward_weight for st in stages],
             KR: [st.recompute_time for st in stages]}
    width = 1 + max((max(row, default=0) for row in cols.microbatches), default=0)
    forward_end: dict[int, float] = {}  # stage * width + micro-batch -> end of its forward
    gradient_end: dict[int, float] = {}  # ... -> end of its B or I
    waiting: dict[int, list[int]] = {}  # 2 * (stage * width + micro-batch) + (1 for the gradient) -> ranks
    position = [0] * order.num_ranks
    clock = [0.0] * order.num_ranks
    ready = list(range(order.num_ranks))
    while ready:
        r = ready.pop()
        kinds, stage_of, mb_of = cols.kinds[r], cols.stages[r], cols.microbatches[r]
        i, now, n = position[r], clock[r], len(kinds)
        while i < n:
            k, s = kinds[i], stage_of[i]
            u = s * width + mb_of[i]
            if k == KF or k == KB or k == KI:
                forward = k == KF
                if forward and s > 0:
                    need, got = 2 * (u - width), forward_end.get(u - width)
                elif not forward and s < num_stages - 1:
                    need, got = 2 * (u + width) + 1, gradient_end.get(u + width)
                else:
                    need, got = -1, now
                if got is None:
                    waiting.setdefault(need, []).append(r)
                    break
                now = (got if got > now else now) + times[k][s]
                (forward_end if forward else gradient_end)[u] = now
                woken = waiting.pop(2 * u + (0 if forward else 1), None)
                if woken:
                    ready.extend(woken)
            else:
                now += times[k][s]
            i += 1
        position[r], clock[r] = i, now
    if any(p < len(row) for p, row in zip(position, cols.kinds)):
        raise ConfigError(f"{order.name}: its compute order waits on itself")
    return tuple(clock)
