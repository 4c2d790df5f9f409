"""Search parallel configurations: enumerate, prune by memory and by a step-time lower bound, then estimate.

The search is branch and bound over a finite space:

1. **enumerate** every (tp, pp, dp, chunks, micro-batch size, recomputation, schedule) that is structurally
   plausible for the model, the GPU count and the global batch; the cost source's ``check`` rejects the rest;
2. **prune whole (tp, pp, dp) groups** whose model states alone overflow a rank (one ``stage_memory`` call
   per group);
3. **bound** every remaining configuration from its stage costs (:mod:`evenpipe.plan.bounds`: no schedule, no
   simulation; a cheaper work bound first, which often suffices to skip it) and visit them in increasing bound
   order; a configuration whose bound cannot beat the ``k``-th best
   estimate so far is skipped, so the kept top ``k`` are exactly the top ``k`` of the whole space;
4. for the others, skip it if **dominated** (a fitting twin with lighter recomputation, or offloading on fewer
   ranks), check **memory** with
   :func:`evenpipe.cost.memory.stage_memory` (closed form), and **estimate** it with
   :func:`evenpipe.cost.estimate.estimate_with`
   (which builds and simulates the schedule). Estimates, memory peaks and bounds are cached on the configuration
   in a :class:`Searcher`, so nothing is simulated twice across its searches.

Step time ranks candidates (for a fixed model, GPU count and global batch, MFU is inversely proportional to it).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

from evenpipe.cost import (
    Attention,
    Efficiency,
    Estimate,
    Hardware,
    ModelSpec,
    ParallelConfig,
    Recompute,
    candidate_layouts,
    end_lighter_layout,
)
from evenpipe.cost.parallel import split_bpipe
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.memory import layer_states_per_rank_gib, stage_memory
from evenpipe.cost.source import CostSource, shape_of
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan.bounds import offload_bound, step_bound, work_bound
from evenpipe.plan.order_bound import order_bound
from evenpipe.schedule import ScheduleFamily
from evenpipe.schedule.family import Transform
from evenpipe.sim.kernel import gc_paused

__all__ = [
    "SearchSpace",
    "Candidate",
    "SearchStats",
    "PlanResult",
    "Searcher",
    "plan_configs",
    "enumerate_configs",
    "PLANNED_SCHEDULES",
    "PLANNED_BPIPE_SCHEDULES",
]


PLANNED_SCHEDULES: tuple[ScheduleFamily, ...] = (
    ScheduleFamily.ONE_F_ONE_B, ScheduleFamily.INTERLEAVED, ScheduleFamily.ZB_H1, ScheduleFamily.BPIPE)
"""The schedule families the planner compares by default."""

PLANNED_BPIPE_SCHEDULES: tuple[ScheduleFamily, ...] = (ScheduleFamily.INTERLEAVED,)
"""The families the planner also tries with BPipe's transform by default (1F1B with it is schedule ``bpipe``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """Which values the planner tries besides the (tp, pp, dp) factorisations of the GPU count."""

    schedules: tuple[ScheduleFamily, ...] = PLANNED_SCHEDULES
    """Schedule families to try."""
    bpipe_schedules: tuple[ScheduleFamily, ...] | None = None
    """Families to try with BPipe's evict/load transform as well (``interleaved+bpipe``; ``bpipe`` in
    ``schedules`` is 1F1B with it). ``None``: those of :data:`PLANNED_BPIPE_SCHEDULES` that ``schedules`` tries
    plain, when it also tries ``bpipe`` (see :attr:`bpipe_families`)."""
    recomputes: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    """Activation recomputation policies to try."""
    max_microbatch_size: int = 16
    """Largest micro-batch size tried (every divisor of the per-replica batch up to it is tried)."""
    max_chunks: int = 8
    """Largest number of chunks per rank tried for the interleaved schedule."""
    max_tp: int | None = None
    """Largest tensor-parallel size; ``None`` means the GPUs of one node."""
    attention: Attention = Attention.FLASH
    """Attention kernel (not searched: it is a property of the training code)."""
    sequence_parallel: bool = True
    """Use sequence parallelism whenever tp > 1."""
    distributed_optimizer: bool | None = None
    """Shard optimizer state over data parallelism (Megatron's distributed optimizer): ``None`` searches both
    (whenever dp > 1), True or False fixes it."""
    layout: tuple[int, ...] | None = None
    """Fixed layers per stage (only configurations with that many stages are tried); ``None`` lets the planner
    try the even split and the end-lighter one (:func:`evenpipe.cost.candidate_layouts`)."""
    uneven_stages: bool = True
    """Try uneven splits: stage counts that do not divide the layers, and the end-lighter split when they do;
    False keeps to even splits (the planner before uneven stages were modelled)."""
    bpipe_budget: int | None = None
    """BPipe's per-rank activation budget; ``None`` uses the schedule default ceil((p+1)/2)."""
    offload_fractions: tuple[float, ...] = (0.0,)
    """Host offload: each entry f offloads on the first ``ceil(f·pp)`` pipeline ranks (0: none); a few fractions
    stand for the per-rank choice, since the first ranks hold the most activations in flight."""
    data_parallel: bool = True
    """Split the GPUs into replicas (dp = GPUs / (tp·pp)); False keeps one replica over all of them (a profile
    measures no data-parallel reduction)."""

    def __post_init__(self) -> None:
        if not self.schedules and not self.bpipe_families:
            raise ConfigError("the search space needs at least one schedule")
        bad = [f.value for f in self.bpipe_families
               if split_bpipe(f)[1] or Transform.BPIPE not in f.traits.transforms]
        if bad:
            allowed = [f.value for f in ScheduleFamily if Transform.BPIPE in f.traits.transforms
                       and not split_bpipe(f)[1]]
            raise ConfigError(f"bpipe does not apply to schedule {bad[0]}; allowed: {', '.join(allowed)}")
        if not self.recomputes:
            raise ConfigError("the search space needs at least one recomputation policy")
        if self.max_microbatch_size < 1:
            raise ConfigError(f"max micro-batch size must be >= 1, got {self.max_microbatch_size}")
        if self.max_chunks < 2 and ScheduleFamily.INTERLEAVED in self.schedules + self.bpipe_families:
            raise ConfigError(f"max chunks must be >= 2 for the interleaved schedule, got {self.max_chunks}")
        if not self.offload_fractions or any(not 0.0 <= f <= 1.0 for f in self.offload_fractions):
            raise ConfigError(f"offload fractions must lie in [0, 1], got {list(self.offload_fractions)}")
        if self.max_tp is not None and self.max_tp < 1:
            raise ConfigError(f"max tp must be >= 1, got {self.max_tp}")

    @property
    def bpipe_families(self) -> tuple[ScheduleFamily, ...]:
        """The families tried with BPipe's transform (``bpipe_schedules`` resolved)."""
        if self.bpipe_schedules is not None:
            return self.bpipe_schedules
        if not any(split_bpipe(f)[1] for f in self.schedules):
            return ()
        return tuple(f for f in PLANNED_BPIPE_SCHEDULES if f in self.schedules)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One configuration that fits in memory, with its estimate."""

    config: ParallelConfig
    """The parallel configuration."""
    estimate: Estimate
    """Predicted time, MFU and memory."""

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def mfu(self) -> float:
        return self.estimate.mfu

    @property
    def peak_memory_gib(self) -> float:
        return self.estimate.peak_memory_gib

    @property
    def limited_by(self) -> str:
        """What holds this configuration back: ``memory``, ``bubble``, ``communication`` or ``compute``."""
        return self.estimate.limited_by

    def to_dict(self) -> dict[str, object]:
        """The JSON record of ``evenpipe plan --json``."""
        c = self.config
        return {
            "tp": c.tp, "pp": c.pp, "dp": c.dp, "chunks": c.chunks, "microbatch_size": c.microbatch_size,
            "num_microbatches": c.num_microbatches, "recompute": c.recompute.value, "schedule": c.schedule.value,
            "bpipe": c.uses_bpipe, "offload_ranks": c.offload_ranks,
            "sequence_parallel": c.sequence_parallel, "attention": c.attention.value,
            "distributed_optimizer": c.distributed_optimizer, "layout": list(self.estimate.layout),
            "step_time_s": self.step_time_s, "mfu": self.mfu, "peak_memory_gib": self.peak_memory_gib,
            "bubble_fraction": self.estimate.bubble_fraction, "limited_by": self.limited_by,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchStats:
    """How many configurations each step of the search kept or dropped."""

    num_enumerated: int
    """Configurations produced by the enumeration."""
    num_invalid: int
    """Rejected by ``check_config`` or by the schedule generator (e.g. interleaved needs m divisible by p)."""
    num_over_memory: int
    """Found not to fit in GPU memory (whole (tp, pp, dp) groups by their model states, then one by one)."""
    num_bounded: int
    """Skipped because their step-time lower bound could not beat the kept candidates (memory never checked)."""
    num_dominated: int
    """Skipped because the same configuration with lighter recomputation fits (recomputation only adds time)."""
    num_estimated: int
    """Estimated (simulated) because they fit and could still win; each distinct configuration once."""

    def to_dict(self) -> dict[str, int]:
        return {"enumerated": self.num_enumerated, "invalid": self.num_invalid, "over_memory": self.num_over_memory,
                "bounded": self.num_bounded, "dominated": self.num_dominated, "estimated": self.num_estimated}


@dataclass(slots=True)
class _Counts:
    """What one search did with its configurations (the tallies :class:`SearchStats` reports), and the last
    objection a source raised."""

    enumerated: int = 0
    invalid: int = 0
    over_memory: int = 0
    dominated: int = 0
    bounded: int = 0
    estimated: int = 0
    last_error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The outcome of one search."""

    candidates: tuple[Candidate, ...]
    """The best configurations, fastest first."""
    best_by_schedule: dict[ScheduleFamily, Candidate]
    """With ``best_per_schedule``, the fastest fitting configuration of each family, with or without BPipe's
    transform (families with none are absent); otherwise the fastest of each family among the configurations simulated."""
    stats: SearchStats
    """Counts at each pruning step."""

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _chunk_options(model: ModelSpec, pp: int, family: ScheduleFamily, space: SearchSpace) -> list[int]:
    if not family.has_chunks:  # the placement fixes the chunks (1, or 2 in a V)
        v = family.traits.chunks.chunks(None)
        if v == 1:
            return [1]
        if pp < 2 or pp * v > model.num_layers or (space.layout is not None and len(space.layout) != pp * v):
            return []
        return [v]
    if pp < 2:
        return []
    if space.layout is not None:
        v = len(space.layout) // pp
        return [v] if v >= 2 and v * pp == len(space.layout) else []
    layers = model.num_layers
    return [v for v in range(2, space.max_chunks + 1) if layers % (pp * v) == 0
            or ((layers + 2) % (pp * v) == 0 and end_lighter_layout(layers, pp * v) is not None)]


