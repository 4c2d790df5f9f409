"""Memory per pipeline rank: model states, saved activations (own and BPipe-hosted), embedding and head.

Model states (mixed-precision Adam, Megatron's layout; reference README and Rajbhandari et al. 2020): bf16
weights 2 bytes, fp32 gradients 4 bytes, fp32 master weights and two Adam moments 12 bytes, i.e. 18 bytes per
parameter; the distributed optimizer shards the 12 bytes over data parallelism (6 + 12/d).

Activations per layer and micro-batch come from :mod:`evenpipe.cost.activations` (Korthikanti et al. 2022).

The number of micro-batches in flight comes from the schedule itself: :func:`memory_per_stage` builds its
compute order (with BPipe's evict/load actions; see :func:`counting_schedule`) and walks every rank's actions
in program order (forward adds a stage's activations, backward frees them, BPipe's
EVICT/LOAD move them off and back, ACCEPT/RETURN add and free them on the acceptor). Program order is time
order on one rank, so the peak is exact for a runtime that lets an evicted unit go before its next compute
(the simulator, which never blocks on sends, can hold an in-flight eviction a little longer). Embedding (first
stage) and head (last stage) activations are counted with their stage's micro-batches but reported under
``embedding`` and ``head``.
"""

from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass
from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule import (ActionKind, Schedule, add_offload, bpipe_transform, build_schedule, compute_order,
                               offload_beside_bpipe)
from evenpipe.schedule.memo import ObjectMemo, RecentMemo
from evenpipe.schedule.semantics import SEMANTICS, MemoryEffect, kind_table

from evenpipe.cost.activations import ActivationBytes, activation_bytes, layer_activation_bytes
from evenpipe.cost.hardware import GIB, Hardware
from evenpipe.cost.parallel import ParallelConfig, Recompute, ScheduleFamily, layers_per_rank, stage_layers
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.states import (BYTES_GRAD, BYTES_OPTIMIZER, BYTES_WEIGHT, embedding_params_per_rank,
                                  layer_params_per_rank)
from evenpipe.cost.source import CostSource, StateBytes, shape_of
from evenpipe.cost.microbatch_costs import bpipe_weights
from evenpipe.cost.timing import Efficiency

Weights = tuple[float, ...]
"""Unequal micro-batches: each one's activation units for BPipe's eviction plan."""
PlanDurations = tuple[int, int, int]
"""Integer durations of F, I and W (see :func:`evenpipe.schedule.build.plan_durations_for`)."""

__all__ = ["StageMemory", "memory_per_stage", "stage_memory", "layer_activation_bytes", "layer_params_per_rank",
           "BYTES_WEIGHT", "embedding_params_per_rank", "layer_states_per_rank_gib", "BYTES_GRAD", "BYTES_OPTIMIZER", "build_cost_schedule", "counting_schedule",
           "ActivationBytes",
           "activation_bytes", "rank_activation_peaks", "TiedTable", "tied_table"]

_TRUNCATE_FACTOR = 2
"""In-flight peaks are counted on a schedule of at most this many times p micro-batches (GPipe excepted)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """Peak memory of one pipeline rank in GiB, by component."""

    rank: int
    """Pipeline rank."""
    weights: float
    """bf16 weights of the rank's transformer layers."""
    grads: float
    """fp32 gradients of the rank's transformer layers."""
    optimizer: float
    """Master weights and Adam moments of the rank's layers (sharded over dp with the distributed optimizer)."""
    activations: float
    """The rank's own saved layer activations at its peak."""
    hosted: float
    """Activations accepted from the BPipe partner at the same moment."""
    embedding: float
    """Embedding parameters, gradients and optimizer state, and its activations (first stage)."""
    head: float
    """Output layer (untied head, or Megatron's copy of tied embeddings when pp > 1) and logits (last stage)."""
    gathered: float = 0.0
    """FSDP's whole weights and unsharded gradients during a step (``--sharding full``), the rank's every layer."""

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer + self.gathered

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.hosted
                + self.embedding + self.head + self.gathered)

    def to_dict(self) -> dict[str, float]:
        return {"rank": self.rank, "weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "hosted": self.hosted, "embedding": self.embedding,
                "head": self.head, "gathered": self.gathered, "total": self.total}


