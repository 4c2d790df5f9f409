"""Cheap lower bounds on a configuration's step time, used to skip simulations that cannot win.

Vocabulary follows :mod:`evenpipe.sim.costs`: per stage ``forward``, ``backward_input`` (I), ``backward_weight`` (W,
separate only in split-backward schedules such as ZB-H1), and ``recompute`` (an extra forward, only under full
recomputation). ``work`` of a rank is the compute it must run for all ``m`` micro-batches.

The bound of a configuration (:func:`step_time_lower_bound`) mirrors how :func:`evenpipe.cost.estimate` composes the
step: simulated makespan, then the data-parallel reduction each rank starts after its last compute (hidden behind
that compute when overlapped), then the optimizer step. Every term below is a lower bound of the matching term
there; ``tests/unit/plan`` checks the result against ``estimate`` on many configurations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from evenpipe.cost import Efficiency, Hardware, ModelSpec, ParallelConfig, Recompute, stage_layers
from evenpipe.cost.parallel import layers_per_rank
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.microbatch_costs import config_sim_costs
from evenpipe.cost.source import CostSource, Holding, shape_of
from evenpipe.cost.timing import LayerTimes
from evenpipe.plan.reload_bound import reload_waits
from evenpipe.schedule import ScheduleFamily
from evenpipe.schedule.memo import Memo
from evenpipe.sim.costs import SimCosts, StageCosts

__all__ = ["PipelineBounds", "pipeline_bounds", "step_time_lower_bound", "step_bound", "offload_bound",
           "bound_with_ends", "stage_layout", "work_lower_bound", "work_bound"]

@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineBounds:
    """Lower bounds (seconds) on one simulated step."""

    makespan: float
    """On the simulated step time (the last compute of any rank)."""
    first_rank_end: float
    """On the end of rank 0's last compute."""
    rank_ends: tuple[float, ...] = ()
    """Per rank, a bound on the end of its last compute: its start (``prefix_f`` of its lowest stage) plus all
    its work."""
    rank_hideable: tuple[float, ...] = ()
    """Per rank, an upper bound on what an overlapped gradient reduction can hide behind: the backward (and
    recomputation) work of one micro-batch over all of the rank's stages."""


def stage_layout(family: ScheduleFamily, pp: int, chunks: int) -> tuple[int, ...]:
    """Rank of each stage under ``family``'s placement (looped: stage s on rank s mod p; V: s or 2p-1-s)."""
    return family.traits.stage_to_rank(pp, chunks)


def pipeline_bounds(costs: SimCosts, stage_to_rank: tuple[int, ...], num_microbatches: int, *,
                    recompute: bool, split_backward: bool) -> PipelineBounds:
    """Bounds valid for any schedule with this layout and these costs (a message never arrives sooner than its
    link's latency plus bytes over bandwidth after it is sent).

    For a rank r whose lowest stage is s: micro-batch 0 must pass the forwards of stages 0..s-1 and the messages
    between them before r can start (``prefix_f[s]``), and r then runs all its work. The micro-batch of r's last
    (input-gradient) backward must then still pass the input gradients of stages s-1..0 and their messages
    (``prefix_i[s]``), ending on rank 0. So rank 0's end, and the makespan, are at least
    ``prefix_f[s] + m·work_r + prefix_i[s]``, where in split-backward schedules ``work_r`` leaves out the weight
    gradients (they may run after r's last input gradient, in parallel with the
    chain). Tight for uniform 1F1B, where it is (m + p − 1)(F + B).

    Unequal micro-batches (``costs.microbatch_stages``): the work is summed over the micro-batches, the prefixes
    take each stage's smallest micro-batch (any one may go first or last), and what a reduction can hide takes
    the largest.
    """
    m = num_microbatches
    num_ranks = 1 + max(stage_to_rank)
    per_mb = costs.microbatch_stages
    rows = _rows(costs.stages if per_mb is None else _smallest(per_mb), recompute)
    work = [0.0] * num_ranks
    work_to_last_i = [0.0] * num_ranks
    lowest = [len(stage_to_rank)] * num_ranks
    hideable = [0.0] * num_ranks
    for s, r in enumerate(stage_to_rank):
        if s < lowest[r]:
            lowest[r] = s
    if per_mb is None:  # one pass (the planner's usual case)
        for (forward, backward, backward_input, extra, _), r in zip(rows, stage_to_rank):
            work[r] += forward + backward + extra
            work_to_last_i[r] += forward + extra + (backward_input if split_backward else backward)
            hideable[r] += backward + extra  # B, or I + W: the same sum
        total, total_to_last_i = [m * w for w in work], [m * w for w in work_to_last_i]
    else:  # sums over the micro-batches, shrunk below their rounding
        for each in [_rows(row, recompute) for row in per_mb]:
            mb_hide = [0.0] * num_ranks
            for (forward, backward, backward_input, extra, _), r in zip(each, stage_to_rank):
                work[r] += forward + backward + extra
                work_to_last_i[r] += forward + extra + (backward_input if split_backward else backward)
                mb_hide[r] += backward + extra
            hideable = [max(a, b) for a, b in zip(hideable, mb_hide)]
        total = [w * _SUM_MARGIN for w in work]
        total_to_last_i = [w * _SUM_MARGIN for w in work_to_last_i]
    prefix_f, prefix_i = _prefixes(rows, stage_to_rank, costs)
    # rank r's own work ends no earlier than its start plus all of it; its last input gradient, no earlier than its
    # start plus all work up to it, and that micro-batch's input gradient then reaches stage 0 on rank 0
    rank_ends = tuple(prefix_f[lowest[r]] + total[r] for r in range(num_ranks))
    own_end = max(rank_ends)
    first_end = max(total[0], max(prefix_f[lowest[r]] + total_to_last_i[r] + prefix_i[lowest[r]]
                                  for r in range(num_ranks)))
    return PipelineBounds(makespan=max(own_end, first_end), first_rank_end=first_end, rank_ends=rank_ends,
                          rank_hideable=tuple(hideable))


