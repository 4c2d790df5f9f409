"""Predict one configuration over a cost source (:mod:`evenpipe.cost.source`): simulate its schedule with the
source's stage costs, add the data-parallel reduction and the optimizer step, and report time, utilisation and
memory. :func:`estimate_with` is the one estimate of every planner command; :func:`estimate` is it over the
analytic source.

Step time = simulated pipeline makespan (compute, tensor-parallel collectives inside the stage durations,
pipeline messages and BPipe transfers over their links, bubbles) + the data-parallel gradient reduction beyond
each rank's last backward (it overlaps that backward when the source says so, ``Efficiency.dp_overlap`` for the
analytic one; a rank that finishes early hides its reduction behind the ranks still working) + the optimizer
step: after the last rank's reduction when the source's ranks wait for all (Megatron's global gradient clip),
else each rank's after its own, the latest rank's counting + the source's fixed per-step cost.

Utilisation conventions: ``mfu`` = model FLOPs (no recomputation; :func:`evenpipe.cost.flops.model_flops_per_step`)
/ (step time · GPUs · peak); ``hfu`` counts executed FLOPs (recomputation included); ``tflops_per_gpu`` is the
executed FLOP rate per GPU, the quantity Narayanan et al. 2021 report in Table 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.memo import Memo
from evenpipe.schedule.semantics import TABLES
from evenpipe.sim import SimCosts, Trace, simulate

from evenpipe.cost.flops import step_flops
from evenpipe.cost.hardware import GIB, Hardware
from evenpipe.cost.memory import StageMemory, build_cost_schedule, cost_schedule_key, stage_memory
from evenpipe.cost.microbatch_costs import bpipe_weights, config_sim_costs
from evenpipe.cost.parallel import ParallelConfig, stage_layers
from evenpipe.cost.source import CostSource, Holding, ParamCounts, shape_of
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import Efficiency, LayerTimes

__all__ = ["Estimate", "TimeBreakdown", "estimate", "estimate_with", "LIMITS"]

LIMITS = ("memory", "bubble", "communication", "compute")
"""Values of :attr:`Estimate.limited_by`."""

_MEMORY_NEAR = 0.90
"""A fitting configuration using this share of usable memory is called memory-limited."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Where the step time of the critical rank goes, in seconds; the parts sum to the step time."""

    compute: float
    """Forward and backward kernels (GEMMs, attention, element-wise), recomputation excluded."""
    tp_comm: float
    """Tensor-parallel collectives (not overlapped)."""
    recompute: float
    """Re-run forwards (full recomputation) or attention cores (selective)."""
    pp_comm: float
    """Pipeline activation/gradient messages the rank waited on."""
    bpipe_transfer: float
    """BPipe evict/load transfers and host offload/reload copies the rank waited on."""
    bubble: float
    """Idle time of the rank inside the pipeline (warm-up, cool-down, dependency waits)."""
    dp_comm: float
    """Data-parallel gradient reduction beyond the overlapped part."""
    optimizer: float
    """Optimizer step."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.recompute + self.pp_comm + self.bpipe_transfer + self.bubble
                + self.dp_comm + self.optimizer)

    def to_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in
                ("compute", "tp_comm", "recompute", "pp_comm", "bpipe_transfer", "bubble", "dp_comm", "optimizer")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The predicted step of one configuration."""

    model: ModelSpec
    """The model estimated."""
    hardware: Hardware | None
    """The GPU preset (None when the costs were measured: a profile)."""
    source_name: str
    """The devices the costs are of, in words (the preset's name, or the profiled device)."""
    config: ParallelConfig
    """The parallel configuration."""
    step_time_s: float
    """Seconds per optimizer step."""
    mfu: float
    """Model FLOPs utilisation (no recomputation counted); NaN when the source knows no peak FLOP rate."""
    hfu: float
    """Hardware FLOPs utilisation (recomputation counted); NaN like ``mfu``."""
    tflops_per_gpu: float
    """Executed TFLOP/s per GPU (hfu · peak)."""
    bubble_fraction: float
    """Idle share of the pipeline ranks' simulated time."""
    memory_per_stage_gib: tuple[float, ...]
    """Peak memory of each pipeline rank, GiB."""
    peak_memory_gib: float
    """Largest entry of ``memory_per_stage_gib``."""
    fits: bool
    """Whether every rank fits in its usable memory (the source's budget: ``Hardware.usable_memory_gib``)."""
    usable_memory_gib: float | None
    """Memory the critical rank may use, GiB (None: no budget given)."""
    breakdown: TimeBreakdown
    """Step time of the critical rank by component."""
    stage_memory: tuple[StageMemory, ...]
    """Per-rank memory by component, GiB."""
    critical_rank: int
    """Pipeline rank that finishes last."""
    activation_peak_simulated_gib: tuple[float, ...]
    """Per rank, the simulator's peak of saved activations in time (own + hosted, embedding/head activations
    included), GiB. It exceeds the counted ``activations + hosted`` when BPipe evictions are still in flight
    while the next forward allocates (the simulator never blocks on sends); a runtime that waits for each
    eviction keeps the counted peak and pays the wait instead."""
    limited_by: str
    """What limits the configuration: one of :data:`LIMITS` (see :func:`_limit`)."""
    layout: tuple[int, ...] = ()
    """Transformer layers of each stage, pipeline order (the configuration's layout or its default)."""
    state_bytes: tuple[float, ...] = ()
    """Per rank, model-state bytes (parameters, gradients, master weights, optimizer state)."""

    @property
    def peak_bytes(self) -> tuple[float, ...]:
        """Per rank, peak memory in bytes."""
        return tuple(g * GIB for g in self.memory_per_stage_gib)

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second (with micro-batch shapes: theirs, padding counted, on every replica)."""
        shapes = self.config.microbatch_shapes
        if shapes is None:
            return self.config.global_batch * self.model.seq_len / self.step_time_s
        return self.config.dp * sum(sh.num_tokens for sh in shapes) / self.step_time_s

    def to_dict(self) -> dict[str, object]:
        c = self.config
        return {
            "model": self.model.name, "gpu": self.source_name, "gpus": c.num_gpus,
            "num_microbatches": c.num_microbatches,
            "config": {"tp": c.tp, "pp": c.pp, "dp": c.dp, "chunks": c.chunks, "microbatch_size": c.microbatch_size,
                       "global_batch": c.global_batch, "num_microbatches": c.num_microbatches,
                       "recompute": c.recompute.value, "sequence_parallel": c.sequence_parallel,
                       "attention": c.attention.value, "schedule": c.schedule.value,
                       "distributed_optimizer": c.distributed_optimizer, "bpipe_budget": c.bpipe_budget,
                       "bpipe": c.uses_bpipe, "offload_ranks": c.offload_ranks, "layout": list(self.layout),
                       **({} if c.microbatch_shapes is None else {"microbatch_tokens": [
                           sh.num_tokens for sh in c.microbatch_shapes]})},
            "step_time_s": self.step_time_s, "mfu": _number(self.mfu), "hfu": _number(self.hfu),
            "tflops_per_gpu": self.tflops_per_gpu, "tokens_per_s": self.tokens_per_s,
            "bubble_fraction": self.bubble_fraction,
            "memory_per_stage_gib": list(self.memory_per_stage_gib), "peak_memory_gib": self.peak_memory_gib,
            "usable_memory_gib": self.usable_memory_gib, "fits": self.fits,
            "peak_bytes": list(self.peak_bytes), "state_bytes": list(self.state_bytes),
            "limited_by": self.limited_by, "critical_rank": self.critical_rank,
            "activation_peak_simulated_gib": list(self.activation_peak_simulated_gib),
            "time_breakdown_s": self.breakdown.to_dict(),
            "stage_memory_gib": [m.to_dict() for m in self.stage_memory],
        }


def _number(x: float) -> float | None:
    """``x`` for JSON (None for NaN)."""
    return None if math.isnan(x) else x


@dataclass(frozen=True, slots=True)
class _Pipeline:
    """What the estimate reads of one simulated step: its time, bubble share and activation peaks, and per rank
    when its last compute ends, the backward work of its last micro-batch (which can hide a gradient reduction),
    its busy time, the time its computes waited on pipeline messages and on BPipe transfers, and the layers it
    holds, runs forwards of and recomputes (summed over its micro-batches)."""

    step_time: float
    bubble_fraction: float
    peak_activation_bytes: tuple[float, ...]
    finish: tuple[tuple[float, float], ...]
    busy: tuple[float, ...]
    waits: tuple[tuple[float, float], ...]
    layers_held: tuple[int, ...]
    num_microbatches: int
    recomputed_layers: tuple[int, ...]

    def forward_layers(self, rank: int) -> int:
        """Layer-micro-batches of the rank's forwards: a complete schedule runs each stage's once per micro-batch."""
        return self.num_microbatches * self.layers_held[rank]


def _pipeline(trace: Trace, layers: tuple[int, ...]) -> _Pipeline:
    """The summary of ``trace``."""
    schedule = trace.schedule
    ranks = range(schedule.num_ranks)
    held = tuple(sum(layers[s] for s in schedule.stages_of(r)) for r in ranks)
    return _Pipeline(step_time=trace.step_time, bubble_fraction=trace.bubble_fraction,
                     peak_activation_bytes=tuple(trace.peak_activation_bytes),
                     finish=tuple(_rank_finish(trace, r) for r in ranks), busy=tuple(trace.busy_time(r) for r in ranks),
                     waits=_exposed_waits(trace),
                     layers_held=held, num_microbatches=schedule.num_microbatches,
                     recomputed_layers=tuple(_recomputed_layers(schedule, r, layers) for r in ranks))


_PIPELINES = 256
"""Simulated steps remembered (small summaries; a planner search simulates a few dozen)."""
_pipelines: Memo[tuple[SimCosts, _Pipeline]] = Memo(_PIPELINES)


def _simulated(source: CostSource, cfg: ParallelConfig) -> _Pipeline:
    """The simulated step of ``cfg``, remembered on its schedule's shape and its stage costs: configurations that
    differ only in data parallelism or the optimizer's sharding share both (the sources return the same stage
    costs object), so their pipelines run alike."""
    durations = source.plan_durations(cfg)
    costs = config_sim_costs(source, cfg)

    weights = bpipe_weights(source, cfg)

    def run() -> tuple[SimCosts, _Pipeline]:
        return costs, _pipeline(simulate(build_cost_schedule(cfg, durations, weights), costs),
                                stage_layers(source.model, cfg))
    held, pipeline = _pipelines.get((cost_schedule_key(cfg, durations, weights), id(costs)), run)
    return pipeline if held is costs else run()[1]  # ``is``: an id reused by another object


_BACKWARD_CODES = frozenset(k.code for k in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                                              ActionKind.BACKWARD_WEIGHT, ActionKind.RECOMPUTE))
_IS_COMPUTE = TABLES.compute
_RECOMPUTE = ActionKind.RECOMPUTE.code


def _rank_finish(trace: Trace, rank: int) -> tuple[float, float]:
    """(end of the rank's last compute, time of the backward work of its last micro-batch): gradient buckets of
    the last micro-batch are reduced while its backward runs, so that work can hide the reduction."""
    cols = trace.schedule.columns
    kinds, mbs = cols.kinds[rank], cols.microbatches[rank]
    starts, ends = trace.action_times(rank)
    at = [i for i, c in enumerate(kinds) if _IS_COMPUTE[c]]
    end = max([0.0] + [ends[i] for i in at])
    backward = [i for i in at if kinds[i] in _BACKWARD_CODES]
    last_mb = mbs[backward[-1]] if backward else -1
    window = sum(ends[i] - starts[i] for i in backward if mbs[i] == last_mb)
    return end, window


def _exposed_waits(trace: Trace) -> tuple[tuple[float, float], ...]:
    """Per rank, (pipeline message wait, BPipe transfer wait) its computes spent on incoming messages."""
    pp = [0.0] * trace.schedule.num_ranks
    bp = [0.0] * trace.schedule.num_ranks
    moves = (ActionKind.EVICT, ActionKind.RETURN, ActionKind.OFFLOAD, ActionKind.RELOAD)
    for t in trace.waited_transfers:  # in order of arrival, as in trace.transfers
        if t.kind in moves:
            bp[t.dst] += t.exposed_s
        else:
            pp[t.dst] += t.exposed_s
    return tuple(zip(pp, bp))


def _recomputed_layers(schedule: Schedule, rank: int, layers: tuple[int, ...]) -> int:
    """Layer-micro-batches of the rank's recomputes (each runs all the layers of its stage)."""
    cols = schedule.columns
    kinds = cols.kinds[rank]
    if _RECOMPUTE not in kinds:  # most schedules recompute nothing: one scan in C
        return 0
    return sum(layers[s] for c, s in zip(kinds, cols.stages[rank]) if c == _RECOMPUTE)


def _breakdown(pipeline: _Pipeline, rank: int, lt: LayerTimes, dp_exposed: float, optimizer: float,
               until: float) -> TimeBreakdown:
    """The parts of the critical ``rank``'s step; its bubble runs until ``until`` (the makespan, or the rank's
    own finish when that comes earlier and ranks step on their own)."""
    n_fwd, n_rec = pipeline.forward_layers(rank), pipeline.recomputed_layers[rank]
    busy = pipeline.busy[rank]
    tp = n_fwd * (lt.tp_forward + lt.tp_backward) + n_rec * lt.tp_forward
    recompute = n_rec * lt.recompute + n_fwd * lt.selective_recompute
    pp_wait, bp_wait = pipeline.waits[rank]
    bubble = max(0.0, until - busy - pp_wait - bp_wait)
    return TimeBreakdown(compute=max(0.0, busy - tp - recompute), tp_comm=tp, recompute=recompute,
                         pp_comm=pp_wait, bpipe_transfer=bp_wait, bubble=bubble, dp_comm=dp_exposed,
                         optimizer=optimizer)


def _limit(fits: bool, peak_gib: float, usable_gib: float, bd: TimeBreakdown) -> str:
    """``memory`` if it does not fit; else whichever of compute (kernels, recomputation, optimizer), exposed
    communication (tp, pp, BPipe, dp) and bubble takes the largest share of the critical rank's step; a
    compute-bound configuration within 90% of usable memory is called ``memory`` (a larger micro-batch or less
    recomputation, which would use the compute better, would not fit)."""
    if not fits:
        return "memory"
    shares = {"compute": bd.compute + bd.recompute + bd.optimizer,
              "communication": bd.tp_comm + bd.pp_comm + bd.bpipe_transfer + bd.dp_comm,
              "bubble": bd.bubble}
    largest = max(shares, key=lambda k: shares[k])
    if largest == "compute" and peak_gib >= _MEMORY_NEAR * usable_gib:
        return "memory"
    return largest


def estimate(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, *,
             efficiency: Efficiency | None = None) -> Estimate:
    """:func:`estimate_with` the analytic source of ``model`` on ``hw`` GPUs."""
    from evenpipe.cost.analytic_source import AnalyticSource
    return estimate_with(AnalyticSource(model, hw, efficiency or Efficiency()), cfg)


def _holdings(source: CostSource, cfg: ParallelConfig, pipeline: _Pipeline) -> list[Holding]:
    """What each pipeline rank holds: its layers, the embedding on rank 0 and the head on rank p-1."""
    return [Holding(layers=pipeline.layers_held[r], embedding=r == 0, head=r == cfg.pp - 1) for r in range(cfg.pp)]


def estimate_with(source: CostSource, cfg: ParallelConfig) -> Estimate:
    """Simulate ``cfg``'s schedule under ``source``'s costs and return the predicted step (see the module doc):
    the one estimate of every planner command, whatever the source."""
    source.check(cfg)
    model = source.model
    pipeline = _simulated(source, cfg)
    held = _holdings(source, cfg, pipeline)
    finish, opts = [], []
    for r in range(cfg.pp):
        end, last = pipeline.finish[r]
        dp = source.reduce_time(cfg, r, held[r])
        finish.append(end + max(0.0, dp - (last if source.reduction_overlaps_backward else 0.0)))
        opts.append(source.optimizer_time(cfg, r, held[r]))
    if source.optimizer_waits_for_all_ranks:  # every rank steps after the last reduction
        critical = max(range(cfg.pp), key=lambda r: finish[r])
        opt = max(opts)
    else:  # each rank steps after its own
        critical = max(range(cfg.pp), key=lambda r: finish[r] + opts[r])
        opt = opts[critical]
    opt += source.step_overhead_s
    dp_exposed = max(0.0, finish[critical] - pipeline.step_time)
    step = min(pipeline.step_time, finish[critical]) + dp_exposed + opt
    mem = stage_memory(source, cfg)
    totals = tuple(m.total for m in mem)
    peak = max(totals)
    budget = source.memory_budget_gib(critical)
    fits = all(t <= b for r, t in enumerate(totals) if (b := source.memory_budget_gib(r)) is not None)
    useful, executed = step_flops(model, cfg)
    rates = [source.peak_flops(r) for r in range(cfg.pp)]  # each pipeline rank's GPUs: tp·dp of them
    peak_flops = math.nan if None in rates else sum(r or 0.0 for r in rates) * cfg.tp * cfg.dp * step
    lt = _layer_times(source, cfg, critical)
    bd = _breakdown(pipeline, critical, lt, dp_exposed, opt, min(pipeline.step_time, finish[critical]))
    counts = source.param_counts(cfg)
    states = tuple(_state_bytes(source, cfg, r, held[r], counts) for r in range(cfg.pp))
    return Estimate(
        model=model, hardware=source.hardware, source_name=source.name, config=cfg, step_time_s=step,
        mfu=useful / peak_flops, hfu=executed / peak_flops,
        tflops_per_gpu=executed / (step * cfg.num_gpus) / 1e12, bubble_fraction=pipeline.bubble_fraction,
        memory_per_stage_gib=totals, peak_memory_gib=peak, fits=fits, breakdown=bd, stage_memory=mem,
        critical_rank=critical, usable_memory_gib=budget,
        limited_by=_limit(fits, peak, budget if budget is not None else math.inf, bd),
        activation_peak_simulated_gib=tuple(b / GIB for b in pipeline.peak_activation_bytes),
        layout=stage_layers(model, cfg), state_bytes=states,
    )


def _layer_times(source: CostSource, cfg: ParallelConfig, rank: int) -> LayerTimes:
    """One layer's times on ``rank`` for the breakdown: of the configuration's shape, or the mean over its
    micro-batch shapes (the breakdown multiplies them by the micro-batches)."""
    if cfg.microbatch_shapes is None:
        return source.layer_times(cfg, rank, shape_of(source.model, cfg))
    each = [source.layer_times(cfg, rank, sh) for sh in cfg.microbatch_shapes]
    n = len(each)
    recomputes = [lt.recompute_forward for lt in each]
    return LayerTimes(
        forward_compute=sum(lt.forward_compute for lt in each) / n,
        backward_input_compute=sum(lt.backward_input_compute for lt in each) / n,
        backward_weight_compute=sum(lt.backward_weight_compute for lt in each) / n,
        tp_forward=sum(lt.tp_forward for lt in each) / n, tp_backward=sum(lt.tp_backward for lt in each) / n,
        selective_recompute=sum(lt.selective_recompute for lt in each) / n,
        recompute_forward=None if all(r is None for r in recomputes) else sum(lt.recompute for lt in each) / n)


def _state_bytes(source: CostSource, cfg: ParallelConfig, rank: int, held: Holding, counts: ParamCounts) -> float:
    """Model-state bytes of ``rank`` (every category)."""
    b = source.state_bytes(cfg, rank)
    return held.params(counts) * (b.parameters + b.gradients + (b.master + b.optimizer))
