"""Which memory lever pays? The fastest fitting plan with each lever alone, with none, and with all of them.

A *memory lever* trades time for activation memory so that something faster fits: BPipe (the first ranks evict
activations to their partners), host offload (the first ranks copy every micro-batch's saved activations to host
memory over PCIe and back before its backward), recomputation (selective: the attention core; full: whole
stages) and the controllable-memory V schedules (zb-v, v-half, v-min). Without any lever the planner may still
choose 1F1B, interleaved or ZB-H1 and every tp, pp, dp, micro-batch size and layout.

Each single lever's search is the no-lever space plus that lever (the plan may leave it unused, and then says
so), so its plan is never slower than the no-lever plan; "all" lets the planner combine every lever.
Each lever is one search of the one planner (:class:`~evenpipe.plan.search.Searcher`, whose estimate cache the
searches share) over a restricted :class:`SearchSpace`. The lever space is pruned so it stays fast:

- offload is tried on the first ``ceil(f·p)`` ranks for f in {1/4, 1/2, 1} (the first ranks hold the most
  micro-batches in flight, so offloading a prefix is what pays first), never combined with BPipe (both move the
  same activations);
- recomputation is uniform over the stages (selective or full); a lever's search keeps its branch and bound,
  so configurations whose step-time bound cannot beat the lever's best so far are never simulated;
- each lever's search starts from the no-lever plan as its incumbent, and "all" from the fastest single lever's
  (every lever space holds the no-lever space, and the union holds them all), so the bound skips from the start
  whatever cannot beat it;
- "all" is one more search over the union, and the 1F1B-versus-BPipe comparison of the BPipe re-evaluation is
  :func:`~evenpipe.plan.explain.explain_bpipe` over a space of those two schedules.

The answer names the lever whose plan is fastest, if it beats the plan with no lever by more than the margin,
what that plan unlocks relative to the no-lever plan (a larger micro-batch, less tensor or pipeline parallelism,
less recomputation) and which step-time components grew (what eats the gain).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from evenpipe.cost import Recompute
from evenpipe.cost.parallel import split_bpipe
from evenpipe.errors import ConfigError
from evenpipe.plan.explain import TIME_COMPONENTS, BPipeExplanation, explain_bpipe
from evenpipe.plan.search import Candidate, Searcher, SearchSpace
from evenpipe.schedule import ScheduleFamily

__all__ = ["MemoryLever", "LeverResult", "MemoryAnswer", "explain_memory", "V_SCHEDULES", "OFFLOAD_FRACTIONS"]

V_SCHEDULES: tuple[ScheduleFamily, ...] = (ScheduleFamily.ZB_V, ScheduleFamily.V_HALF, ScheduleFamily.V_MIN)
"""The controllable-memory V schedules (Qi et al. 2024b)."""

OFFLOAD_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 1.0)
"""Shares of the pipeline ranks, first ranks first, that host offload is tried on."""


class MemoryLever(enum.Enum):
    """One way to trade time for activation memory (``NONE``: no lever; ``ALL``: every lever at once)."""

    NONE = "none"
    BPIPE = "bpipe"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    V_SCHEDULES = "v-schedules"
    ALL = "all"


_SINGLE = (MemoryLever.BPIPE, MemoryLever.OFFLOAD, MemoryLever.RECOMPUTE, MemoryLever.V_SCHEDULES)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeverResult:
    """The fastest fitting plan with one lever (None: nothing fits with it)."""

    lever: MemoryLever
    best: Candidate | None
    ranks: tuple[int, ...] = ()
    """Pipeline ranks the lever acts on in that plan (evictors for BPipe, offloading ranks, recomputing ranks;
    empty when the plan does not use it)."""

    @property
    def used(self) -> bool:
        """Whether the plan pulls a lever at all."""
        return bool(self.ranks)

    def to_dict(self) -> dict[str, object]:
        return {"lever": self.lever.value, "ranks": list(self.ranks), "used": self.used,
                "best": None if self.best is None else self.best.to_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryAnswer:
    """Which memory lever pays, with the plans behind the answer."""

    results: tuple[LeverResult, ...]
    """One per :class:`MemoryLever`, in its order."""
    lever: MemoryLever
    """The lever that pays (``NONE`` when no lever beats the plan without one by more than the margin)."""
    gain: float
    """Throughput of the paying lever's plan over the no-lever plan, minus 1 (0 for ``NONE``; inf when nothing
    fits without a lever)."""
    margin: float
    unlocks: tuple[str, ...]
    """What the paying plan changes against the no-lever plan, in words (e.g. ``micro-batch 1 -> 2``)."""
    eaten_by: tuple[tuple[str, float], ...]
    """Step-time components that grew, in seconds (what eats the gain), largest first."""
    bpipe_vs_1f1b: BPipeExplanation | None
    """The BPipe re-evaluation's comparison: 1F1B against BPipe only (None when no 1F1B plan fits)."""
    text: str = ""

    def result(self, lever: MemoryLever) -> LeverResult:
        return next(r for r in self.results if r.lever is lever)

    def to_dict(self) -> dict[str, object]:
        paper = self.bpipe_vs_1f1b
        return {"lever": self.lever.value, "gain": self.gain, "margin": self.margin, "unlocks": list(self.unlocks),
                "eaten_by_s": dict(self.eaten_by), "levers": {r.lever.value: r.to_dict() for r in self.results},
                "bpipe_vs_1f1b": None if paper is None else {
                    "verdict": paper.verdict.value, "gain": paper.gain, "baseline": paper.baseline.to_dict(),
                    "bpipe": None if paper.bpipe is None else paper.bpipe.to_dict()},
                "text": self.text}


