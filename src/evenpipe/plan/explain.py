"""Does BPipe pay for this model and hardware? Compare the best BPipe configuration with the best other one.

BPipe (Kim et al. 2023) moves activations from the first pipeline ranks to their partners so that no rank holds
more than about (p+1)/2 micro-batches. Memory freed that way only helps if it is spent on a *lever* that makes the
step faster: a larger micro-batch (better GPU efficiency), less or no recomputation, or fewer pipeline/tensor
ranks. Huang et al. 2024 re-evaluated it: the 1.25-2.17x reported for GPT-3 96B/134B with eager attention came from
dropping recomputation and raising the micro-batch; with flash attention the activations are small enough that
the lever is available without BPipe, and the larger micro-batch is eaten by the bubble of having fewer
micro-batches and by the exposed transfers. This module makes that argument from the cost model's numbers.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from evenpipe.cost import Estimate, ParallelConfig, Recompute
from evenpipe.errors import ConfigError
from evenpipe.plan.search import Candidate, PlanResult, Searcher
from evenpipe.schedule import ScheduleFamily

__all__ = ["Verdict", "Lever", "Eater", "ComponentDelta", "BPipeExplanation", "explain_bpipe", "TIME_COMPONENTS"]

_RECOMPUTE_RANK = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}

TIME_COMPONENTS: tuple[str, ...] = ("compute", "recompute", "bubble", "tp_comm", "pp_comm", "dp_comm",
                                    "bpipe_transfer")
"""The step-time components compared, as named in :class:`evenpipe.cost.TimeBreakdown` (seconds)."""


class Verdict(enum.Enum):
    """The answer."""

    PAYS = "pays"
    """The best BPipe configuration is faster than the best other one by more than the margin."""
    MARGINAL = "marginal"
    """Within the margin either way: not worth the extra moving part."""
    DOES_NOT_PAY = "does not pay"
    """The best other configuration is faster by more than the margin."""
    NOT_APPLICABLE = "not applicable"
    """No BPipe configuration fits or exists (e.g. fewer than 3 pipeline ranks everywhere)."""


class Lever(enum.Enum):
    """What BPipe's balanced memory is spent on, comparing its best configuration with the best other one."""

    LARGER_MICROBATCH = "a larger micro-batch"
    LESS_RECOMPUTE = "less recomputation"
    SMALLER_PP = "fewer pipeline stages"
    SMALLER_TP = "less tensor parallelism"


class Eater(enum.Enum):
    """What eats BPipe's gain."""

    BUBBLE = "bubble growth from fewer micro-batches"
    TRANSFER = "exposed evict/load transfer time"
    ACCEPTOR_MEMORY = "more memory on the acceptor ranks"


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
    twin_fits: bool | None
    """Whether the BPipe configuration still fits with plain 1F1B (False: BPipe is what makes it possible)."""
    twin: Candidate | None
    """That 1F1B twin's estimate when it fits."""
    twin_peak_memory_gib: float | None
    """Peak stage memory of the 1F1B twin (fitting or not)."""
    levers: tuple[Lever, ...]
    """What the BPipe configuration changes relative to the baseline, in the memory-relevant knobs."""
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

    def to_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value, "gain": self.gain, "margin": self.margin,
            "baseline": self.baseline.to_dict(), "bpipe": None if self.bpipe is None else self.bpipe.to_dict(),
            "twin_fits": self.twin_fits, "twin": None if self.twin is None else self.twin.to_dict(),
            "twin_peak_memory_gib": self.twin_peak_memory_gib,
            "levers": [lv.value for lv in self.levers], "eaters": [e.value for e in self.eaters],
            "components": {c.name: {"baseline_s": c.baseline_s, "bpipe_s": c.bpipe_s} for c in self.components},
            "hosted_gib": self.hosted_gib,
        }


def _component_s(est: Estimate, name: str) -> float:
    return float(getattr(est.breakdown, name))


def _levers(base: ParallelConfig, bp: ParallelConfig) -> tuple[Lever, ...]:
    out = []
    if bp.microbatch_size > base.microbatch_size:
        out.append(Lever.LARGER_MICROBATCH)
    if _RECOMPUTE_RANK[bp.recompute] < _RECOMPUTE_RANK[base.recompute]:
        out.append(Lever.LESS_RECOMPUTE)
    if bp.pp < base.pp:
        out.append(Lever.SMALLER_PP)
    if bp.tp < base.tp:
        out.append(Lever.SMALLER_TP)
    return tuple(out)


def _hosted_gib(est: Estimate) -> float:
    return max((s.hosted for s in est.stage_memory), default=0.0)


def _eaters(base: Estimate, bp: Estimate) -> tuple[Eater, ...]:
    out = []
    if bp.breakdown.bubble > base.breakdown.bubble:
        out.append(Eater.BUBBLE)
    if bp.breakdown.bpipe_transfer > 0:
        out.append(Eater.TRANSFER)
    if _hosted_gib(bp) > 0:
        out.append(Eater.ACCEPTOR_MEMORY)
    return tuple(out)


def _twin(bp: ParallelConfig) -> ParallelConfig:
    return dataclasses.replace(bp, schedule=ScheduleFamily.ONE_F_ONE_B, bpipe_budget=None)


def explain_bpipe(searcher: Searcher, result: PlanResult, *, margin: float = 0.02) -> BPipeExplanation:
    """Answer whether BPipe pays, from a finished search over a space that included BPipe.

    ``result.best_by_schedule`` supplies the best BPipe and best other configuration; the BPipe configuration's
    1F1B twin (same everything, no eviction) tells whether BPipe is what makes it fit.
    """
    if margin < 0:
        raise ConfigError(f"margin must be >= 0, got {margin}")
    others = [c for fam, c in result.best_by_schedule.items() if fam is not ScheduleFamily.BPIPE]
    if not others:
        raise ConfigError("--explain bpipe needs at least one non-BPipe configuration that fits to compare with")
    baseline = min(others, key=lambda c: c.step_time_s)
    bpipe = result.best_by_schedule.get(ScheduleFamily.BPIPE)
    if bpipe is None:
        return BPipeExplanation(verdict=Verdict.NOT_APPLICABLE, gain=0.0, margin=margin, baseline=baseline,
                                bpipe=None, twin_fits=None, twin=None, twin_peak_memory_gib=None, levers=(),
                                eaters=(), components=(), hosted_gib=0.0)
    gain = baseline.step_time_s / bpipe.step_time_s - 1.0
    verdict = Verdict.PAYS if gain > margin else Verdict.DOES_NOT_PAY if gain < -margin else Verdict.MARGINAL
    twin_cfg = _twin(bpipe.config)
    twin_fits = searcher.fits(twin_cfg)
    twin = Candidate(config=twin_cfg, estimate=searcher.estimate(twin_cfg)) if twin_fits else None
    twin_peak = searcher.peak_memory_gib(twin_cfg)
    components = tuple(ComponentDelta(name=n, baseline_s=_component_s(baseline.estimate, n),
                                      bpipe_s=_component_s(bpipe.estimate, n)) for n in TIME_COMPONENTS)
    return BPipeExplanation(
        verdict=verdict, gain=gain, margin=margin, baseline=baseline, bpipe=bpipe, twin_fits=twin_fits, twin=twin,
        twin_peak_memory_gib=twin_peak, levers=_levers(baseline.config, bpipe.config),
        eaters=_eaters(baseline.estimate, bpipe.estimate), components=components,
        hosted_gib=_hosted_gib(bpipe.estimate))