def build_cost_schedule(cfg: ParallelConfig, plan_durations: PlanDurations | None = None,
                        weights: Weights | None = None) -> Schedule:
    """The complete, validated schedule ``cfg`` runs (cached on its shape). ``plan_durations``: the F, I, W
    durations a memory-capped family plans its order with (:func:`evenpipe.cost.timing.cost_plan_durations`);
    ``weights``: unequal micro-batches' activation units for BPipe's eviction plan
    (:func:`evenpipe.cost.microbatch_costs.bpipe_weights`)."""
    return _cached_schedule(*cost_schedule_key(cfg, plan_durations, weights))


def cost_schedule_key(cfg: ParallelConfig, plan_durations: PlanDurations | None = None,
                      weights: Weights | None = None
                      ) -> tuple[ScheduleFamily, int, int, int, int | None, bool, bool, PlanDurations | None, int,
                                 Weights | None]:
    """What :func:`build_cost_schedule` of ``cfg`` depends on: configurations with one key run one schedule."""
    return (cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks, cfg.bpipe_budget, cfg.recompute is Recompute.FULL,
            cfg.bpipe, plan_durations, cfg.offload_ranks, weights)


_SCHEDULE_ACTIONS = 1_500_000
"""Actions the full-schedule cache may hold (full schedules of big pipelines hold 10^5-10^6 actions each; the
planner estimates configurations sharing one schedule -- optimizer sharding, layouts -- far apart)."""
_schedules: RecentMemo[Schedule] = RecentMemo(1, weight=lambda s: sum(map(len, s.columns.kinds)),
                                              budget=_SCHEDULE_ACTIONS)


def _cached_schedule(family: ScheduleFamily, p: int, m: int, v: int, budget: int | None,
                     recompute: bool, bpipe: bool, plan_durations: PlanDurations | None, offload: int,
                     weights: Weights | None = None) -> Schedule:
    key = (family, p, m, v, budget, recompute, bpipe, plan_durations, offload, weights)
    return _schedules.get(key, lambda: build_schedule(
        family, num_ranks=p, num_microbatches=m, num_chunks=v, bpipe_budget=budget, recompute=recompute,
        bpipe=bpipe, plan_durations=plan_durations, offload_ranks=frozenset(range(offload)),
        bpipe_weights=weights if bpipe or family is ScheduleFamily.BPIPE else None))


def counting_schedule(cfg: ParallelConfig, plan_durations: PlanDurations | None = None,
                      weights: Weights | None = None) -> Schedule:
    """What in-flight counting needs, cheaply: the compute order (plus BPipe's evict/load actions) of at most
    2·p micro-batches (all of them for GPipe and looped BFS, whose peaks grow with m). The other families'
    per-rank peaks saturate by m = 2·p (1F1B: min(p - r, m); interleaved: min(v·p + p - 1, v·m) chunks; ZB-H1
    at most 1F1B's; BPipe at its budget), so the truncated schedule has the same peaks; a unit test checks this against the full one.
    BPipe on another family (``--bpipe``) keeps 3·p: which chunk it evicts at the peak settles one round later."""
    m = cfg.num_microbatches
    keep = (_TRUNCATE_FACTOR + (1 if cfg.bpipe else 0)) * cfg.pp
    if cfg.schedule.traits.memory_saturates and m > keep and cfg.microbatch_shapes is None:
        m = keep
    return _cached_counting_schedule(cfg.schedule, cfg.pp, m, cfg.chunks, cfg.bpipe_budget, cfg.uses_bpipe,
                                     plan_durations, cfg.offload_ranks, weights)