def _plain(space: SearchSpace) -> tuple[ScheduleFamily, ...]:
    """The space's schedules that are neither BPipe nor V (1F1B when none is left)."""
    out = tuple(f for f in space.schedules if not split_bpipe(f)[1] and f not in V_SCHEDULES)
    return out or (ScheduleFamily.ONE_F_ONE_B,)


def lever_space(space: SearchSpace, lever: MemoryLever) -> SearchSpace:
    """``space`` restricted to ``lever`` (see the module docstring)."""
    plain, none = _plain(space), (Recompute.NONE,)
    bpipe_with = tuple(f for f in space.bpipe_families) or tuple(
        f for f in plain if f is ScheduleFamily.INTERLEAVED)
    every_recompute = tuple(dict.fromkeys((*none, *space.recomputes)))
    spaces = {
        MemoryLever.NONE: dict(schedules=plain, bpipe_schedules=(), recomputes=none),
        MemoryLever.BPIPE: dict(schedules=plain + (ScheduleFamily.BPIPE,), bpipe_schedules=bpipe_with,
                                recomputes=none),
        MemoryLever.OFFLOAD: dict(schedules=plain, bpipe_schedules=(), recomputes=none,
                                  offload_fractions=(0.0, *OFFLOAD_FRACTIONS)),
        MemoryLever.RECOMPUTE: dict(schedules=plain, bpipe_schedules=(), recomputes=every_recompute),
        MemoryLever.V_SCHEDULES: dict(schedules=plain + V_SCHEDULES, bpipe_schedules=(), recomputes=none),
        MemoryLever.ALL: dict(schedules=plain + (ScheduleFamily.BPIPE,) + V_SCHEDULES, bpipe_schedules=bpipe_with,
                              recomputes=every_recompute, offload_fractions=(0.0, *OFFLOAD_FRACTIONS)),
    }
    return dataclasses.replace(space, **spaces[lever])  # type: ignore[arg-type]


