"""What a training job returns: per-rank measurements gathered on rank 0 and the named job summary."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from evenpipe.cost.categories import MEMORY_CATEGORIES, STATE_CATEGORIES

__all__ = ["RankReport", "TrainSummary", "summarise", "memory_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """What one rank measured over the whole run (gathered on rank 0)."""

    pp_rank: int
    """Pipeline rank."""
    dp_rank: int
    """Replica."""
    tp_rank: int = 0
    """Tensor-parallel coordinate."""
    peak_bytes_by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    """Peak bytes of each memory category (:data:`evenpipe.cost.categories.MEMORY_CATEGORIES`)."""
    allocator_peak_bytes: int | None = None
    """The CUDA caching allocator's peak allocated bytes (None off a GPU)."""
    peak_own_bytes: int
    """Peak own activation bytes over all steps."""
    peak_hosted_bytes: int
    """Peak hosted (BPipe partner) activation bytes over all steps."""
    peak_activation_bytes: int
    """Peak of own plus hosted bytes over all steps."""
    evicted_bytes_per_step: int
    """Bytes sent away by EVICT per step (from the last step)."""
    peak_rss_bytes: int
    """Peak resident set size of the process."""
    step_times_s: tuple[float, ...]
    """Wall-clock seconds of every step this run executed (pipeline step plus optimizer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSummary:
    """The job's result, the same on every rank. Per-rank lists are indexed by pipeline rank (max over
    replicas)."""

    losses: tuple[float, ...]
    """Training loss of every step this run executed, in order."""
    grad_norms: tuple[float, ...]
    """The whole model's gradient norm (before clipping) of every step this run executed."""
    eval_losses: tuple[tuple[int, float], ...]
    """``(steps done, held-out loss)`` of every evaluation this run made."""
    first_step: int
    """Steps already done when this run started (0 unless resumed)."""
    step_time_s: float
    """Median over steps of the slowest rank's step time."""
    tokens_per_s: float
    """Global tokens per step divided by ``step_time_s``; documents: the steps' real tokens (padding not counted)
    over their summed times (the slowest rank's)."""
    peak_activation_bytes: tuple[int, ...]
    """Peak own plus hosted activation bytes per pipeline rank."""
    peak_own_bytes: tuple[int, ...]
    """Peak own activation bytes per pipeline rank."""
    peak_hosted_bytes: tuple[int, ...]
    """Peak hosted activation bytes per pipeline rank."""
    evicted_bytes_per_step: tuple[int, ...]
    """EVICT bytes per step per pipeline rank."""
    peak_rss_bytes: tuple[int, ...]
    """Peak resident set size per pipeline rank."""
    peak_bytes_by_category: tuple[dict[str, int], ...] = ()
    """Per pipeline rank, the peak bytes of each memory category: what sharding divides over replicas
    (model states) as the mean over replicas (their total over dp), the rest as the max; the max over
    tensor-parallel coordinates."""
    allocator_peak_bytes: tuple[int | None, ...] = ()
    """Per pipeline rank, the CUDA allocator's peak allocated bytes (max over replicas; None off a GPU)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}


def summarise(reports: Sequence[RankReport], losses: Sequence[float], grad_norms: Sequence[float], *,
              eval_losses: Sequence[tuple[int, float]] = (), num_ranks: int, first_step: int,
              tokens_per_step: int, tokens_by_step: Sequence[int] | None = None) -> TrainSummary:
    """Fold every rank's report into the job summary (``tokens_by_step``: each step's tokens when they differ,
    documents)."""
    step_times = [max(r.step_times_s[i] for r in reports) for i in range(len(losses))]
    median = statistics.median(step_times) if step_times else float("nan")
    if tokens_by_step is None:
        tokens_per_s = tokens_per_step / median if step_times else float("nan")
    else:
        tokens_per_s = sum(tokens_by_step) / sum(step_times) if step_times else float("nan")

    def per_rank(name: str) -> tuple[int, ...]:
        return tuple(max(getattr(r, name) for r in reports if r.pp_rank == k) for k in range(num_ranks))
    return TrainSummary(losses=tuple(losses), grad_norms=tuple(grad_norms), eval_losses=tuple(eval_losses),
                        first_step=first_step, step_time_s=median,
                        tokens_per_s=tokens_per_s,
                        peak_activation_bytes=per_rank("peak_activation_bytes"),
                        peak_own_bytes=per_rank("peak_own_bytes"), peak_hosted_bytes=per_rank("peak_hosted_bytes"),
                        evicted_bytes_per_step=per_rank("evicted_bytes_per_step"),
                        peak_rss_bytes=per_rank("peak_rss_bytes"),
                        peak_bytes_by_category=tuple(_categories([r for r in reports if r.pp_rank == k])
                                                     for k in range(num_ranks)),
                        allocator_peak_bytes=tuple(_allocator([r for r in reports if r.pp_rank == k])
                                                   for k in range(num_ranks)))


def _categories(reports: Sequence[RankReport]) -> dict[str, int]:
    """One pipeline rank's categories over its replicas and tensor-parallel coordinates (see TrainSummary)."""
    out: dict[str, int] = {}
    for name in MEMORY_CATEGORIES:
        per_tp = {}
        for t in sorted({r.tp_rank for r in reports}):
            values = [r.peak_bytes_by_category.get(name, 0) for r in reports if r.tp_rank == t]
            per_tp[t] = round(sum(values) / len(values)) if name in STATE_CATEGORIES else max(values)
        out[name] = max(per_tp.values())
    return out


def _allocator(reports: Sequence[RankReport]) -> int | None:
    peaks = [r.allocator_peak_bytes for r in reports if r.allocator_peak_bytes is not None]
    return max(peaks) if peaks else None


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def memory_table(summary: TrainSummary, *, measured: bool) -> str:
    """The per-rank memory table printed at the end of a run."""
    lines = [f"per-rank memory (MiB; activation peaks {'from the stash' if measured else 'not measured'}, "
             "max over data-parallel replicas):",
             " rank   peak own  peak hosted  peak total  evicted/step   peak RSS"]
    for k in range(len(summary.peak_rss_bytes)):
        lines.append(f"{k:5d} {_mib(summary.peak_own_bytes[k])}    {_mib(summary.peak_hosted_bytes[k])}"
                     f"   {_mib(summary.peak_activation_bytes[k])}     {_mib(summary.evicted_bytes_per_step[k])}"
                     f"  {_mib(summary.peak_rss_bytes[k])}")
    return "\n".join(lines)
