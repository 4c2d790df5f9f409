"""From a finished run to its :class:`~evenpipe.sim.trace.Trace`: transfers by arrival, memory timelines, units."""

from __future__ import annotations

import operator
from itertools import accumulate

from evenpipe.schedule.ir import Schedule
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.trace import MemoryTimeline, TransferRecord, Trace

__all__ = ["make_trace", "unit_bytes", "timeline", "by_end"]

_MEM_EPS = 1e-9
"""Relative tolerance for float round-off in the memory balance."""

by_end = operator.attrgetter("end")
"""Sort key of transfer records: their end."""
_by_time = operator.itemgetter(0)


def make_trace(sched: Schedule, costs: SimCosts, starts: list[list[float]], ends: list[list[float]],
               transfers: list[TransferRecord], mem: list[list[tuple[float, float]]], *, evaluator: str) -> Trace:
    """The trace of a finished run: per-action times, transfers (in creation order, sorted here by arrival) and
    each rank's memory changes (time, bytes delta) in the order they were decided; ``evaluator`` names who ran it."""
    transfers.sort(key=by_end)
    step = max([max(e, default=0.0) for e in ends] + [t.end for t in transfers], default=0.0)
    unit = unit_bytes(sched, costs)
    memory = tuple(timeline(r, mem[r], unit[r]) for r in range(sched.num_ranks))
    return Trace(schedule=sched, times=(starts, ends), transfers=tuple(transfers), memory=memory, unit_bytes=unit,
                 step_time=step, source="sim", evaluator=evaluator)


def unit_bytes(sched: Schedule, costs: SimCosts) -> tuple[float, ...]:
    """Per rank, the bytes of one activation unit (the activation bytes of the stages it holds)."""
    return tuple(sum(costs.stages[s].activation_bytes for s in sched.stages_of(r)) for r in range(sched.num_ranks))


def timeline(r: int, events: list[tuple[float, float]], unit: float) -> MemoryTimeline:
    """Rank ``r``'s memory timeline from its changes ``(time, bytes delta)`` in the order they were decided."""
    events.sort(key=_by_time)  # stable: same-time changes keep the causal order they were recorded in
    levels = list(accumulate(delta for _, delta in events))
    tol = _MEM_EPS * max(unit, 1.0) * (1 + len(events))
    lowest = min(levels, default=0.0)
    assert lowest >= -tol, f"rank {r} activation memory went negative ({lowest})"
    if lowest < 0:
        levels = [max(0.0, b) for b in levels]
    last_per_time = dict(zip((t for t, _ in events), levels))  # one point per time: the level after it
    return MemoryTimeline(rank=r, points=((0.0, 0.0),) + tuple(last_per_time.items()))