_SUM_MARGIN = 1.0 - 1e-12
"""Shrinks a sum over unequal micro-batches below the rounding of the simulator's own additions."""
_Row = tuple[float, float, float, float, float]


def _rows(stages: Sequence[StageCosts], recompute: bool) -> list[_Row]:
    """Per stage (forward, backward, input gradient, recompute if counted, output bytes)."""
    seen: dict[int, _Row] = {}  # equal stages are often one object
    rows = []
    for st in stages:
        row = seen.get(id(st))
        if row is None:
            row = seen[id(st)] = (st.forward, st.backward, st.backward_input,
                                  st.recompute_time if recompute else 0.0, st.output_bytes)
        rows.append(row)
    return rows


def _smallest(per_mb: tuple[tuple[StageCosts, ...], ...]) -> list[StageCosts]:
    """Per stage, the smallest of every field over the micro-batches."""
    out = []
    for column in zip(*per_mb):
        out.append(StageCosts(forward=min(c.forward for c in column),
                              backward_input=min(c.backward_input for c in column),
                              backward_weight=min(c.backward_weight for c in column),
                              recompute=min(c.recompute_time for c in column),
                              output_bytes=min(c.output_bytes for c in column)))
    return out


def _prefixes(rows: list[_Row], stage_to_rank: tuple[int, ...], costs: SimCosts) -> tuple[list[float], list[float]]:
    """prefix_f[s]: forwards of stages 0..s-1 plus the activation messages between them up to stage s;
    prefix_i[s]: input gradients of stages s-1..0 plus the gradient messages from stage s down to stage 0."""
    prefix_f, prefix_i = [0.0], [0.0]
    times: dict[tuple[int, float], float] = {}  # (link object, bytes) -> transfer time: few links are distinct
    num_stages = len(rows)
    link = costs.link
    for k, (forward, _, backward_input, _, output_bytes) in enumerate(rows):
        fwd_msg = bwd_msg = 0.0
        if k + 1 < num_stages and stage_to_rank[k] != stage_to_rank[k + 1]:
            src, dst = stage_to_rank[k], stage_to_rank[k + 1]
            size = min(output_bytes, rows[k + 1][4])
            there, back = link(src, dst), link(dst, src)
            fwd_msg = times.get((id(there), size), -1.0)
            if fwd_msg < 0.0:
                fwd_msg = times[(id(there), size)] = there.transfer_time(size)
            bwd_msg = times.get((id(back), size), -1.0)
            if bwd_msg < 0.0:
                bwd_msg = times[(id(back), size)] = back.transfer_time(size)
        prefix_f.append(prefix_f[-1] + forward + fwd_msg)
        prefix_i.append(prefix_i[-1] + backward_input + bwd_msg)
    return prefix_f, prefix_i


_CACHE_LIMIT = 1 << 16
"""Entries each bound cache holds before it starts over (one search makes a few thousand)."""
_pipeline_cache: Memo[PipelineBounds] = Memo(_CACHE_LIMIT)
_bound_cache: Memo[float] = Memo(_CACHE_LIMIT)


