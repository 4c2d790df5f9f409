"""Does BPipe pay for this model and hardware? Compare the best BPipe configuration with the best other one.

BPipe (Kim et al. 2023) moves activations from the first pipeline ranks to their partners so that no rank holds
more than about (p+1)/2 micro-batches. Memory freed that way only helps if it is spent on a *lever* that makes the
step faster: a larger micro-batch (better GEMM efficiency), less recomputation, or fewer tensor- or
pipeline-parallel ranks. Kim et al. reported 1.25-2.17x for GPT-3 96B/134B with eager attention, where the score
matrices make activations large; Huang et al. 2024 re-evaluated it and found no gain for LLaMA with flash attention,
whose activations are small enough that the levers are available without BPipe, while BPipe's costs remain: a
larger micro-batch means fewer micro-batches and a larger bubble, evict/load transfers can be exposed, the acceptor
ranks hold more memory, and BPipe (built on 1F1B) gives up interleaving. This module makes that argument with the
cost model's numbers: nothing here is hard-coded per model.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from evenpipe.cost import Estimate, ParallelConfig, Recompute
from evenpipe.errors import ConfigError
from evenpipe.plan.search import Candidate, Searcher, SearchSpace
from evenpipe.schedule import ScheduleFamily

__all__ = ["Verdict", "Lever", "Eater", "ComponentDelta", "BPipeExplanation", "explain_bpipe", "TIME_COMPONENTS"]

_RECOMPUTE_RANK = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}

TIME_COMPONENTS: tuple[str, ...] = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "optimizer",
                                    "bubble", "bpipe_transfer")
"""Step-time components compared, as named in :class:`evenpipe.cost.TimeBreakdown` (seconds; they sum to the
step time)."""

_NOISE = 1e-3
"""Component changes below this share of the baseline step are not named as savings or costs."""


class Verdict(enum.Enum):
    """The answer."""

    PAYS = "pays"
    """The best BPipe configuration is faster than the best other one by more than the margin."""
    MARGINAL = "marginal"
    """Within the margin either way: not worth the extra moving part."""
    DOES_NOT_PAY = "does not pay"
    """The best other configuration is faster by more than the margin."""
    NOT_APPLICABLE = "not applicable"
    """No BPipe configuration fits or exists (BPipe needs at least 3 pipeline ranks)."""


class Lever(enum.Enum):
    """What BPipe's balanced memory is spent on, comparing its best configuration with the best other one."""

    LARGER_MICROBATCH = "a larger micro-batch"
    LESS_RECOMPUTE = "less recomputation"
    SMALLER_TP = "less tensor parallelism"
    SMALLER_PP = "fewer pipeline stages"


class Eater(enum.Enum):
    """What eats BPipe's gain."""

    BUBBLE = "bubble growth"
    """A larger bubble: fewer micro-batches, more stages, or no interleaving (BPipe is built on 1F1B)."""
    TRANSFER = "exposed evict/load transfers"
    """Time the ranks wait for BPipe's activation transfers."""
    ACCEPTOR_MEMORY = "more memory on the acceptors"
    """Acceptor ranks host their partners' activations, which caps how far the lever can be pushed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentDelta:
    """One step-time component in the baseline and in the BPipe configuration."""

    name: str
    """Component name (see :data:`TIME_COMPONENTS`)."""
    baseline_s: float
    """Seconds in the best non-BPipe configuration."""
    bpipe_s: float
    """Seconds in the best BPipe configuration."""

    @property
    def delta_s(self) -> float:
        """BPipe minus baseline: negative is a saving."""
        return self.bpipe_s - self.baseline_s


@dataclass(frozen=True, slots=True, kw_only=True)
class BPipeExplanation:
    """The reasoned answer to "does BPipe pay here?", with the numbers behind it."""

    verdict: Verdict
    """The answer."""
    gain: float
    """Throughput of the best BPipe configuration over the best other one, minus 1 (0.25 is 25% faster)."""
    margin: float
    """Gains within +-margin count as marginal."""
    baseline: Candidate
    """The best configuration without BPipe."""
    bpipe: Candidate | None
    """The best BPipe configuration, if any fits."""
    usable_memory_gib: float
    """Memory a rank may use (the GPU's memory less its reserve)."""
    twin_fits: bool | None
    """Whether the BPipe configuration still fits without eviction (plain 1F1B for schedule ``bpipe``; False: BPipe
    is what makes it possible)."""
    twin: Candidate | None
    """That twin's estimate when it fits."""
    twin_peak_memory_gib: float | None
    """Peak rank memory of the twin (fitting or not)."""
    levers: tuple[Lever, ...]
    """What BPipe's balanced memory buys relative to the baseline, among the memory-bound knobs (empty when the
    BPipe configuration fits without BPipe: then the memory bought nothing)."""
    eaters: tuple[Eater, ...]
    """What costs the BPipe configuration time or memory relative to the baseline."""
    components: tuple[ComponentDelta, ...]
    """Step-time components, baseline vs BPipe."""
    hosted_gib: float
    """Largest hosted (accepted) activation memory on one acceptor rank of the BPipe configuration."""

    @property
    def pays(self) -> bool:
        return self.verdict is Verdict.PAYS

    def component(self, name: str) -> ComponentDelta:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def savings(self) -> tuple[ComponentDelta, ...]:
        """Components BPipe's configuration shrinks noticeably, largest saving first."""
        floor = _NOISE * self.baseline.step_time_s
        return tuple(sorted((c for c in self.components if c.delta_s < -floor), key=lambda c: c.delta_s))

    @property
    def costs(self) -> tuple[ComponentDelta, ...]:
        """Components BPipe's configuration grows noticeably, largest cost first."""
        floor = _NOISE * self.baseline.step_time_s
        return tuple(sorted((c for c in self.components if c.delta_s > floor), key=lambda c: -c.delta_s))

    def to_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value, "gain": self.gain, "margin": self.margin,
            "baseline": self.baseline.to_dict(), "bpipe": None if self.bpipe is None else self.bpipe.to_dict(),
            "usable_memory_gib": self.usable_memory_gib,
            "twin_fits": self.twin_fits, "twin": None if self.twin is None else self.twin.to_dict(),
            "twin_peak_memory_gib": self.twin_peak_memory_gib,
            "levers": [lv.value for lv in self.levers], "eaters": [e.value for e in self.eaters],
            "components_s": {c.name: {"baseline": c.baseline_s, "bpipe": c.bpipe_s} for c in self.components},
            "hosted_gib": self.hosted_gib,
        }