def _layout_options(model: ModelSpec, num_stages: int, space: SearchSpace) -> tuple[tuple[int, ...] | None, ...]:
    if space.layout is not None:
        return (space.layout,) if len(space.layout) == num_stages else ()
    if not space.uneven_stages:
        return (None,) if model.num_layers % num_stages == 0 else ()
    return candidate_layouts(model.num_layers, num_stages)


def _distopt_options(dp: int, space: SearchSpace) -> tuple[bool, ...]:
    if space.distributed_optimizer is not None:
        return (space.distributed_optimizer,)
    return (False, True) if dp > 1 else (False,)


def _offload_options(pp: int, space: SearchSpace) -> tuple[int, ...]:
    """Offloading ranks tried: the first ``ceil(f·pp)`` for each fraction f of the space, deduplicated."""
    return tuple(sorted({math.ceil(f * pp - 1e-9) for f in space.offload_fractions}))


def _schedule_options(space: SearchSpace) -> Iterator[tuple[ScheduleFamily, bool]]:
    """``(family, with BPipe's transform)`` pairs of the space."""
    yield from ((f, False) for f in space.schedules)
    yield from ((f, True) for f in space.bpipe_families)


def enumerate_configs(model: ModelSpec, hw: Hardware | None, *, num_gpus: int, global_batch: int,
                      space: SearchSpace) -> Iterator[ParallelConfig]:
    """Every structurally plausible configuration of ``num_gpus`` GPUs (``check_config`` may still reject some);
    see :func:`_config_fields`."""
    for fields in _config_fields(model, hw, num_gpus=num_gpus, global_batch=global_batch, space=space):
        yield _config_of(fields)


