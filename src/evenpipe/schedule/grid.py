"""Rank-by-step grids for error messages: one row per rank, one column per list position, marked actions."""

from __future__ import annotations

from typing import Mapping

from evenpipe.schedule.ir import Schedule

__all__ = ["format_grid"]

_FULL_WIDTH = 24
"""Schedules whose longest rank list is at most this many actions are printed whole."""
_HALF_WINDOW = 6
"""Otherwise each rank shows this many positions either side of its marked (or last reached) position."""


def format_grid(schedule: Schedule, marks: Mapping[int, int], *, reached: Mapping[int, int] | None = None) -> str:
    """The schedule as a grid; ``marks[rank]`` is a list position printed as ``>token<``.

    ``reached[rank]`` (optional) centres the window of a rank without a mark, e.g. a rank that finished;
    other unmarked ranks are centred on the first marked position.
    Short schedules are printed whole with aligned columns; long ones as a window around each rank's mark,
    prefixed with the position of its first shown column.
    """
    reached = reached or {}
    longest = max((len(a) for a in schedule.actions), default=0)
    default_centre = min(marks.values(), default=0)
    rows: list[list[str]] = []
    starts: list[int] = []
    for r, acts in enumerate(schedule.actions):
        if longest <= _FULL_WIDTH:
            lo, hi = 0, len(acts)
        else:
            centre = marks.get(r, reached.get(r, default_centre))
            lo, hi = max(0, centre - _HALF_WINDOW), min(len(acts), centre + _HALF_WINDOW + 1)
        cells = [f">{acts[i]}<" if marks.get(r) == i else f" {acts[i]} " for i in range(lo, hi)]
        if marks.get(r) == len(acts):
            cells.append(">end<")
        rows.append(cells)
        starts.append(lo)
    width = max((len(c) for row in rows for c in row), default=1)
    lines = []
    for r, cells in enumerate(rows):
        prefix = f"rank {r:>2} |" if longest <= _FULL_WIDTH else f"rank {r:>2} @{starts[r]:>5} |"
        ellipsis = " ..." if longest > _FULL_WIDTH and starts[r] + len(cells) < len(schedule.actions[r]) else ""
        lines.append(prefix + "".join(c.ljust(width) for c in cells).rstrip() + ellipsis)
    return "\n".join(lines)