def _levers(base: ParallelConfig, bp: ParallelConfig) -> tuple[Lever, ...]:
    out = []
    if bp.microbatch_size > base.microbatch_size:
        out.append(Lever.LARGER_MICROBATCH)
    if _RECOMPUTE_RANK[bp.recompute] < _RECOMPUTE_RANK[base.recompute]:
        out.append(Lever.LESS_RECOMPUTE)
    if bp.tp < base.tp:
        out.append(Lever.SMALLER_TP)
    if bp.pp < base.pp:
        out.append(Lever.SMALLER_PP)
    return tuple(out)


def _hosted_gib(est: Estimate) -> float:
    return max((s.hosted for s in est.stage_memory), default=0.0)


def _eaters(costs: tuple[ComponentDelta, ...], bp: Estimate) -> tuple[Eater, ...]:
    grown = {c.name for c in costs}
    out = []
    if "bubble" in grown:
        out.append(Eater.BUBBLE)
    if "bpipe_transfer" in grown:
        out.append(Eater.TRANSFER)
    if _hosted_gib(bp) > 0:
        out.append(Eater.ACCEPTOR_MEMORY)
    return tuple(out)


def explain_bpipe(searcher: Searcher, *, num_gpus: int, global_batch: int, space: SearchSpace | None = None,
                  margin: float = 0.02) -> BPipeExplanation:
    """Answer whether BPipe pays: search the best BPipe configuration (schedule ``bpipe``, and the families of
    ``space.bpipe_schedules`` with the transform, e.g. interleaved) and the best configuration without eviction
    (the searcher's estimate cache makes the second search cheap), then compare them component by component.
    The BPipe configuration's twin (same everything, no eviction: 1F1B for ``bpipe``) tells whether BPipe is
    what makes it fit.
    Gains within ``margin`` are called marginal.
    """
    if margin < 0:
        raise ConfigError(f"margin must be >= 0, got {margin}")
    space = space or SearchSpace()
    others = tuple(f for f in space.schedules if f is not ScheduleFamily.BPIPE) or (ScheduleFamily.ONE_F_ONE_B,)
    baseline = searcher.search(num_gpus=num_gpus, global_batch=global_batch, top_k=1,
                               space=dataclasses.replace(space, schedules=others, bpipe_schedules=())).best
    usable = searcher.hw.usable_memory_gib
    try:
        bpipe: Candidate | None = searcher.search(
            num_gpus=num_gpus, global_batch=global_batch, top_k=1,
            space=dataclasses.replace(space, schedules=(ScheduleFamily.BPIPE,),
                                      bpipe_schedules=space.bpipe_families)).best
    except ConfigError:
        bpipe = None
    if bpipe is None:
        return BPipeExplanation(verdict=Verdict.NOT_APPLICABLE, gain=0.0, margin=margin, baseline=baseline,
                                bpipe=None, usable_memory_gib=usable, twin_fits=None, twin=None,
                                twin_peak_memory_gib=None, levers=(), eaters=(), components=(), hosted_gib=0.0)
    gain = baseline.step_time_s / bpipe.step_time_s - 1.0
    verdict = Verdict.PAYS if gain > margin else Verdict.DOES_NOT_PAY if gain < -margin else Verdict.MARGINAL
    plain = ScheduleFamily.ONE_F_ONE_B if bpipe.config.schedule is ScheduleFamily.BPIPE else bpipe.config.schedule
    twin_cfg = dataclasses.replace(bpipe.config, schedule=plain, bpipe=False, bpipe_budget=None)
    twin_fits = searcher.fits(twin_cfg)
    twin = Candidate(config=twin_cfg, estimate=searcher.estimate(twin_cfg)) if twin_fits else None
    components = tuple(ComponentDelta(name=n, baseline_s=float(getattr(baseline.estimate.breakdown, n)),
                                      bpipe_s=float(getattr(bpipe.estimate.breakdown, n))) for n in TIME_COMPONENTS)
    partial = BPipeExplanation(
        verdict=verdict, gain=gain, margin=margin, baseline=baseline, bpipe=bpipe, usable_memory_gib=usable,
        twin_fits=twin_fits, twin=twin, twin_peak_memory_gib=searcher.peak_memory_gib(twin_cfg),
        levers=() if twin_fits else _levers(baseline.config, bpipe.config), eaters=(), components=components,
        hosted_gib=_hosted_gib(bpipe.estimate))
    return dataclasses.replace(partial, eaters=_eaters(partial.costs, bpipe.estimate))