_ConfigFields = tuple[int, int, int, int, int, int, Recompute, bool, Attention, ScheduleFamily, bool, "int | None",
                      bool, "tuple[int, ...] | None", int]
"""A configuration's fields as :func:`_config_fields` yields them (a cheap key: no object, no validation)."""


def _config_of(f: _ConfigFields) -> ParallelConfig:
    return ParallelConfig(tp=f[0], pp=f[1], dp=f[2], chunks=f[3], microbatch_size=f[4], global_batch=f[5],
                          recompute=f[6], sequence_parallel=f[7], attention=f[8], schedule=f[9],
                          distributed_optimizer=f[10], bpipe_budget=f[11], bpipe=f[12], layout=f[13],
                          offload_ranks=f[14])


def _config_fields(model: ModelSpec, hw: Hardware | None, *, num_gpus: int, global_batch: int,
                   space: SearchSpace) -> Iterator[_ConfigFields]:
    """The fields of every configuration :func:`enumerate_configs` produces, in its order.

    tp divides the GPU count, the attention heads and the GPUs of one node (a tensor-parallel group never
    straddles two nodes); pp is at most the layer count;
    dp divides the global batch; every micro-batch size dividing the per-replica batch is tried up to the cap;
    per stage count, the layouts of :func:`_layout_options`; with dp > 1 the distributed optimizer on and off.
    With pp = 1 all schedules coincide, so only 1F1B is produced; BPipe (schedule ``bpipe``, or a family of
    ``space.bpipe_schedules`` with the transform) needs pp >= 3 to have a partner to evict to.
    """
    max_tp = space.max_tp if space.max_tp is not None else hw.gpus_per_node if hw is not None else 1
    per_node = hw.gpus_per_node if hw is not None else max_tp  # mixed devices: the space's max_tp is a node's
    for tp in _divisors(num_gpus):
        if tp > max_tp or model.num_heads % tp or per_node % tp:
            continue
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            if not space.data_parallel and dp > 1:
                continue
            if pp > model.num_layers or global_batch % dp:
                continue
            per_replica = global_batch // dp
            for mbs in _divisors(per_replica):
                if mbs > space.max_microbatch_size:
                    break
                for family, bpipe in _schedule_options(space):
                    evicts = bpipe or split_bpipe(family)[1]
                    if pp == 1 and (family is not ScheduleFamily.ONE_F_ONE_B or bpipe):
                        continue
                    if evicts and pp < 3:
                        continue
                    for chunks in _chunk_options(model, pp, family, space):
                        for layout in _layout_options(model, pp * chunks, space):
                            for distopt in _distopt_options(dp, space):
                                for recompute in space.recomputes:
                                    for offload in (0,) if evicts else _offload_options(pp, space):
                                        yield (tp, pp, dp, chunks, mbs, global_batch, recompute,
                                               space.sequence_parallel and tp > 1, space.attention, family,
                                               distopt, space.bpipe_budget if evicts else None, bpipe, layout,
                                               offload)


