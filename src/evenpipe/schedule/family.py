"""The closed set of schedule families, parsed once at the edge."""

from __future__ import annotations

import enum

from evenpipe.errors import parse_choice

__all__ = ["ScheduleFamily"]


class ScheduleFamily(enum.Enum):
    """A named schedule preset. The value is its name on the command line."""

    GPIPE = "gpipe"
    """All forwards, then all backwards (Huang et al., 2019)."""
    ONE_F_ONE_B = "1f1b"
    """Megatron's non-interleaved one-forward-one-backward (Narayanan et al., 2021)."""
    INTERLEAVED = "interleaved"
    """Megatron's interleaved 1F1B with V virtual chunks per rank, stage ``s`` on rank ``s % P``."""
    LOOPED_BFS = "looped-bfs"
    """Breadth-first looping (Lamy-Poirier, 2023): each local chunk forwards every micro-batch before the next."""
    ZB_H1 = "zb-h1"
    """Zero-bubble H1 (Qi et al., 2024): backward split into I and W, W deferred into bubbles, 1F1B's memory."""
    BPIPE = "bpipe"
    """1F1B plus BPipe's evict/load transfers between ranks x and p-1-x (Kim et al., 2023)."""

    @classmethod
    def parse(cls, name: "str | ScheduleFamily") -> "ScheduleFamily":
        """The family called ``name`` (case-insensitive; ``_`` accepted for ``-``)."""
        return parse_choice(cls, name, "schedule", normalize=True)

    @property
    def has_chunks(self) -> bool:
        """Whether the family places several stages (chunks) on each rank."""
        return self in (ScheduleFamily.INTERLEAVED, ScheduleFamily.LOOPED_BFS)
