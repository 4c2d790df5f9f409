"""What a training job returns: per-rank measurements gathered on rank 0 and the named job summary."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["RankReport", "TrainSummary", "summarise", "memory_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """What one rank measured over the whole run (gathered on rank 0)."""

    pp_rank: int
    """Pipeline rank."""
    dp_rank: int
    """Replica."""
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
    """Global tokens per step divided by ``step_time_s``."""
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

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}


def summarise(reports: Sequence[RankReport], losses: Sequence[float], grad_norms: Sequence[float], *,
              eval_losses: Sequence[tuple[int, float]] = (), num_ranks: int, first_step: int,
              tokens_per_step: int) -> TrainSummary:
    """Fold every rank's report into the job summary."""
    step_times = [max(r.step_times_s[i] for r in reports) for i in range(len(losses))]
    median = statistics.median(step_times) if step_times else float("nan")

    def per_rank(name: str) -> tuple[int, ...]:
        return tuple(max(getattr(r, name) for r in reports if r.pp_rank == k) for k in range(num_ranks))
    return TrainSummary(losses=tuple(losses), grad_norms=tuple(grad_norms), eval_losses=tuple(eval_losses),
                        first_step=first_step, step_time_s=median,
                        tokens_per_s=tokens_per_step / median if step_times else float("nan"),
                        peak_activation_bytes=per_rank("peak_activation_bytes"),
                        peak_own_bytes=per_rank("peak_own_bytes"), peak_hosted_bytes=per_rank("peak_hosted_bytes"),
                        evicted_bytes_per_step=per_rank("evicted_bytes_per_step"),
                        peak_rss_bytes=per_rank("peak_rss_bytes"))


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
