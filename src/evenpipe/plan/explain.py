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
from evenpipe.cost.parallel import split_bpipe
from evenpipe.cost.source import shape_of
from evenpipe.errors import ConfigError
from evenpipe.plan.search import Candidate, Searcher, SearchSpace
from evenpipe.schedule import ScheduleFamily

__all__ = ["Verdict", "Lever", "Eater", "ComponentDelta", "BPipeExplanation", "explain_bpipe", "TIME_COMPONENTS",
           "answer_text"]

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
    blocked: Candidate | None = None
    """The twin's estimate when it does not fit: what BPipe unlocks, and what memory alone would buy."""
    bpipe_at_baseline_microbatch: Candidate | None = None
    """When BPipe's best takes a smaller micro-batch than the baseline, its configuration at the baseline's."""
    layer_flops_per_s: dict[int, float] = dataclasses.field(default_factory=dict)
    """Achieved forward FLOP/s of one layer per micro-batch size involved (what a larger one buys)."""
    text: str = ""
    """The answer in words, with its numbers (:func:`answer_text`)."""

    @property
    def pays(self) -> bool:
        return self.verdict is Verdict.PAYS

    @property
    def with_bpipe(self) -> Candidate | None:
        """The best BPipe configuration (``bpipe``)."""
        return self.bpipe

    @property
    def without(self) -> Candidate:
        """The best configuration without BPipe (``baseline``)."""
        return self.baseline

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
            "hosted_gib": self.hosted_gib, "pays": self.pays, "text": self.text,
            "without": self.baseline.to_dict(), "with_bpipe": None if self.bpipe is None else self.bpipe.to_dict(),
            "blocked": None if self.blocked is None else self.blocked.to_dict(),
            "layer_flops_per_s": {str(b): r for b, r in self.layer_flops_per_s.items()},
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
    others = tuple(f for f in space.schedules if not split_bpipe(f)[1]) or (ScheduleFamily.ONE_F_ONE_B,)
    baseline = searcher.search(num_gpus=num_gpus, global_batch=global_batch, top_k=1,
                               space=dataclasses.replace(space, schedules=others, bpipe_schedules=())).best
    usable = searcher.usable_memory_gib
    bpipe_space = dataclasses.replace(space, schedules=(ScheduleFamily.BPIPE,), bpipe_schedules=space.bpipe_families)
    try:
        bpipe: Candidate | None = searcher.search(num_gpus=num_gpus, global_batch=global_batch, top_k=1,
                                                  space=bpipe_space).best
    except ConfigError:
        bpipe = None
    if bpipe is None:
        empty = BPipeExplanation(verdict=Verdict.NOT_APPLICABLE, gain=0.0, margin=margin, baseline=baseline,
                                 bpipe=None, usable_memory_gib=usable, twin_fits=None, twin=None,
                                 twin_peak_memory_gib=None, levers=(), eaters=(), components=(), hosted_gib=0.0)
        return _with_text(searcher, empty, num_gpus, global_batch)
    gain = baseline.step_time_s / bpipe.step_time_s - 1.0
    verdict = Verdict.PAYS if gain > margin else Verdict.DOES_NOT_PAY if gain < -margin else Verdict.MARGINAL
    plain = split_bpipe(bpipe.config.schedule)[0]
    twin_cfg = dataclasses.replace(bpipe.config, schedule=plain, bpipe=False, bpipe_budget=None)
    twin_fits = searcher.fits(twin_cfg)
    twin_est = Candidate(config=twin_cfg, estimate=searcher.estimate(twin_cfg))
    components = tuple(ComponentDelta(name=n, baseline_s=float(getattr(baseline.estimate.breakdown, n)),
                                      bpipe_s=float(getattr(bpipe.estimate.breakdown, n))) for n in TIME_COMPONENTS)
    partial = BPipeExplanation(
        verdict=verdict, gain=gain, margin=margin, baseline=baseline, bpipe=bpipe, usable_memory_gib=usable,
        twin_fits=twin_fits, twin=twin_est if twin_fits else None,
        twin_peak_memory_gib=searcher.peak_memory_gib(twin_cfg),
        levers=() if twin_fits else _levers(baseline.config, bpipe.config), eaters=(), components=components,
        hosted_gib=_hosted_gib(bpipe.estimate), blocked=None if twin_fits else twin_est,
        bpipe_at_baseline_microbatch=_bpipe_at(searcher, baseline, bpipe))
    explained = dataclasses.replace(partial, eaters=_eaters(partial.costs, bpipe.estimate))
    return _with_text(searcher, explained, num_gpus, global_batch)