@functools.lru_cache(maxsize=128)
def _cached_counting_schedule(family: ScheduleFamily, p: int, m: int, v: int, budget: int | None, bpipe: bool,
                              plan_durations: PlanDurations | None, offload: int = 0,
                              weights: Weights | None = None) -> Schedule:
    compute = compute_order(family, num_ranks=p, num_microbatches=m, num_chunks=v, plan_durations=plan_durations)
    if bpipe:  # offload beside BPipe's evictions, as build_schedule places it
        moved = bpipe_transform(compute, budget=budget, weights=weights)
        return offload_beside_bpipe(moved, ranks=range(offload)) if offload else moved
    return add_offload(compute, ranks=set(range(offload)), prefetch=True) if offload else compute


@dataclass(frozen=True, slots=True)
class ActivationPeak:
    """A rank's activation bytes at one moment: its own layers', its first and last stages' extras, hosted."""

    own_layers: float
    own_extra_embedding: float
    own_extra_head: float
    hosted: float


@dataclass(frozen=True, slots=True)
class _Units:
    """The bytes one micro-batch's actions add or free in the walk (bytes)."""

    unit: list[float]
    """Per stage, the saved activations of one forward (its layers, and any boundary input)."""
    weight_grad: list[float]
    """Per stage, what stays between ``I`` and ``W``."""
    first: float
    """The first stage's extra (embedding)."""
    last: float
    """The last stage's extra (head and logits)."""
    transient: float
    """One layer's full activations while it is recomputed or back-propagated (full recomputation)."""
    head_weight_grad: float = 0.0
    """Of ``last``, what the last stage keeps between ``I`` and ``W``."""


def _peak_activations(schedule: Schedule, rank: int, units: Sequence[_Units]) -> ActivationPeak:
    """Walk one rank's actions; return the components at the moment of its largest total (bytes). ``units`` holds
    one entry for every micro-batch alike, or one per micro-batch (unequal micro-batches)."""
    last = schedule.num_stages - 1
    own = emb = head = hosted = 0.0
    best = ActivationPeak(0.0, 0.0, 0.0, 0.0)
    best_total = -1.0
    alike = len(units) == 1

    def record(spike: float) -> None:
        nonlocal best, best_total
        total = own + emb + head + hosted + spike
        if total > best_total:
            best_total = total
            best = ActivationPeak(own + spike, emb, head, hosted)

    for a in schedule.actions[rank]:
        step, s = _WALK[a.kind.code], a.stage
        assert step is not None
        u = units[0] if alike else units[a.microbatch]
        if step.transient:
            record(u.transient)  # the micro-batch's activations plus the layer being recomputed/back-propagated
        if step.own:
            own += step.own * u.unit[s] - (step.own * u.weight_grad[s] if step.keeps_weight_grad else 0.0)
            de = step.own * u.first if s == 0 else 0.0
            dh = step.own * u.last if s == last else 0.0
            kept_head = step.own * u.head_weight_grad if step.keeps_weight_grad and s == last else 0.0
            emb, head = emb + de, head + dh - kept_head
        elif step.weight_grad:
            own -= u.weight_grad[s]
            head -= u.head_weight_grad if s == last else 0.0
        elif step.hosted:
            hosted += step.hosted * u.unit[s]
        record(0.0)
    return best


def _units(act: ActivationBytes, layers: tuple[int, ...], transient: float) -> _Units:
    """The walk's bytes of one micro-batch from its per-layer bytes ``act``. The received input a stage keeps
    besides its layers' bytes stays until ``W`` too (the executor holds it until the weight gradients are done)."""
    boundary = [act.boundary if s else 0.0 for s in range(len(layers))]
    return _Units([n * act.layer_saved + b for n, b in zip(layers, boundary)],
                  [n * act.layer_weight_grad + b for n, b in zip(layers, boundary)], act.embedding, act.head,
                  transient, act.head_weight_grad)


@dataclass(frozen=True, slots=True)
class _WalkStep:
    """What one action does to the program-order memory walk (from its :class:`MemoryEffect`)."""

    own: int = 0
    """+1 / -1 stage unit (and its embedding/head extras) of the rank's own."""
    keeps_weight_grad: bool = False
    """With ``own = -1``: the weight-gradient inputs stay (``I``)."""
    weight_grad: bool = False
    """Frees the weight-gradient inputs ``I`` kept (``W``)."""
    hosted: int = 0
    """+1 / -1 stage unit of a partner's."""
    transient: bool = False
    """A layer's full activations exist while it runs (recompute or backward through layers)."""


