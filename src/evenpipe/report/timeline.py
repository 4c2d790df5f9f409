"""``timeline.png``: ranks on y, time on x, one box per compute coloured by kind with its micro-batch number,
and a thin lane under each rank for the messages it sends (BPipe evict/load hatched)."""

from __future__ import annotations

import pathlib

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from evenpipe.report.style import KIND_COLOR, KIND_LABEL, TRANSFER_HATCH
from evenpipe.schedule.ir import ActionKind
from evenpipe.sim.trace import Trace

__all__ = ["plot_timeline", "save_timeline", "timeline_title"]

_COMPUTE_H = 0.62
"""Height of a compute box (one rank is one unit of y)."""
_XFER_H = 0.2
"""Height of the transfer lane under each rank's boxes."""
_MIN_XFER_FRAC = 0.003
"""Shortest drawn transfer, as a share of the step, so that free (instant) messages stay visible as ticks."""


def timeline_title(trace: Trace) -> str:
    s = trace.schedule
    chunks = f" V={s.num_chunks}" if s.num_chunks > 1 else ""
    return (f"{s.name}: P={s.num_ranks} M={s.num_microbatches}{chunks}   step {trace.step_time:.4g}   "
            f"bubble {trace.bubble_fraction:.1%}")


def plot_timeline(trace: Trace, ax: Axes, *, title: str | None = None, show_transfers: bool = True,
                  time_label: str = "time (s)") -> Axes:
    """Draw the timeline of ``trace`` on ``ax`` (rank 0 at the top) and return ``ax``; ``time_label`` names the
    x axis (unit costs are not seconds)."""
    step = trace.step_time or 1.0
    width_px = ax.get_figure().get_figwidth() * ax.get_figure().dpi * ax.get_position().width  # type: ignore[union-attr]
    boxes: dict[tuple[int, ActionKind], list[tuple[float, float]]] = {}
    for rec in trace.compute_records():
        kind, y = rec.action.kind, rec.rank
        boxes.setdefault((y, kind), []).append((rec.start, rec.duration))
        label = str(rec.action.microbatch)
        if rec.duration / step * width_px >= 7 * len(label) + 4:
            dark = kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE)
            ax.text(rec.start + rec.duration / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    for (y, kind), spans in boxes.items():  # one collection per rank and kind keeps big traces fast
        ax.broken_barh(spans, (y - _COMPUTE_H / 2, _COMPUTE_H), facecolors=KIND_COLOR[kind], edgecolors="white",
                       linewidth=0.6 if len(spans) * 40 < width_px else 0)
    used = {kind for _, kind in boxes}
    if show_transfers:
        bars: dict[tuple[int, ActionKind, bool], list[tuple[float, float]]] = {}
        for t in trace.transfers:
            dur = max(t.end - t.start, _MIN_XFER_FRAC * step)
            bars.setdefault((t.src, t.kind, t.exposed_s > 0), []).append((t.start, dur))
        for (src, kind, exposed), spans in bars.items():
            used.add(kind)
            lane_y = src + _COMPUTE_H / 2 + _XFER_H / 2 + 0.02
            ax.broken_barh(spans, (lane_y - _XFER_H / 2, _XFER_H), facecolors=KIND_COLOR[kind],
                           hatch=TRANSFER_HATCH.get(kind),  # hatch lines take the edge colour
                           edgecolors="black" if exposed else ("#444444" if kind in TRANSFER_HATCH else "none"),
                           linewidth=0.8 if exposed else 0)
    n = trace.num_ranks
    ax.set_ylim(n - 0.5 + _XFER_H + 0.1, -0.6)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xlim(0, step * 1.005)
    ax.set_xlabel(time_label)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(title if title is not None else timeline_title(trace), fontsize=10, loc="left")
    order = [k for k in KIND_COLOR if k in used]
    handles = [Patch(facecolor=KIND_COLOR[k], hatch=TRANSFER_HATCH.get(k), label=KIND_LABEL[k],
                     edgecolor="#555555" if k in TRANSFER_HATCH else "none") for k in order]
    if any(t.exposed_s > 0 for t in trace.transfers):
        handles.append(Patch(facecolor="white", edgecolor="black", label="exposed transfer"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
              title="thin bars: sends", title_fontsize=8)
    return ax


def save_timeline(trace: Trace, path: str | pathlib.Path, *, title: str | None = None,
                  time_label: str = "time (s)") -> pathlib.Path:
    """Write ``timeline.png`` (size grows with ranks and actions) and return its path."""
    n = trace.num_ranks
    computes_per_rank = max((sum(1 for r in trace.records(x) if r.action.kind.is_compute) for x in range(n)),
                            default=1)
    width = min(24.0, max(10.0, computes_per_rank * 0.22 + 3))
    fig = Figure(figsize=(width, 1.3 + 0.55 * n), dpi=110, layout="constrained")
    plot_timeline(trace, fig.add_subplot(), title=title, time_label=time_label)
    path = pathlib.Path(path)
    fig.savefig(path)
    return path