def _bpipe_at(searcher: Searcher, baseline: Candidate, bpipe: Candidate) -> Candidate | None:
    """BPipe's configuration at the baseline's micro-batch size, when its best takes a smaller one and that
    fits (else None)."""
    b = baseline.config.microbatch_size
    if bpipe.config.microbatch_size >= b:
        return None
    cfg = dataclasses.replace(bpipe.config, microbatch_size=b)
    try:
        return Candidate(config=cfg, estimate=searcher.estimate(cfg)) if searcher.fits(cfg) else None
    except ConfigError:
        return None


def _with_text(searcher: Searcher, e: BPipeExplanation, num_gpus: int, global_batch: int) -> BPipeExplanation:
    """``e`` with its per-layer FLOP rates and its answer in words."""
    rates = {}
    for c in (e.baseline, e.bpipe, e.blocked):
        if c is not None:
            rates[c.config.microbatch_size] = searcher.source.layer_flop_rate(
                c.config, 0, shape_of(searcher.model, c.config))
    e = dataclasses.replace(e, layer_flops_per_s=dict(sorted(rates.items())))
    return dataclasses.replace(e, text=answer_text(e, where=f"on {searcher.source.name}, {num_gpus} devices, "
                                                      f"{global_batch} sequences per step"))


def _short(c: Candidate) -> str:
    """``1f1b+bpipe tp=1 pp=4 dp=1 b=4 m=4``-style summary."""
    cfg = c.config
    chunks = f" v={cfg.chunks}" if cfg.chunks > 1 else ""
    return (f"{cfg.schedule_name}{chunks} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} b={cfg.microbatch_size} "
            f"m={cfg.num_microbatches} recompute={cfg.recompute.value}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _line(label: str, c: Candidate, rates: dict[int, float]) -> str:
    e, b = c.estimate, c.config.microbatch_size
    activations = max(m.activations + m.hosted for m in e.stage_memory)
    exposed = e.breakdown.pp_comm + e.breakdown.bpipe_transfer
    return (f"  {label}: {_short(c)}: {_ms(c.step_time_s)}/step, peak {c.peak_memory_gib:.3f} GiB (activations "
            f"{activations:.3f} GiB), bubble {e.bubble_fraction:.1%}, exposed transfers {_ms(exposed)}, one layer "
            f"{rates.get(b, 0.0) / 1e9:.2f} GFLOP/s at b={b}")


def _why(e: BPipeExplanation) -> str:
    """Why the fastest BPipe configuration wins or loses against the baseline, in its micro-batch terms."""
    assert e.bpipe is not None
    bp, base, rates = e.bpipe, e.baseline, e.layer_flops_per_s
    b_bp, b_base = bp.config.microbatch_size, base.config.microbatch_size
    if b_bp > b_base:
        return (f"its balanced memory fits b={b_bp} instead of b={b_base}, where one layer runs at "
                f"{rates.get(b_bp, 0.0) / 1e9:.2f} instead of {rates.get(b_base, 0.0) / 1e9:.2f} GFLOP/s")
    if b_bp == b_base:
        return (f"its memory buys no larger micro-batch under this budget (both b={b_bp}); what differs is the "
                f"schedule: bubble {bp.estimate.bubble_fraction:.1%} vs {base.estimate.bubble_fraction:.1%}, exposed "
                f"transfers {_ms(bp.estimate.breakdown.bpipe_transfer + bp.estimate.breakdown.pp_comm)} vs "
                f"{_ms(base.estimate.breakdown.bpipe_transfer + base.estimate.breakdown.pp_comm)}")
    at = e.bpipe_at_baseline_microbatch
    if at is not None:
        return f"its fastest is b={b_bp}; at b={b_base} it takes {at.step_time_s * 1e3:.1f} ms/step"
    return f"its fastest is b={b_bp}; it fits no configuration at b={b_base}"


def answer_text(e: BPipeExplanation, *, where: str) -> str:
    """The answer in words with its numbers: the fastest configuration with and without BPipe, what memory
    alone would buy, and the verdict with the reason (``where`` names the devices and the batch)."""
    rates = e.layer_flops_per_s
    lines = [f"{where}, budget {e.usable_memory_gib:.3f} GiB per device:",
             _line("fastest without BPipe", e.baseline, rates)]
    lines.append(_line("fastest with BPipe   ", e.bpipe, rates) if e.bpipe is not None
                 else "  no BPipe configuration fits the budget")
    if e.blocked is not None and e.blocked.step_time_s < e.baseline.step_time_s:
        lines.append(f"  memory is the limit: {_short(e.blocked)} would take {_ms(e.blocked.step_time_s)}/step but "
                     f"needs {e.blocked.peak_memory_gib:.3f} GiB")
    if e.bpipe is None:
        lines.append("verdict: BPipe does not pay here: no BPipe configuration fits")
    else:
        verdict = {Verdict.PAYS: "pays", Verdict.MARGINAL: "is marginal"}.get(e.verdict, "does not pay")
        lines.append(f"verdict: BPipe {verdict} here ({e.gain:+.1%} throughput; {_why(e)})")
    return "\n".join(lines)

