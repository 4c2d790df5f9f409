"""``compare.png``: the predicted and the measured timeline of one schedule, one above the other on one time axis,
and the comparison table's text."""

from __future__ import annotations

import pathlib

from matplotlib.figure import Figure

from evenpipe.report.timeline import plot_timeline
from evenpipe.sim.compare import Compared, TraceComparison
from evenpipe.sim.trace import Trace

__all__ = ["save_comparison", "comparison_text"]


def save_comparison(predicted: Trace, measured: Trace, path: str | pathlib.Path, *,
                    labels: tuple[str, str] = ("predicted", "measured")) -> pathlib.Path:
    """Both timelines on a shared x axis (the longer step sets it) and return the path."""
    n = predicted.num_ranks
    computes = max(sum(1 for r in acts if r.action.kind.is_compute) for acts in predicted.actions)
    width = min(24.0, max(10.0, computes * 0.22 + 3))
    fig = Figure(figsize=(width, 2.2 + 1.1 * n), dpi=110, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    for ax, trace, label in ((top, predicted, labels[0]), (bottom, measured, labels[1])):
        plot_timeline(trace, ax, title=f"{label}: {trace.schedule.name} P={trace.schedule.num_ranks} "
                                       f"M={trace.schedule.num_microbatches}   step {trace.step_time * 1e3:.1f} ms   "
                                       f"bubble {trace.bubble_fraction:.1%}")
    top.set_xlabel("")
    longest = max(predicted.step_time, measured.step_time) * 1.005
    bottom.set_xlim(0, longest)
    out = pathlib.Path(path)
    fig.savefig(out)
    return out


def _value(c: Compared, v: float) -> str:
    if c.unit != "s":
        return f"{v / 2**20:10.2f} MiB"
    return f"{v * 1e3:10.2f} ms" if abs(v) >= 1e-3 or v == 0 else f"{v * 1e6:10.1f} us"


def comparison_text(cmp: TraceComparison, labels: tuple[str, str] = ("predicted", "measured")) -> str:
    """One row per figure: predicted, measured, error."""
    rows = [f"{'':28s} {labels[0]:>13s} {labels[1]:>13s} {'error':>8s}"]
    rows.append("-" * len(rows[0]))
    for c in cmp.all():
        err = f"{c.error:+8.1%}" if c.error is not None else f"{'-':>8s}"
        rows.append(f"{c.name:28s} {_value(c, c.predicted)} {_value(c, c.measured)} {err}")
    return "\n".join(rows)