_EFFECT_STEP = {
    MemoryEffect.NONE: _WalkStep(), MemoryEffect.REBUILD: _WalkStep(transient=True),
    MemoryEffect.ALLOCATE: _WalkStep(own=1), MemoryEffect.BRING_BACK: _WalkStep(own=1),
    MemoryEffect.FREE_ALL: _WalkStep(own=-1, transient=True), MemoryEffect.SEND_AWAY: _WalkStep(own=-1),
    MemoryEffect.FREE_ALL_BUT_WEIGHT_GRAD: _WalkStep(own=-1, keeps_weight_grad=True, transient=True),
    MemoryEffect.FREE_REST: _WalkStep(weight_grad=True),
    MemoryEffect.HOST: _WalkStep(hosted=1), MemoryEffect.UNHOST: _WalkStep(hosted=-1),
}
_WALK = kind_table("memory walk", {k: _EFFECT_STEP[SEMANTICS[k].memory] for k in ActionKind})
_NO_STEP = _EFFECT_STEP[MemoryEffect.NONE]


_State = tuple[int, int, int, int, int, int]
"""A rank's program-order memory state in whole counts: (own layer units, layer units kept for weight gradients,
hosted layer units, own micro-batches of the first stage, of the last stage, a transient layer or not)."""
_EXACT = 1 << 53
_STATES_LIMIT = 4096
_states_cache: "ObjectMemo[tuple[tuple[_State, ...], _State, bool]]" = ObjectMemo(_STATES_LIMIT)


def _rank_states(schedule: Schedule, rank: int, layers: tuple[int, ...]) -> tuple[tuple[_State, ...], _State, bool]:
    """The states :func:`_peak_activations` records on ``rank``, as counts (they do not depend on bytes): the
    ones that can hold a first maximum (a state no earlier state covers component by component) in program
    order, each component's largest magnitude over all states, and whether every component stays >= 0.
    Remembered per schedule object, rank and layers."""
    return _states_cache.get(schedule, (rank, layers), lambda: _count_states(schedule, rank, layers))


def _count_states(schedule: Schedule, rank: int, layers: tuple[int, ...]) -> tuple[tuple[_State, ...], _State, bool]:
    """:func:`_rank_states` itself."""
    last = schedule.num_stages - 1
    cols = schedule.columns
    own = kept = hosted = first = final = 0
    seen: set[_State] = set()
    kept_states: list[_State] = []
    for code, s in zip(cols.kinds[rank], cols.stages[rank]):
        step = _WALK[code]
        assert step is not None
        if step is _NO_STEP:
            continue  # the state stays: its record would repeat the last one
        for spike in ((1, 0) if step.transient else (0,)):
            if not spike:
                n = layers[s]
                if step.own:
                    own += step.own * n
                    if step.keeps_weight_grad:
                        kept -= step.own * n
                    if s == 0:
                        first += step.own
                    if s == last:
                        final += step.own
                elif step.weight_grad:
                    kept -= n
                elif step.hosted:
                    hosted += step.hosted * n
            state = (own, kept, hosted, first, final, spike)
            if state in seen:
                continue
            seen.add(state)
            for c in kept_states:
                if c[0] >= own and c[1] >= kept and c[2] >= hosted and c[3] >= first and c[4] >= final \
                        and c[5] >= spike:
                    break  # an earlier state is as large in every component: this one is never the first maximum
            else:
                kept_states.append(state)
    tops = [max(abs(state[k]) for state in seen) if seen else 0 for k in range(6)]
    top = (tops[0], tops[1], tops[2], tops[3], tops[4], tops[5])
    nonneg = all(x >= 0 for state in seen for x in state)
    return tuple(kept_states), top, nonneg


