"""``efficiency_vs_microbatch.png``: achieved FLOP/s of one transformer block's forward against micro-batch size,
measured at the profiled sizes and from the fit in between (the view of Huang et al. 2024's BPipe re-evaluation:
a larger micro-batch pays only where this curve still rises)."""

from __future__ import annotations

import pathlib
from typing import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from evenpipe.cost.profile_fit import EfficiencyPoint

__all__ = ["plot_efficiency", "save_efficiency"]


def plot_efficiency(points: Sequence[EfficiencyPoint], ax: Axes, *, title: str = "") -> Axes:
    """Draw measured points and the fitted curve on ``ax``."""
    xs = [p.microbatch_size for p in points]
    ax.plot(xs, [p.predicted_flops_per_s / 1e9 for p in points], "-", color="#0072B2", label="fit")
    meas = [(p.microbatch_size, p.measured_flops_per_s / 1e9) for p in points if p.measured_flops_per_s]
    ax.plot([m[0] for m in meas], [m[1] for m in meas], "o", color="#D55E00", label="measured")
    ax.set_xlabel("micro-batch size (sequences)")
    ax.set_ylabel("achieved GFLOP/s (one block, forward)")
    ax.set_xticks(xs)
    top = max([p.predicted_flops_per_s / 1e9 for p in points] + [m[1] for m in meas], default=0.0)
    ax.set_ylim(0, 1.1 * top if top > 0 else None)  # room above the highest point
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def save_efficiency(points: Sequence[EfficiencyPoint], path: str | pathlib.Path, *, title: str = "") -> pathlib.Path:
    fig = Figure(figsize=(6.4, 4.0), dpi=110)
    plot_efficiency(points, fig.add_subplot(1, 1, 1), title=title)
    fig.tight_layout()
    out = pathlib.Path(path)
    fig.savefig(out)
    return out
