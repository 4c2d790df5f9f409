"""A step-time bound from the schedule's compute order timed alone: tighter than the stage-cost bounds of
:mod:`evenpipe.plan.bounds` wherever the order itself idles ranks (memory-capped V schedules, uneven stages).

In the estimate's step every compute starts no earlier than its rank's previous compute ends, and than the compute
producing its input ends plus the transfer time of that message over its link (a message leaves once its producer
has ended; link queues, late receives, BPipe's and host offload's moves only add waits). So timing the compute order
alone (with full recomputation's ``R``, as the estimate's schedule inserts them) under exactly those constraints
gives each rank an end no later than the estimate's. It is a longest path over the order's columns, several times
cheaper than an estimate (no messages derived, nothing validated, no simulation): a search asks it only of fitting
configurations the other bounds could not skip.
"""

from __future__ import annotations

from typing import Sequence

from evenpipe.cost import ParallelConfig, Recompute
from evenpipe.cost.microbatch_costs import config_sim_costs
from evenpipe.cost.source import CostSource
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan.bounds import bound_with_ends, stage_layout, step_bound
from evenpipe.schedule import Schedule, add_recompute, compute_order
from evenpipe.schedule.memo import Memo
from evenpipe.sim.costs import SimCosts, StageCosts
from evenpipe.sim.rules import KB, KF, KI, KR, KW

__all__ = ["order_bound", "order_ends", "free_ends", "message_delays"]

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
    """Per pipeline rank, when its last compute ends in ``cfg``'s compute order with every message taking its
    link's transfer time and never queueing (remembered on the order, the stage costs and those times)."""
    plan = source.plan_durations(cfg)
    full = cfg.recompute is Recompute.FULL
    costs = config_sim_costs(source, cfg)
    delays = message_delays(stage_layout(cfg.schedule, cfg.pp, cfg.chunks), costs)

    def run() -> tuple[float, ...]:
        order = compute_order(cfg.schedule, num_ranks=cfg.pp, num_microbatches=cfg.num_microbatches,
                              num_chunks=cfg.chunks, plan_durations=plan)
        return free_ends(add_recompute(order) if full else order, costs.stages, delays)
    return _ends.get((cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks, plan, full, costs.stages, delays), run)


def message_delays(stage_to_rank: Sequence[int], costs: SimCosts) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage s, the least time its input activation takes to arrive from stage s-1 and its output gradient
    from stage s+1 (0 on one rank; else the link's transfer time of the smaller of the two stages' outputs)."""
    stages = costs.stages
    num = len(stages)

    def delay(src: int, dst: int) -> float:
        a, b = stage_to_rank[src], stage_to_rank[dst]
        if a == b:
            return 0.0
        return costs.link(a, b).transfer_time(min(stages[src].output_bytes, stages[dst].output_bytes))
    return (tuple(delay(s - 1, s) if s > 0 else 0.0 for s in range(num)),
            tuple(delay(s + 1, s) if s < num - 1 else 0.0 for s in range(num)))


def free_ends(order: Schedule, stages: Sequence[StageCosts],
              delays: tuple[Sequence[float], Sequence[float]] | None = None) -> tuple[float, ...]:
    """Per rank, when its last compute ends when every compute starts as soon as its rank's previous compute
    ends and its input has arrived: a forward's from the previous stage's forward of its micro-batch, a backward's
    (``B`` or ``I``) from the next stage's, ``delays`` (:func:`message_delays`; none: instant) after the producer
    ends; ``W`` and ``R`` wait for their rank's previous compute only. (Each rank is advanced until it waits for
    a compute not yet timed; that compute wakes it.)"""
    cols = order.columns
    num_stages = len(stages)
    forward_delay, backward_delay = delays if delays is not None else ((0.0,) * num_stages,) * 2
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
                    wait = forward_delay[s]
                elif not forward and s < num_stages - 1:
                    need, got = 2 * (u + width) + 1, gradient_end.get(u + width)
                    wait = backward_delay[s]
                else:
                    need, got, wait = -1, now, 0.0
                if got is None:
                    waiting.setdefault(need, []).append(r)
                    break
                got += wait
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