_TWIN_MARGIN = 1.0 - 1e-12
"""Shrinks a twin's estimate below the rounding by which an equal step could come out smaller."""

_LIGHTER_RECOMPUTE: dict[Recompute, tuple[Recompute, ...]] = {
    Recompute.NONE: (), Recompute.SELECTIVE: (Recompute.NONE,), Recompute.FULL: (Recompute.NONE, Recompute.SELECTIVE)}
"""Recomputation policies that save less memory and cost less time than each policy."""


@dataclass(slots=True)
class _Checked:
    """An enumerated configuration, the source's objection to it (None: none) once checked, and its work bound
    once asked."""

    config: ParallelConfig
    error: str | None = None
    checked: bool = False
    work: float | None = None


@dataclass(order=True, slots=True)
class _Pending:
    """A configuration waiting in the branch-and-bound queue, ordered by its lower bound (then by enumeration
    order)."""

    bound: float
    order: int
    config: ParallelConfig = field(compare=False)
    exact: bool = field(default=False, compare=False)
    """Whether ``bound`` is the step-time lower bound itself, not the cheaper work bound below it."""


class Searcher:
    """Runs searches over one cost source (the analytic one of a model and hardware, or any via :meth:`over`),
    caching estimates across searches.

    The cache makes ``evenpipe plan --explain bpipe`` cheap: the twin configurations it asks about are usually
    already estimated by the search.
    """

    def __init__(self, model: ModelSpec, hw: Hardware, *, efficiency: Efficiency | None = None) -> None:
        """A searcher over the analytic source of ``model`` on ``hw`` (see :meth:`over` for any source)."""
        self._init(AnalyticSource(model, hw, efficiency or Efficiency()))

    @classmethod
    def over(cls, source: CostSource) -> "Searcher":
        """A searcher over ``source``'s costs: the one search of every planner command."""
        searcher = cls.__new__(cls)
        searcher._init(source)
        return searcher

    def _init(self, source: CostSource) -> None:
        self.source = source
        """Where every cost comes from."""
        self.model = source.model
        self.hw = source.hardware
        self._estimates: dict[ParallelConfig, Estimate] = {}
        self._peaks: dict[ParallelConfig, tuple[float, ...]] = {}
        self._bounds: dict[ParallelConfig, float] = {}
        self._checked: dict[_ConfigFields, _Checked] = {}
        self._states: dict[ParallelConfig, bool] = {}

    @property
    def num_estimated(self) -> int:
        """Distinct configurations estimated (simulated) so far."""
        return len(self._estimates)

    def estimate(self, cfg: ParallelConfig) -> Estimate:
        """The (cached) estimate of one configuration."""
        est = self._estimates.get(cfg)
        if est is None:
            est = estimate_with(self.source, cfg)
            self._estimates[cfg] = est
        return est

    def memory_gib(self, cfg: ParallelConfig) -> tuple[float, ...]:
        """Every rank's peak memory of ``cfg`` in GiB (closed form, no simulation; cached)."""
        peaks = self._peaks.get(cfg)
        if peaks is None:
            peaks = self._peaks[cfg] = tuple(s.total for s in stage_memory(self.source, cfg))
        return peaks

    def peak_memory_gib(self, cfg: ParallelConfig) -> float:
        """The largest stage memory of ``cfg`` in GiB."""
        return max(self.memory_gib(cfg))

    @property
    def usable_memory_gib(self) -> float:
        """Memory a configuration may use on rank 0, GiB (infinite without a budget)."""
        return self._room(0)

    def _room(self, rank: int) -> float:
        budget = self.source.memory_budget_gib(rank)
        return math.inf if budget is None else budget

    def fits(self, cfg: ParallelConfig) -> bool:
        """Whether every rank of ``cfg`` fits in its usable memory."""
        return all(peak <= self._room(r) for r, peak in enumerate(self.memory_gib(cfg)))

    def lower_bound(self, cfg: ParallelConfig) -> float:
        """Step-time lower bound of ``cfg`` (see :func:`evenpipe.plan.bounds.step_time_lower_bound`; cached)."""
        bound = self._bounds.get(cfg)
        if bound is None:
            bound = self._bounds[cfg] = step_bound(self.source, cfg)
        return bound

    def order_bound(self, cfg: ParallelConfig) -> float:
        """Step-time lower bound of ``cfg`` from its compute order simulated on free links (see
        :mod:`evenpipe.plan.order_bound`; several times cheaper than :meth:`estimate`)."""
        return order_bound(self.source, cfg)

    def search(self, *, num_gpus: int, global_batch: int, space: SearchSpace | None = None, top_k: int = 10,
               best_per_schedule: bool = False,
               where: Callable[[ParallelConfig], bool] | None = None,
               incumbent: Candidate | None = None) -> PlanResult:
        """The ``top_k`` fastest fitting configurations, and with ``best_per_schedule`` the fastest of each
        schedule family too (which costs more simulations: each family's neighbourhood must be explored).

        ``where`` restricts the space further. ``incumbent``: a fitting configuration known to lie in the space
        (e.g. the best of a smaller space), which lets the bound skip from the start what cannot beat it (with
        ``top_k`` 1 and no per-schedule bests). Raises :class:`ConfigError` when nothing fits.
        """
        space = space or SearchSpace()
        if num_gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {num_gpus}")
        if global_batch < 1:
            raise ConfigError(f"--global-batch must be >= 1, got {global_batch}")
        if top_k < 1:
            raise ConfigError(f"--top must be >= 1, got {top_k}")
        counts = _Counts()
        with gc_paused():  # ~10^5 acyclic objects (configurations, keys, stage costs) whose allocations would
            # start full collections over the growing caches: ~12% of a 14370-configuration search, for a few
            # hundred cyclic objects left to collect afterwards
            seed = [incumbent] if incumbent is not None and top_k == 1 and not best_per_schedule else []
            pending = self._prune(num_gpus, global_batch, space, where, counts,
                                  seed[0].step_time_s if seed else math.inf)
            top, best_by_family = self._branch_and_bound(pending, top_k, best_per_schedule, counts, seed) \
                if pending else ([], {})
        if not top:
            raise self._nothing_fits(num_gpus, global_batch, counts, space)
        stats = SearchStats(num_enumerated=counts.enumerated, num_invalid=counts.invalid,
                            num_over_memory=counts.over_memory, num_dominated=counts.dominated,
                            num_bounded=counts.bounded, num_estimated=counts.estimated)
        return PlanResult(candidates=tuple(top), best_by_schedule=best_by_family, stats=stats)

    # -- steps ----------------------------------------------------------------------------------------------
    def _prune(self, num_gpus: int, global_batch: int, space: SearchSpace,
               where: Callable[[ParallelConfig], bool] | None, counts: _Counts,
               threshold: float = math.inf) -> list[_Pending]:
        """Enumerate and check; drop (tp, pp, dp) groups whose model states alone overflow; bound the rest. With
        an incumbent, what its work bound shows cannot beat ``threshold`` (its step time) is counted bounded at
        once, unchecked.

        Model states (weights, gradients, optimizer) depend only on (tp, pp, dp), the stages' placement and
        layers and the optimizer's sharding, so one ``stage_memory`` call per group prunes every
        configuration of a group that cannot fit whatever its activations.
        """
        pending: list[_Pending] = []
        states_fit: dict[tuple[object, ...], bool] = {}
        checked = self._checked
        for fields in _config_fields(self.model, self.hw, num_gpus=num_gpus, global_batch=global_batch,
                                     space=space):
            entry = checked.get(fields)
            if entry is None:  # each configuration is built once over the searcher's searches, checked once asked
                entry = checked[fields] = _Checked(_config_of(fields))
            cfg = entry.config
            if where is not None and not where(cfg):
                continue
            counts.enumerated += 1
            if threshold < math.inf and self._work(entry) > threshold:  # cannot beat the incumbent: the branch
                counts.bounded += 1  # and bound would skip it first thing; no need to check it
                continue
            if not entry.checked:
                entry.error, entry.checked = self._objection(cfg, num_gpus), True
            if entry.error is not None:
                counts.invalid += 1
                counts.last_error = entry.error
                continue
            group = (cfg.tp, cfg.pp, cfg.dp, cfg.chunks, cfg.layout, cfg.distributed_optimizer)
            if group not in states_fit:
                states_fit[group] = self._states_fit(cfg)
            if not states_fit[group]:
                counts.over_memory += 1
                continue
            exact = self._bounds.get(cfg)
            if exact is None:
                pending.append(_Pending(self._work(entry), len(pending), cfg))
            else:
                pending.append(_Pending(exact, len(pending), cfg, True))
        return pending

    def _objection(self, cfg: ParallelConfig, num_gpus: int) -> str | None:
        """The first line of the source's objection to ``cfg`` (None when it may run)."""
        try:
            self.source.check(cfg, num_gpus)
        except EvenpipeError as e:
            return str(e).splitlines()[0]
        return None

    def _work(self, entry: _Checked) -> float:
        """The work bound of an enumerated configuration (0 where it cannot be had: its check will tell why)."""
        if entry.work is None:
            try:
                entry.work = work_bound(self.source, entry.config)
            except EvenpipeError:
                entry.work = 0.0
        return entry.work

    def _dominated(self, cfg: ParallelConfig, fitting: set[ParallelConfig]) -> bool:
        """Whether a fitting twin with lighter recomputation is at least as fast: it computes no more, and (for
        BPipe and host offload, whose transfers carry the saved activations) moves no more bytes; or a fitting twin
        that offloads on fewer ranks (the same computes, fewer host copies)."""
        for k in range(cfg.offload_ranks):  # offload only adds host copies: a fitting twin offloading less wins
            if _replace_config(cfg, offload_ranks=k) in fitting:
                return True
        for r in _LIGHTER_RECOMPUTE[cfg.recompute]:
            twin = _replace_config(cfg, recompute=r)
            moves = cfg.uses_bpipe or cfg.offload_ranks > 0
            if twin in fitting and (not moves or self._moves_no_more(twin, cfg)):
                return True
        return False

    def _offload_floor(self, cfg: ParallelConfig, skipped: dict[ParallelConfig, float]) -> float:
        """A lower bound on the step time of ``cfg``, which offloads activations to host memory, tighter than its
        step bound: the offload bound (:func:`~evenpipe.plan.bounds.offload_bound`, its exposed reloads), and what
        is known of a twin never slower than it, as :meth:`_dominated` takes them: the estimate, when one is
        cached, of the same offloading on fewer ranks (the same computes and messages, fewer host copies), and the
        estimate or floor (``skipped``) of a lighter recomputation that moves no more bytes.
        (BPipe gets no such floor: its schedule posts some receives earlier than its plain twin's, which can make
        it a little faster.)"""
        floor = offload_bound(self.source, cfg)
        for k in range(cfg.offload_ranks):
            est = self._estimates.get(_replace_config(cfg, offload_ranks=k))
            if est is not None:
                floor = max(floor, est.step_time_s * _TWIN_MARGIN)
        for r in _LIGHTER_RECOMPUTE[cfg.recompute]:
            twin = _replace_config(cfg, recompute=r)
            known = skipped.get(twin)
            if known is None and (est := self._estimates.get(twin)) is not None:
                known = est.step_time_s * _TWIN_MARGIN
            if known is not None and known > floor and self._moves_no_more(twin, cfg):
                floor = known
        return floor

    def _moves_no_more(self, a: ParallelConfig, b: ParallelConfig) -> bool:
        """Whether every stage of ``a`` moves (evicts or offloads) no more bytes per micro-batch than the same stage
        of ``b``: a fully recomputed micro-batch moves its checkpoint, another its saved activations."""
        costs_a = self.source.stage_costs(a, shape_of(self.model, a))
        costs_b = self.source.stage_costs(b, shape_of(self.model, b))
        full_a, full_b = a.recompute is Recompute.FULL, b.recompute is Recompute.FULL
        return all((sa.checkpoint_bytes if full_a else sa.activation_bytes)
                   <= (sb.checkpoint_bytes if full_b else sb.activation_bytes)
                   for sa, sb in zip(costs_a.stages, costs_b.stages))

    def _states_fit(self, cfg: ParallelConfig) -> bool:
        """Whether the model states of ``cfg``'s (tp, pp, dp) leave room on every rank (activations aside)."""
        schedule = cfg.schedule if cfg.chunks > 1 else ScheduleFamily.ONE_F_ONE_B  # same placement, cheap
        probe = _replace_config(cfg, schedule=schedule, bpipe_budget=None, bpipe=False, microbatch_size=1,
                                recompute=Recompute.FULL)
        known = self._states.get(probe)
        if known is None:
            try:
                states = layer_states_per_rank_gib(self.source, probe)
            except EvenpipeError:
                known = True  # cannot probe this shape; let each configuration decide
            else:
                known = all(state <= self._room(r) for r, state in enumerate(states))
            self._states[probe] = known
        return known

    def _branch_and_bound(self, pending: list[_Pending], top_k: int, per_family: bool, counts: _Counts,
                          seed: list[Candidate]
                          ) -> tuple[list[Candidate], dict[ScheduleFamily, Candidate]]:
        """Visit configurations in increasing bound order; check memory, then estimate, only those that could
        still enter the top ``k`` (or beat their family's best).

        Items enter with the cheap :func:`~evenpipe.plan.bounds.work_lower_bound` (no stage costs): one that cannot
        win on it is skipped as the exact bound would skip it later; otherwise it goes back in under its exact
        bound, so configurations are visited in exact-bound order all the same.
        Memory is checked lazily, so configurations skipped by the bound never cost a ``stage_memory`` call.
        A configuration whose lighter-recomputation twin fits is dominated: recomputation adds time and saves only
        memory (under BPipe only when the twin also evicts no more bytes); the twin's bound is no
        larger, so it was visited first. Once a micro-batch size overflows, larger ones with the same other
        choices are taken as over memory too (activations are b sequences times an in-flight count that never
        falls faster than 1/b).
        With ``top_k`` 1 and no per-family bests, domination is transitive: a dominated configuration is at least as
        slow as a fitting one visited before it, which already entered the top or could not, so what it
        dominates in turn cannot enter either (ties never replace the best) and is skipped too (e.g. selective
        recomputation with offload, when the same without either fits).
        """
        transitive = top_k == 1 and not per_family
        heapq.heapify(pending)
        top: list[Candidate] = list(seed)  # sorted fastest first, at most top_k
        best: dict[ScheduleFamily, Candidate] = {}
        fitting: set[ParallelConfig] = set()
        overflow_at: dict[tuple[object, ...], int] = {}  # choices except b -> smallest b that overflowed
        skipped: dict[ParallelConfig, float] = {}  # offloading configurations skipped on their floor -> that floor
        while pending:
            item = heapq.heappop(pending)
            cfg = item.config
            kth = top[-1].step_time_s if len(top) >= top_k else float("inf")
            fam = best.get(cfg.schedule)
            fam_best = fam.step_time_s if fam is not None else float("inf")
            if item.bound > kth and (not per_family or item.bound > fam_best):
                counts.bounded += 1
                if not per_family:  # every item left bounds at least this one, and kth only falls: all skipped
                    counts.bounded += len(pending)
                    break
                continue
            if not item.exact:  # the work bound could not skip it: its place is that of its exact bound
                bound = self.lower_bound(cfg)
                if bound != item.bound:
                    heapq.heappush(pending, _Pending(bound, item.order, cfg, True))
                    continue
            if self._dominated(cfg, fitting):
                counts.dominated += 1
                if transitive:  # at least as slow as a fitting one: it dominates as that one would
                    fitting.add(cfg)
                continue
            floor = self._offload_floor(cfg, skipped) if cfg.offload_ranks and not cfg.uses_bpipe else 0.0
            if floor > kth and (not per_family or floor > fam_best):  # skipped where it stands: the others'
                skipped[cfg] = floor  # order is kept
                counts.bounded += 1
                continue
            key = (cfg.tp, cfg.pp, cfg.dp, cfg.schedule, cfg.bpipe, cfg.chunks, cfg.recompute, cfg.layout,
                   cfg.distributed_optimizer, cfg.offload_ranks)
            try:
                fits = cfg.microbatch_size < overflow_at.get(key, cfg.microbatch_size + 1) and self.fits(cfg)
            except EvenpipeError as e:  # the schedule generator may reject the shape (e.g. interleaved m % p)
                counts.invalid += 1
                counts.last_error = str(e).splitlines()[0]
                continue
            if not fits:
                counts.over_memory += 1
                overflow_at[key] = min(overflow_at.get(key, cfg.microbatch_size), cfg.microbatch_size)
                continue
            if kth < math.inf or (per_family and fam_best < math.inf):
                floor = self.order_bound(cfg)
                if floor > kth and (not per_family or floor > fam_best):  # its compute order alone is too slow
                    fitting.add(cfg)  # it fits: what it dominates cannot win either
                    counts.bounded += 1
                    continue
            try:
                cand = Candidate(config=cfg, estimate=self.estimate(cfg))
            except EvenpipeError as e:  # the full-length schedule may break a rule the truncated one kept
                counts.invalid += 1
                counts.last_error = str(e).splitlines()[0]
                continue
            counts.estimated += 1
            if not cand.estimate.fits:  # stage_memory said it fits; keep the two views consistent
                continue
            fitting.add(cfg)
            if cand.step_time_s < kth:
                top.append(cand)
                top.sort(key=lambda c: c.step_time_s)
                del top[top_k:]
            if cand.step_time_s < fam_best:
                best[cfg.schedule] = cand
        return top, best

    def _nothing_fits(self, num_gpus: int, global_batch: int, counts: _Counts, space: SearchSpace) -> ConfigError:
        if counts.enumerated == 0:
            return ConfigError(
                f"no (tp, pp, dp) factorisation of --gpus {num_gpus} suits {self.model.name} "
                f"({self.model.num_heads} heads, {self.model.num_layers} layers) and --global-batch {global_batch}"
                f"; dp must divide the global batch and tp the heads and the "
                f"{self.hw.gpus_per_node if self.hw is not None else 1} GPUs of a node)")
        if counts.over_memory == 0:
            return ConfigError(f"--gpus {num_gpus} has no valid tp·pp·dp split for {self.model.name} and "
                               f"--global-batch {global_batch}; for example: {counts.last_error}")
        return ConfigError(
            f"no configuration of {self.model.name} fits in {num_gpus} x {self.source.name} "
            f"({self._room(0):g} GiB usable each): all {counts.over_memory} valid ones exceed memory; use more GPUs, "
            + ("the distributed optimizer, " if space.distributed_optimizer is False else "")
            + "or a smaller model")


def plan_configs(model: ModelSpec, hw: Hardware, *, num_gpus: int, global_batch: int,
                 space: SearchSpace | None = None, top_k: int = 10,
                 efficiency: Efficiency | None = None) -> PlanResult:
    """Search the whole space once; see :class:`Searcher`."""
    return Searcher(model, hw, efficiency=efficiency).search(num_gpus=num_gpus, global_batch=global_batch,
                                                             space=space, top_k=top_k)


def _replace_config(cfg: ParallelConfig, **changes: object) -> ParallelConfig:
    """``dataclasses.replace`` with the keyword changes typed loosely (mypy cannot check ``**changes``)."""
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]