def _rank_peak(schedule: Schedule, rank: int, layers: tuple[int, ...], act: ActivationBytes,
               transient: float) -> ActivationPeak:
    """:func:`_peak_activations` of ``rank`` with stage units ``layers[s]·act.layer_saved`` (and so on), from the
    rank's counted states when every sum the walk makes is exact in floating point (then the order of the
    additions cannot matter and the states say it all); by the walk itself otherwise."""
    if act.boundary or act.head_weight_grad:  # per-stage terms: not counts of layers, walk the bytes
        return _peak_activations(schedule, rank, [_units(act, layers, transient)])
    states, top, nonneg = _rank_states(schedule, rank, layers)
    values = (act.layer_saved, act.layer_weight_grad, act.embedding, act.head, transient)
    ratios = [v.as_integer_ratio() for v in values]
    den = max(d for _, d in ratios)  # powers of two: the largest is a multiple of the others
    saved, wg, emb, head, spike = (n * (den // d) for n, d in ratios)
    widest = max(layers)
    bound = saved * (top[0] + top[2] + widest) + wg * (top[1] + widest) + emb * top[3] + head * top[4] + spike
    if not nonneg or min(saved, wg, emb, head, spike) < 0 or bound >= _EXACT:
        return _peak_activations(schedule, rank, [_units(act, layers, transient)])
    best: _State | None = None
    best_total = -1
    for state in states:
        total = saved * (state[0] + state[2]) + wg * state[1] + emb * state[3] + head * state[4] + spike * state[5]
        if total > best_total:
            best_total, best = total, state
    if best is None:
        return ActivationPeak(0.0, 0.0, 0.0, 0.0)
    return ActivationPeak((saved * best[0] + wg * best[1] + spike * best[5]) / den, emb * best[3] / den,
                 head * best[4] / den, saved * best[2] / den)


def memory_per_stage(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, *,
                     efficiency: Efficiency | None = None) -> tuple[StageMemory, ...]:
    """:func:`stage_memory` under the analytic source of ``model`` on ``hw``."""
    from evenpipe.cost.analytic_source import AnalyticSource  # the source builds on this module's records
    return stage_memory(AnalyticSource(model, hw, efficiency or Efficiency()), cfg)


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedTable:
    """The token table of a tied embedding on a rank that holds both the first and the last stage (the V-shaped
    placements): one tensor the head reuses, so counted once; under ``--sharding full`` the runtime leaves it out
    of FSDP (:func:`evenpipe.runtime.sharding.fully_shard_stages`), so it takes replicated bytes."""

    params: float
    """Its parameters (0 on any other rank, or when the source's head count holds no matrix)."""
    per_param: StateBytes
    """Its bytes per parameter by category."""


def tied_table(source: CostSource, cfg: ParallelConfig, schedule: Schedule, rank: int) -> TiedTable:
    """:class:`TiedTable` of ``rank``."""
    b = source.state_bytes(cfg, rank)
    last = schedule.num_stages - 1
    if not (source.model.tied_embeddings and last > 0 and schedule.rank_of(0) == rank == schedule.rank_of(last)):
        return TiedTable(params=0.0, per_param=b)
    matrix = max(0.0, source.param_counts(cfg).head - source.model.final_norm_params)
    whole = source.state_bytes(dataclasses.replace(cfg, dp=1), rank)
    return TiedTable(params=matrix, per_param=whole if whole.parameters != b.parameters else b)


def stage_memory(source: CostSource, cfg: ParallelConfig) -> tuple[StageMemory, ...]:
    """Peak memory of every pipeline rank, by component (GiB). Cheap: builds (a truncated copy of) the
    schedule and counts in program order; no simulation. The source gives the bytes per layer and per
    parameter, and the durations a memory-capped family plans its order with (the order the estimate simulates)."""
    model = source.model
    layers = stage_layers(model, cfg)
    if cfg.num_stages > model.num_layers:
        raise ConfigError(f"pp·chunks = {cfg.num_stages} stages exceed the {model.num_layers} layers of {model.name}")
    schedule = counting_schedule(cfg, source.plan_durations(cfg), bpipe_weights(source, cfg))
    counts = source.param_counts(cfg)
    last = schedule.num_stages - 1
    out: list[StageMemory] = []
    rank_layers = layers_per_rank(layers, schedule.stage_to_rank, schedule.num_ranks)
    for r, (peak, held) in enumerate(rank_activation_peaks(source, cfg)):
        per_param = source.state_bytes(cfg, r)
        n_params = counts.per_layer * rank_layers[r]
        state = per_param.parameters + per_param.gradients + (per_param.master + per_param.optimizer)
        tied = tied_table(source, cfg, schedule, r)
        emb_state = ((counts.embedding - tied.params) * state + tied.params * tied.per_param.total
                     if r == schedule.rank_of(0) else 0.0)
        head_state = (counts.head - tied.params) * state if r == schedule.rank_of(last) else 0.0
        out.append(StageMemory(
            rank=r,
            weights=n_params * per_param.parameters / GIB,
            grads=n_params * per_param.gradients / GIB,
            optimizer=n_params * (per_param.master + per_param.optimizer) / GIB,
            activations=(peak.own_layers + held) / GIB,
            hosted=peak.hosted / GIB,
            embedding=(emb_state + peak.own_extra_embedding) / GIB,
            head=(head_state + peak.own_extra_head) / GIB,
            # every parameter but a tied table on a rank holding both ends, which FSDP leaves out
            gathered=(n_params + (counts.embedding if r == schedule.rank_of(0) else 0.0) - 2 * tied.params
                      + (counts.head if r == schedule.rank_of(last) else 0.0)) * per_param.gathered / GIB,
        ))
    return tuple(out)


def rank_activation_peaks(source: CostSource, cfg: ParallelConfig) -> list[tuple[ActivationPeak, float]]:
    """Per pipeline rank: its activations at the moment of its largest total (bytes), and the stage output it
    holds until the output is sent (0 unless the source's runtime holds it)."""
    layers = stage_layers(source.model, cfg)
    schedule = counting_schedule(cfg, source.plan_durations(cfg), bpipe_weights(source, cfg))
    shape = shape_of(source.model, cfg)
    shapes = cfg.microbatch_shapes
    last = schedule.num_stages - 1
    out = []
    for r in range(cfg.pp):
        act = source.layer_bytes(cfg, r, shape)
        # Full recomputation: one layer's full activations exist while it is recomputed and back-propagated.
        transient = act.layer_full if cfg.recompute is Recompute.FULL else 0.0
        sends = source.holds_sent_output and any(s != last for s in schedule.stages_of(r))
        if shapes is not None and (len(set(shapes)) > 1 or not shapes[0].padded):  # each micro-batch's own bytes
            acts = {sh: source.layer_bytes(cfg, r, sh) for sh in set(shapes)}
            full = cfg.recompute is Recompute.FULL
            units = [_units(acts[sh], layers, acts[sh].layer_full if full else 0.0) for sh in shapes]
            held = max(a.sent for a in acts.values()) if sends else 0.0
            out.append((_peak_activations(schedule, r, units), held))
            continue
        held = act.sent if sends else 0.0
        out.append((_rank_peak(schedule, r, layers, act, transient), held))
    return out


def layer_states_per_rank_gib(source: CostSource, cfg: ParallelConfig) -> tuple[float, ...]:
    """Weights, gradients and optimizer state of each pipeline rank's transformer layers (GiB): the
    ``model_states`` of :func:`stage_memory` without walking any schedule (a cheap pruning probe)."""
    layers = stage_layers(source.model, cfg)
    schedule = counting_schedule(cfg)  # cached; only its stage placement is read
    per_layer = source.param_counts(cfg).per_layer

    def layer_gib(r: int) -> float:
        b = source.state_bytes(cfg, r)
        return per_layer * (b.parameters + b.gradients + (b.master + b.optimizer)) / GIB
    alike = layer_gib(0) if source.uniform else None  # rank 0 stands for every rank of a uniform source
    return tuple((layer_gib(r) if alike is None else alike) * n
                 for r, n in enumerate(layers_per_rank(layers, schedule.stage_to_rank, schedule.num_ranks)))

