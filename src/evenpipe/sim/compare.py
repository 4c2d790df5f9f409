"""Predicted against measured: two :class:`~evenpipe.sim.trace.Trace` objects of the same schedule, compared
rank by rank (step time, busy and idle time, peak activation memory) and kind by kind: the mean duration of each
compute kind, and for each message kind the mean time its receiver waited for it (``exposed_s``). A message's
span (posted to arrived) is compared only between two traces that are not measured: a measured message ends when
its receiver saw it arrive, which on gloo (whose works complete only when waited) is when the receiver waited for
it, possibly long after it landed, so its measured span is no transfer time.

Pure; the ``compare`` command prints :func:`comparison_rows` and draws both timelines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from evenpipe.errors import ConfigError
from evenpipe.schedule.ir import ActionKind
from evenpipe.sim.trace import Trace

__all__ = ["Compared", "TraceComparison", "compare_traces"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Compared:
    """One figure, predicted and measured."""

    name: str
    """What is compared, e.g. ``rank 0 step time``."""
    unit: str
    """``s`` or ``B``."""
    predicted: float
    """Predicted value."""
    measured: float
    """Measured value."""

    @property
    def error(self) -> float | None:
        """``(predicted - measured) / measured``; None when nothing was measured."""
        return (self.predicted - self.measured) / self.measured if self.measured else None


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceComparison:
    """Every figure of :func:`compare_traces`."""

    step: Compared
    """Whole step (makespan)."""
    per_rank: tuple[tuple[Compared, ...], ...]
    """Per rank: step time (its last action's end), busy time, idle time, peak activation bytes."""
    per_kind: tuple[Compared, ...]
    """Per kind present in both traces: a compute's mean duration; a message's mean wait (and span, see the
    module)."""

    def all(self) -> tuple[Compared, ...]:
        return (self.step,) + tuple(c for rank in self.per_rank for c in rank) + self.per_kind


def _rank_end(trace: Trace, rank: int) -> float:
    return max((rec.end for rec in trace.actions[rank]), default=0.0)


def _mean_durations(trace: Trace) -> dict[str, float]:
    spans: dict[str, list[float]] = {}
    for rec in trace.compute_records():
        spans.setdefault(rec.kind.name, []).append(rec.duration)
    measured = trace.source == "measured"
    for t in trace.transfers:
        spans.setdefault(f"{t.kind.name} wait", []).append(t.exposed_s)
        if not measured:
            spans.setdefault(f"{t.kind.name} transfer", []).append(t.end - t.start)
    return {k: statistics.fmean(v) for k, v in spans.items()}


def compare_traces(predicted: Trace, measured: Trace) -> TraceComparison:
    """Compare two traces of the same schedule (ConfigError if their schedules differ in shape)."""
    a, b = predicted.schedule, measured.schedule
    if (a.num_ranks, a.num_microbatches, a.stage_to_rank) != (b.num_ranks, b.num_microbatches, b.stage_to_rank) \
            or [len(x) for x in a.actions] != [len(x) for x in b.actions]:
        raise ConfigError(f"the traces are of different schedules: {a.name} P={a.num_ranks} M={a.num_microbatches} "
                          f"vs {b.name} P={b.num_ranks} M={b.num_microbatches}")
    ranks = []
    for r in range(a.num_ranks):
        pe, me = _rank_end(predicted, r), _rank_end(measured, r)
        pb, mb = predicted.busy_time(r), measured.busy_time(r)
        ranks.append((Compared(name=f"rank {r} step time", unit="s", predicted=pe, measured=me),
                      Compared(name=f"rank {r} busy", unit="s", predicted=pb, measured=mb),
                      Compared(name=f"rank {r} idle", unit="s", predicted=predicted.step_time - pb,
                               measured=measured.step_time - mb),
                      Compared(name=f"rank {r} peak memory", unit="B", predicted=predicted.peak_activation_bytes[r],
                               measured=measured.peak_activation_bytes[r])))
    pm, mm = _mean_durations(predicted), _mean_durations(measured)
    order = [k.name for k in ActionKind]
    kinds = sorted(set(pm) & set(mm), key=lambda k: (" " in k, order.index(k.split()[0]), k.endswith("wait")))
    return TraceComparison(
        step=Compared(name="step time", unit="s", predicted=predicted.step_time, measured=measured.step_time),
        per_rank=tuple(ranks),
        per_kind=tuple(Compared(name=f"mean {k}", unit="s", predicted=pm[k], measured=mm[k]) for k in kinds))