def _pipeline_key(source: CostSource, cfg: ParallelConfig) -> tuple[object, ...]:
    """What :func:`pipeline_bounds` of ``cfg`` depends on: the stage costs' fields (not the optimizer's sharding,
    nor BPipe's transform, which adds links between partners only), the placement, m and the backward split.
    Schedules with one placement share their bounds (1F1B and bpipe; interleaved with and without BPipe)."""
    traits = cfg.schedule.traits
    return (source, traits.placement, traits.split_backward, cfg.pp, cfg.chunks, cfg.layout,
            cfg.microbatch_size, cfg.num_microbatches, cfg.tp, cfg.sequence_parallel, cfg.attention, cfg.recompute,
            cfg.microbatch_shapes)


def _pipeline_bounds_of(source: CostSource, cfg: ParallelConfig, key: tuple[object, ...]) -> PipelineBounds:
    """Pipeline bounds, shared by the configurations with one :func:`_pipeline_key`."""
    return _pipeline_cache.get(key, lambda: pipeline_bounds(
        config_sim_costs(source, cfg), stage_layout(cfg.schedule, cfg.pp, cfg.chunks),
        cfg.num_microbatches, recompute=cfg.recompute is Recompute.FULL,
        split_backward=cfg.schedule.traits.split_backward))


def step_time_lower_bound(model: ModelSpec, hw: Hardware, cfg: ParallelConfig,
                          efficiency: Efficiency | None = None) -> float:
    """:func:`step_bound` under the analytic source of ``model`` on ``hw``."""
    return step_bound(AnalyticSource(model, hw, efficiency or Efficiency()), cfg)


def step_bound(source: CostSource, cfg: ParallelConfig) -> float:
    """A lower bound on ``estimate_with(source, cfg).step_time_s`` from stage costs alone (no schedule, no
    simulation).

    ``max(makespan, rank 0's end + its exposed data-parallel reduction, each rank's own end + its exposed
    reduction) + optimizer step (+ the source's fixed cost)``, where the reductions and the optimizer step count
    what ``estimate`` counts on each rank (its layers, the embedding on rank 0, the head on rank p-1: under
    evenpipe's runtime both are replicated over tp, which makes rank 0's reduction markedly longer), a reduction
    hides behind at most one micro-batch's backward work of its rank (``estimate`` hides it behind the last
    one's), and the optimizer step is the longest rank's when every rank waits for all, else the shortest's.
    Remembered per :func:`_pipeline_key`, data parallelism and the optimizer's sharding (all it depends on).
    """
    pipeline_key = _pipeline_key(source, cfg)
    key = (pipeline_key, cfg.dp, cfg.distributed_optimizer)
    return _bound_cache.get(key, lambda: _step_bound(source, cfg, _pipeline_bounds_of(source, cfg, pipeline_key)))


def offload_bound(source: CostSource, cfg: ParallelConfig) -> float:
    """:func:`step_bound` with each offloading rank's end delayed by the idle time its exposed reloads cost at
    least (:mod:`evenpipe.plan.reload_bound`); :func:`step_bound` itself without host offload (or under BPipe).
    It walks the schedule's compute order, so a search asks it only of what the step bound could not skip."""
    if not cfg.offload_ranks or cfg.uses_bpipe:
        return step_bound(source, cfg)
    pipeline_key = _pipeline_key(source, cfg)

    def bound() -> float:
        b = _pipeline_bounds_of(source, cfg, pipeline_key)
        waits = reload_waits(cfg, config_sim_costs(source, cfg), source.plan_durations(cfg))
        return bound_with_ends(source, cfg, [end + w for end, w in zip(b.rank_ends, waits)])
    key = (pipeline_key, cfg.dp, cfg.distributed_optimizer, cfg.schedule, cfg.offload_ranks)
    return _bound_cache.get(key, bound)


def bound_with_ends(source: CostSource, cfg: ParallelConfig, ends: Sequence[float]) -> float:
    """:func:`step_bound` with each rank's last compute ending no earlier than ``ends[r]`` (a lower bound known
    from elsewhere: exposed reloads, a simulation of the compute order)."""
    b = _pipeline_bounds_of(source, cfg, _pipeline_key(source, cfg))
    rank_ends = tuple(max(a, e) for a, e in zip(b.rank_ends, ends))
    return _step_bound(source, cfg, dataclasses.replace(b, rank_ends=rank_ends, makespan=max(b.makespan, *rank_ends)))


def _step_bound(source: CostSource, cfg: ParallelConfig, b: PipelineBounds) -> float:
    dps, opts = _rank_times(source, cfg, _layers_on(source.model, cfg))
    overlap = source.reduction_overlaps_backward
    hidden = b.rank_hideable[0] if overlap else 0.0
    pipeline = max(b.makespan, b.first_rank_end + max(0.0, dps[0] - hidden))
    # every rank reduces its own gradients after its last compute, hiding at most one micro-batch's backward
    for end, dp_r, hide in zip(b.rank_ends, dps, b.rank_hideable):
        pipeline = max(pipeline, end + max(0.0, dp_r - (hide if overlap else 0.0)))
    opt = max(opts) if source.optimizer_waits_for_all_ranks else min(opts)
    return pipeline + opt + source.step_overhead_s