def _ranks(lever: MemoryLever, c: Candidate | None) -> tuple[int, ...]:
    if c is None:
        return ()
    cfg = c.config
    if cfg.uses_bpipe:  # the evictors: ranks x < p/2 (their partners p-1-x host what they evict)
        return tuple(range(cfg.pp // 2))
    if cfg.offload_ranks:
        return tuple(range(cfg.offload_ranks))
    if cfg.recompute is not Recompute.NONE:
        return tuple(range(cfg.pp))
    if lever in (MemoryLever.V_SCHEDULES, MemoryLever.ALL) and cfg.schedule in V_SCHEDULES:
        return tuple(range(cfg.pp))
    return ()


def _search(searcher: Searcher, space: SearchSpace, lever: MemoryLever, num_gpus: int,
            global_batch: int, incumbent: Candidate | None = None) -> LeverResult:
    try:
        best: Candidate | None = searcher.search(num_gpus=num_gpus, global_batch=global_batch, top_k=1,
                                                 space=lever_space(space, lever), incumbent=incumbent).best
    except ConfigError:
        best = None
    return LeverResult(lever=lever, best=best, ranks=_ranks(lever, best))


_RECOMPUTE_RANK = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}


def _unlocks(base: Candidate, win: Candidate) -> tuple[str, ...]:
    b, w = base.config, win.config
    out = []
    if w.microbatch_size > b.microbatch_size:
        out.append(f"a larger micro-batch ({b.microbatch_size} -> {w.microbatch_size})")
    if w.tp < b.tp:
        out.append(f"less tensor parallelism (tp {b.tp} -> {w.tp})")
    if w.pp < b.pp:
        out.append(f"fewer pipeline stages (pp {b.pp} -> {w.pp})")
    if _RECOMPUTE_RANK[w.recompute] < _RECOMPUTE_RANK[b.recompute]:
        out.append(f"less recomputation ({b.recompute.value} -> {w.recompute.value})")
    if w.chunks > b.chunks and w.schedule is b.schedule:
        out.append(f"more interleaving (v {b.chunks} -> {w.chunks})")
    return tuple(out)


def _eaten(base: Candidate, win: Candidate) -> tuple[tuple[str, float], ...]:
    floor = 1e-3 * base.step_time_s
    grown = [(n, float(getattr(win.estimate.breakdown, n)) - float(getattr(base.estimate.breakdown, n)))
             for n in TIME_COMPONENTS]
    return tuple(sorted(((n, d) for n, d in grown if d > floor), key=lambda x: -x[1]))


def explain_memory(searcher: Searcher, *, num_gpus: int, global_batch: int, space: SearchSpace | None = None,
                   margin: float = 0.02) -> MemoryAnswer:
    """Search the fastest fitting plan with no lever, with each lever alone and with all (see the module
    docstring), name the lever that pays and compare 1F1B with BPipe alone as the BPipe re-evaluation did."""
    if margin < 0:
        raise ConfigError(f"margin must be >= 0, got {margin}")
    space = space or SearchSpace()
    none = _search(searcher, space, MemoryLever.NONE, num_gpus, global_batch)
    singles = [_search(searcher, space, lv, num_gpus, global_batch, none.best) for lv in _SINGLE]
    fastest = min((r.best for r in singles if r.best is not None), key=lambda c: c.step_time_s, default=None)
    results = (none, *singles, _search(searcher, space, MemoryLever.ALL, num_gpus, global_batch, fastest))
    by = {r.lever: r for r in results}
    base = by[MemoryLever.NONE].best
    fitting = [by[lv] for lv in _SINGLE if by[lv].best is not None and by[lv].used]
    if not fitting and base is None:
        raise ConfigError(f"no plan of {searcher.model.name} fits on {num_gpus} devices with any memory lever")
    best = min(fitting, key=lambda r: r.best.step_time_s) if fitting else None  # type: ignore[union-attr]
    lever, gain = MemoryLever.NONE, 0.0
    unlocks: tuple[str, ...] = ()
    eaten: tuple[tuple[str, float], ...] = ()
    if best is not None and best.best is not None:
        g = float("inf") if base is None else base.step_time_s / best.best.step_time_s - 1.0
        if g > margin:
            lever, gain = best.lever, g
            if base is not None:
                unlocks, eaten = _unlocks(base, best.best), _eaten(base, best.best)
    paper_space = dataclasses.replace(space, schedules=(ScheduleFamily.ONE_F_ONE_B, ScheduleFamily.BPIPE),
                                      bpipe_schedules=(), offload_fractions=(0.0,))
    try:
        paper: BPipeExplanation | None = explain_bpipe(searcher, num_gpus=num_gpus, global_batch=global_batch,
                                                       space=paper_space, margin=margin)
    except ConfigError:
        paper = None
    answer = MemoryAnswer(results=results, lever=lever, gain=gain, margin=margin, unlocks=unlocks,
                          eaten_by=eaten, bpipe_vs_1f1b=paper)
    return dataclasses.replace(answer, text=memory_text(answer, where=f"{searcher.model.name} on {num_gpus} x "
                                                                       f"{searcher.source.name}"))


def _short(c: Candidate) -> str:
    cfg = c.config
    chunks = f" v={cfg.chunks}" if cfg.chunks > 1 else ""
    offload = f" offload=ranks 0-{cfg.offload_ranks - 1}" if cfg.offload_ranks else ""
    return (f"{cfg.schedule_name}{chunks} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} b={cfg.microbatch_size} "
            f"m={cfg.num_microbatches} recompute={cfg.recompute.value}{offload}: step {c.step_time_s:.3f} s, "
            f"peak {c.peak_memory_gib:.1f} GiB, bubble {100 * c.estimate.bubble_fraction:.1f}%")


def _ranks_text(ranks: tuple[int, ...], pp: int) -> str:
    if not ranks:
        return "no rank"
    if len(ranks) == pp:
        return f"every rank (0-{pp - 1})"
    return f"ranks {ranks[0]}-{ranks[-1]} of {pp}" if len(ranks) > 1 else f"rank {ranks[0]} of {pp}"


def _paper_lines(a: MemoryAnswer) -> list[str]:
    e = a.bpipe_vs_1f1b
    if e is None:
        return ["  1F1B vs BPipe only (the BPipe re-evaluation's comparison): no 1F1B plan fits"]
    if e.bpipe is None:
        return ["  1F1B vs BPipe only (the BPipe re-evaluation's comparison): no BPipe plan fits"]
    lines = [f"  1F1B vs BPipe only (the BPipe re-evaluation's comparison): BPipe {e.verdict.value} "
             f"({100 * e.gain:+.1f}%, step {e.baseline.step_time_s:.3f} s -> {e.bpipe.step_time_s:.3f} s)"]
    every = a.result(MemoryLever.ALL).best
    if every is not None:
        ref = min(e.baseline.step_time_s, e.bpipe.step_time_s)
        lines.append(f"  with every lever and schedule allowed the best plan is {100 * (ref / every.step_time_s - 1):+.1f}% "
                     f"against the better of those two: {_short(every)}")
    return lines


def _saved(a: MemoryAnswer) -> list[tuple[str, float]]:
    """Step-time components the paying plan shrinks (negative seconds), largest saving first."""
    base, win = a.result(MemoryLever.NONE).best, a.result(a.lever).best
    assert base is not None and win is not None
    floor = 1e-3 * base.step_time_s
    deltas = [(n, float(getattr(win.estimate.breakdown, n)) - float(getattr(base.estimate.breakdown, n)))
              for n in TIME_COMPONENTS]
    return sorted(((n, d) for n, d in deltas if d < -floor), key=lambda x: x[1])


def _same_shape(a: MemoryAnswer) -> str:
    """Why a lever that unlocks nothing memory buys still wins: its schedule's bubble."""
    base, win = a.result(MemoryLever.NONE).best, a.result(a.lever).best
    assert base is not None and win is not None
    return (f"nothing memory buys (micro-batch, tp, pp and recomputation as without a lever): it pays by its "
            f"schedule, bubble {100 * base.estimate.bubble_fraction:.1f}% -> {100 * win.estimate.bubble_fraction:.1f}%")


def memory_text(a: MemoryAnswer, *, where: str) -> str:
    """The answer in words, with the numbers of every plan compared."""
    if a.lever is MemoryLever.NONE:
        head = f"none: no lever beats the plan without one by more than {100 * a.margin:.0f}%"
    else:
        win = a.result(a.lever)
        assert win.best is not None
        gain = "nothing fits without a lever" if a.gain == float("inf") else f"{100 * a.gain:+.1f}% throughput"
        head = f"{a.lever.value} ({gain}, on {_ranks_text(win.ranks, win.best.config.pp)})"
    lines = [f"Which memory lever pays for {where}? {head}."]
    for r in a.results:
        label = "no lever" if r.lever is MemoryLever.NONE else "all levers" if r.lever is MemoryLever.ALL \
            else r.lever.value
        unused = " (lever unused)" if r.best is not None and not r.used and r.lever is not MemoryLever.NONE else ""
        lines.append(f"  {label + ':':13s} " + ("nothing fits" if r.best is None else _short(r.best)) + unused)
    if a.lever is not MemoryLever.NONE and a.result(MemoryLever.NONE).best is not None:
        lines.append(f"  unlocks: {'; '.join(a.unlocks) or _same_shape(a)}")
        lines.append("  saved:   " + (", ".join(f"{n.replace('_', ' ')} {d:.3f} s" for n, d in _saved(a))
                                      or "nothing"))
        lines.append("  eaten:   " + (", ".join(f"{n.replace('_', ' ')} +{d:.3f} s" for n, d in a.eaten_by)
                                      or "nothing"))
    lines += _paper_lines(a)
    return "\n".join(lines)
