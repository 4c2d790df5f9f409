"""How long host offload's reloads keep a rank idle at least: a term of the planner's step-time bound.

Host offload (:func:`evenpipe.schedule.add_offload`, as the estimate's schedule places it: prefetched) copies a
micro-batch's saved activations to host memory after its forward, unless its use comes next, and back before their
first use (``R``, ``B`` or ``I``), one forward earlier when a forward of another micro-batch comes after the last
use. A reload with no compute of its rank between it and its use (the cool-down, or any backward right after a
backward) is reached only when the rank's previous compute ends, and the use waits for the copy to land: the rank
idles at least that copy's transfer time there. These idle spans lie between distinct pairs of consecutive
computes, so a rank ends no earlier than its start plus all its work plus their sum (the simulator only adds to
them: link queues, the offload each reload waits for, the other ranks).
"""

from __future__ import annotations

import functools

from evenpipe.cost import ParallelConfig, Recompute
from evenpipe.errors import EvenpipeError
from evenpipe.schedule import ActionKind, ScheduleFamily, add_recompute, compute_order
from evenpipe.sim.costs import SimCosts

__all__ = ["exposed_reloads", "reload_waits"]

_FORWARD, _WEIGHT = ActionKind.FORWARD.code, ActionKind.BACKWARD_WEIGHT.code
_USES = frozenset(k.code for k in (ActionKind.RECOMPUTE, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT))


def reload_waits(cfg: ParallelConfig, costs: SimCosts, plan_durations: tuple[int, int, int] | None) -> tuple[float, ...]:
    """Per pipeline rank, the least idle time its exposed reloads cost (0 without offload, under BPipe, whose
    offload this does not model, or when the schedule cannot be built: the estimate reports that)."""
    if not cfg.offload_ranks or cfg.uses_bpipe:
        return (0.0,) * cfg.pp
    try:
        stages = exposed_reloads(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks, plan_durations,
                                 cfg.recompute is Recompute.FULL)[:cfg.offload_ranks]
    except EvenpipeError:
        return (0.0,) * cfg.pp
    per_mb = costs.microbatch_stages or (costs.stages,)
    # a recomputed micro-batch's copy moves its checkpoint, another its saved activations: the least it may move
    moved = [min(min(st.activation_bytes, st.checkpoint_bytes) if cfg.recompute is Recompute.FULL
                 else st.activation_bytes for st in column) for column in zip(*per_mb)]
    waits = tuple(sum(costs.link(r, r).transfer_time(moved[s]) for s in row) for r, row in enumerate(stages))
    return waits + (0.0,) * (cfg.pp - len(waits))


@functools.lru_cache(maxsize=1024)
def exposed_reloads(family: ScheduleFamily, pp: int, num_microbatches: int, chunks: int,
                    plan_durations: tuple[int, int, int] | None, recompute: bool) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, were it to offload, the stage of each reload whose next compute is its use, in the
    compute order (and recomputation) of the estimate's schedule. Each rank's offload depends on its own order
    only, so the first k ranks' rows serve every k. Follows :func:`~evenpipe.schedule.add_offload` with
    ``prefetch`` on the action columns (a test checks it against the actions that function places)."""
    compute = compute_order(family, num_ranks=pp, num_microbatches=num_microbatches, num_chunks=chunks,
                            plan_durations=plan_durations)
    if recompute:
        compute = add_recompute(compute)
    cols = compute.columns
    out = []
    for kinds, stages, mbs in zip(cols.kinds, cols.stages, cols.microbatches):
        exposed: list[int] = []
        away: set[tuple[int, int]] = set()  # offloaded, not yet reloaded
        last_forward: tuple[int, int] | None = None  # the forward a reload may be issued before, if any
        n = len(kinds)
        for i in range(n):
            kind, key = kinds[i], (stages[i], mbs[i])
            if kind in _USES and key in away:
                if last_forward is None or last_forward == key:  # no other forward to hide the copy behind
                    exposed.append(key[0])
                away.discard(key)
                last_forward = None
            if kind == _FORWARD:
                last_forward = key
                if not (i + 1 < n and kinds[i + 1] in _USES and (stages[i + 1], mbs[i + 1]) == key):
                    away.add(key)
            elif kind in _USES or kind == _WEIGHT:
                last_forward = None
        out.append(tuple(exposed))
    return tuple(out)
