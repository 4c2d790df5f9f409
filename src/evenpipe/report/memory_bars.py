"""``memory_per_stage.png``: each pipeline rank's peak memory as a stacked bar by component, with the GPU's
capacity drawn as a line. Takes the caller's Axes (``plot_memory_bars``) or a path (``save_memory_bars``)."""

from __future__ import annotations

import pathlib
from typing import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from evenpipe.cost.memory import StageMemory

__all__ = ["COMPONENTS", "plot_memory_bars", "save_memory_bars"]

COMPONENTS: tuple[tuple[str, str, str], ...] = (
    ("weights", "weights (bf16)", "#0072B2"),
    ("grads", "gradients (fp32)", "#56B4E9"),
    ("optimizer", "optimizer state", "#009E73"),
    ("embedding", "embedding", "#E69F00"),
    ("head", "head + logits", "#F0E442"),
    ("activations", "activations (own)", "#D55E00"),
    ("hosted", "activations (hosted, BPipe)", "#CC79A7"),
)
"""(StageMemory field, legend label, colour) from the bottom of each bar up; Okabe-Ito colours."""


def plot_memory_bars(stages: Sequence[StageMemory], ax: Axes, *, capacity_gib: float | None = None,
                     usable_gib: float | None = None, title: str | None = None) -> None:
    """Draw one stacked bar per rank on ``ax``; ``capacity_gib``/``usable_gib`` add horizontal lines."""
    ranks = [m.rank for m in stages]
    bottoms = [0.0] * len(stages)
    for field, label, color in COMPONENTS:
        values = [float(getattr(m, field)) for m in stages]
        if not any(v > 0 for v in values):
            continue
        ax.bar(ranks, values, bottom=bottoms, color=color, label=label, edgecolor="white", linewidth=0.4,
               width=0.8)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    top = max(bottoms, default=0.0)
    if capacity_gib is not None:
        ax.axhline(capacity_gib, color="black", linewidth=1.2, label=f"GPU memory {capacity_gib:g} GiB")
        top = max(top, capacity_gib)
    if usable_gib is not None and usable_gib != capacity_gib:
        ax.axhline(usable_gib, color="black", linestyle="--", linewidth=0.9, label=f"usable {usable_gib:g} GiB")
    if len(stages) <= 16:
        for r, total in zip(ranks, bottoms):
            ax.annotate(f"{total:.1f}", (r, total), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=7)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak memory (GiB)")
    if len(stages) <= 32:
        ax.set_xticks(ranks)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(axis="y", alpha=0.3)


def save_memory_bars(stages: Sequence[StageMemory], path: str | pathlib.Path, *,
                     capacity_gib: float | None = None, usable_gib: float | None = None,
                     title: str | None = None) -> pathlib.Path:
    """Write the stacked-bar picture to ``path`` (PNG, Agg backend, no pyplot state) and return the path."""
    width = min(16.0, 4.5 + 0.35 * len(stages))
    fig = Figure(figsize=(width, 4.2), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    plot_memory_bars(stages, ax, capacity_gib=capacity_gib, usable_gib=usable_gib, title=title)
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
