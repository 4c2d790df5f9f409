"""``memory.png``: each rank's activation memory (own plus hosted) over time as step lines, peaks marked."""

from __future__ import annotations

import pathlib

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from evenpipe.report.style import rank_color
from evenpipe.sim.trace import Trace

__all__ = ["plot_memory", "save_memory"]


def _scale(trace: Trace, rank: int, units: str) -> float:
    unit = trace.unit_bytes[rank]
    return 1.0 / unit if units == "activations" and unit > 0 else 1.0


def _draw_rank(trace: Trace, rank: int, ax: Axes, units: str, label: str) -> float:
    """Step line of one rank with its first peak marked; returns the peak in ``units``."""
    mem = trace.memory[rank]
    k = _scale(trace, rank, units)
    end = trace.step_time or 1.0
    xs = [t for t, _ in mem.points] + [end]
    ys = [b * k for _, b in mem.points]
    ys.append(ys[-1])
    color = rank_color(rank)
    peak = mem.peak_bytes * k
    ax.step(xs, ys, where="post", color=color, linewidth=1.4, label=label.format(rank=rank, peak=peak))
    ax.plot([mem.peak_time], [peak], marker="v", color=color, markersize=7, markeredgecolor="black",
            markeredgewidth=0.5, linestyle="none")
    return peak


def _unit_label(units: str) -> str:
    return "activation units" if units == "activations" else "activation bytes"


def _check_units(units: str) -> None:
    if units not in ("activations", "bytes"):
        raise ValueError(f"units must be 'activations' or 'bytes', got {units!r}")


def plot_memory(trace: Trace, ax: Axes, *, units: str = "activations", title: str | None = None,
                budget: float | None = None) -> Axes:
    """Overlay every rank's activation memory (own plus hosted) on ``ax``.

    ``units`` is ``activations`` (activation units of that rank) or ``bytes``; ``budget`` (same units) draws a
    dashed limit line, e.g. BPipe's ``ceil((P+1)/2)``.
    """
    _check_units(units)
    for rank in range(trace.num_ranks):
        _draw_rank(trace, rank, ax, units, "rank {rank}  (peak {peak:.3g})")
    if budget is not None:
        ax.axhline(budget, color="black", linestyle="--", linewidth=0.9, label=f"budget {budget:g}")
    _finish(ax, trace, units)
    s = trace.schedule
    ax.set_title(title if title is not None else
                 f"{s.name}: activation memory per rank (▼ = peak), P={s.num_ranks} M={s.num_microbatches}",
                 fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return ax


def _finish(ax: Axes, trace: Trace, units: str) -> None:
    ax.set_xlim(0, (trace.step_time or 1.0) * 1.005)
    ax.set_ylim(bottom=0)
    ax.grid(color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)


def save_memory(trace: Trace, path: str | pathlib.Path, *, units: str = "activations",
                title: str | None = None, budget: float | None = None, time_label: str = "time (s)") -> pathlib.Path:
    """Write ``memory.png``: one panel per rank (shared axes, so lines never hide each other); return its path."""
    _check_units(units)
    n = trace.num_ranks
    fig = Figure(figsize=(11, 1.0 + 1.25 * n), dpi=110, layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    top = max((m.peak_bytes * _scale(trace, m.rank, units) for m in trace.memory), default=1.0)
    for rank, ax in enumerate(axes):
        peak = _draw_rank(trace, rank, ax, units, "rank {rank}")
        if budget is not None:
            ax.axhline(budget, color="black", linestyle="--", linewidth=0.9)
        _finish(ax, trace, units)
        ax.set_ylim(0, max(top, budget or 0.0) * 1.3 or 1.0)  # headroom: the label sits above the peak
        ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center", labelpad=8)
        ax.text(0.995, 0.97, f"peak {peak:.3g}" + (f"  (budget {budget:g})" if budget is not None else ""),
                transform=ax.transAxes, ha="right", va="top", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0})
    axes[-1].set_xlabel(time_label)
    s = trace.schedule
    fig.suptitle(title if title is not None else
                 f"{s.name}: {_unit_label(units)} held per rank, own + hosted (▼ = peak, dashed = budget), "
                 f"P={s.num_ranks} M={s.num_microbatches}", fontsize=10, x=0.01, ha="left")
    path = pathlib.Path(path)
    fig.savefig(path)
    return path