def _rank_times(source: CostSource, cfg: ParallelConfig, layers_on: list[int]) -> tuple[list[float], list[float]]:
    """Every rank's data-parallel reduction and optimizer step over what it holds: its layers, the embedding on
    rank 0 and the head on the last rank. A uniform source is asked once per distinct holding (rank 0 then stands
    for all, and the middle ranks of a balanced layout hold alike)."""
    last = len(layers_on) - 1
    uniform = source.uniform
    seen: dict[tuple[int, bool, bool], tuple[float, float]] = {}
    dps, opts = [], []
    for r, n in enumerate(layers_on):
        key = (n, r == 0, r == last)
        times = seen.get(key) if uniform else None
        if times is None:
            held = Holding(layers=n, embedding=key[1], head=key[2])
            asked = 0 if uniform else r
            times = seen[key] = (source.reduce_time(cfg, asked, held), source.optimizer_time(cfg, asked, held))
        dps.append(times[0])
        opts.append(times[1])
    return dps, opts


_WORK_MARGIN = 1.0 - 1e-9
"""Shrinks :func:`work_bound` below the rounding of the sums it stands for."""
_layer_work: Memo[float] = Memo(_CACHE_LIMIT)
_busiest_layers: Memo[int] = Memo(_CACHE_LIMIT)


def _work(lt: LayerTimes, recompute: Recompute) -> float:
    """One layer's forward, backward and (under full recomputation) recomputed forward."""
    return (lt.forward + lt.backward_input + lt.backward_weight_compute
            + (lt.recompute if recompute is Recompute.FULL else 0.0))


def work_lower_bound(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, efficiency: Efficiency | None = None) -> float:
    """:func:`work_bound` under the analytic source of ``model`` on ``hw``."""
    return work_bound(AnalyticSource(model, hw, efficiency or Efficiency()), cfg)


def work_bound(source: CostSource, cfg: ParallelConfig) -> float:
    """A cheap value no larger than :func:`step_bound` (no stage costs, no links): the busiest rank
    runs the forward and backward (and the recomputation) of each of its layers for every micro-batch.

    It is ``m·work_r`` of :func:`pipeline_bounds` for that rank without the embedding and the head, and so at most
    its makespan; the margin keeps it below whatever rounding the exact sums take. A search may skip a
    configuration on it, without the exact bound, whenever it already cannot win.
    """
    ranks = (0,) if source.uniform else tuple(range(cfg.pp))  # the fastest rank's layer bounds every rank's
    traits = cfg.schedule.traits
    key = (source, ranks, cfg.tp, cfg.microbatch_size, cfg.sequence_parallel, cfg.attention, cfg.recompute,
           cfg.chunks > 1, traits.split_backward, cfg.microbatch_shapes)
    per_layer = _layer_work.get(key, lambda: _layer_work_of(source, cfg, ranks))
    where = (source.model.num_layers, traits.placement, cfg.pp, cfg.chunks, cfg.layout)
    busiest = _busiest_layers.get(where, lambda: _busiest_layers_of(source.model, cfg))
    return cfg.num_microbatches * busiest * per_layer * _WORK_MARGIN


def _layer_work_of(source: CostSource, cfg: ParallelConfig, ranks: tuple[int, ...]) -> float:
    """:func:`work_bound`'s work of one layer per micro-batch (the mean, for unequal ones) on the fastest of
    ``ranks``."""
    if cfg.microbatch_shapes is None:
        shape = shape_of(source.model, cfg)
        return min(_work(source.layer_times(cfg, r, shape), cfg.recompute) for r in ranks)
    shapes = cfg.microbatch_shapes
    return min(sum(_work(source.layer_times(cfg, r, sh), cfg.recompute) for sh in shapes)
               for r in ranks) / len(shapes) * _SUM_MARGIN


def _busiest_layers_of(model: ModelSpec, cfg: ParallelConfig) -> int:
    """The most transformer layers any rank of ``cfg`` holds."""
    return max(_layers_on(model, cfg))


def _layers_on(model: ModelSpec, cfg: ParallelConfig) -> list[int]:
    """Transformer layers each rank of ``cfg`` holds, over all its stages."""
    return layers_per_rank(stage_layers(model, cfg), stage_layout(cfg.schedule, cfg.pp, cfg.chunks), cfg.pp)
