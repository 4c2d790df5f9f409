"""Measured trace records: what each rank's executor did and when, turned into the simulator's ``Trace`` type.

Times come from ``time.perf_counter`` (a system-wide monotonic clock on Linux, so ranks on one host share it) and
are shifted so that the earliest step start over all ranks is 0. Memory is the stash's own plus hosted bytes
after each action. Transfers are recorded on the sending side: ``start`` when posted, ``end`` when the executor
first saw it complete, an upper bound. Pipeline sends are polled between actions, but gloo may report a send-only
batch complete only once it is waited, so such a send can look as long as the rest of the step. BPipe's
``EVICT``/``RETURN`` are waited where the simulator frees their memory (an ``EVICT`` before the rank's next
``F``/``R`` or ``LOAD``, a ``RETURN`` before its next ``ACCEPT``, both at the latest at the step's end), so their
``end`` is at most that point.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from evenpipe.schedule.ir import Action, Schedule
from evenpipe.sim.trace import ActionRecord, MemoryTimeline, Trace, TransferRecord

__all__ = ["RankRecorder", "SendRecord", "measured_trace", "write_chrome_trace"]


@dataclass(slots=True, kw_only=True)
class SendRecord:
    """One message sent by this rank (mutable until its completion is seen)."""

    action: Action
    """The sending action (SEND_F, SEND_B, EVICT or RETURN)."""
    dst: int
    """Pipeline rank of the receiver."""
    num_bytes: int
    """Payload bytes."""
    start: float
    """When posted."""
    end: float = -1.0
    """When seen complete."""


@dataclass(slots=True)
class RankRecorder:
    """Per-rank raw records of one step; picklable, gathered on one rank to build a :class:`Trace`."""

    rank: int
    """Pipeline rank."""
    actions: list[tuple[int, Action, float, float]] = field(default_factory=list)
    """``(index, action, start, end)`` in execution order."""
    memory: list[tuple[float, int]] = field(default_factory=list)
    """``(time, own + hosted bytes)`` after each action."""
    sends: list[SendRecord] = field(default_factory=list)
    """Messages sent."""

    def action(self, index: int, action: Action, start: float, end: float, stash: Any) -> None:
        self.actions.append((index, action, start, end))
        self.memory.append((end, int(stash.own_bytes) + int(stash.hosted_bytes)))

    @property
    def t0(self) -> float:
        return min((a[2] for a in self.actions), default=0.0)


def measured_trace(schedule: Schedule, recorders: Sequence[RankRecorder],
                   unit_bytes: Sequence[float] | None = None) -> Trace:
    """Combine every pipeline rank's records of one step into a ``Trace`` with ``source='measured'``."""
    recs = sorted(recorders, key=lambda r: r.rank)
    t0 = min((r.t0 for r in recs if r.actions), default=0.0)
    actions = tuple(tuple(ActionRecord(rank=r.rank, index=i, action=a, start=s - t0, end=e - t0)
                          for i, a, s, e in sorted(r.actions, key=lambda x: x[0])) for r in recs)
    memory = tuple(MemoryTimeline(rank=r.rank, points=((0.0, 0.0),) + tuple((t - t0, float(b)) for t, b in r.memory))
                   for r in recs)
    transfers = sorted((TransferRecord(src=r.rank, dst=s.dst, kind=s.action.kind, stage=s.action.stage,
                                       microbatch=s.action.microbatch, num_bytes=float(s.num_bytes),
                                       start=s.start - t0, end=max(s.end, s.start) - t0)
                        for r in recs for s in r.sends), key=lambda t: t.end)
    ends = [a.end for acts in actions for a in acts] + [t.end for t in transfers]
    peaks = tuple(float(max((b for _, b in r.memory), default=0)) for r in recs)
    return Trace(schedule=schedule, actions=actions, transfers=tuple(transfers), memory=memory,
                 unit_bytes=tuple(unit_bytes) if unit_bytes is not None else peaks,
                 step_time=max(ends, default=0.0), source="measured")


def write_chrome_trace(trace: Trace, path: str | pathlib.Path) -> None:
    """Write ``trace`` as Chrome trace-event JSON (Perfetto), with the report layer's writer when present."""
    try:
        from evenpipe.report import chrome_trace  # engineer B's writer, same format as simulated traces
        writer = getattr(chrome_trace, "write_chrome_trace", None)
    except ImportError:
        writer = None
    if writer is not None:
        writer(trace, path)
        return
    events: list[dict[str, Any]] = []
    us = 1e6
    for acts in trace.actions:
        for rec in acts:
            events.append({"name": str(rec.action), "cat": rec.kind.name, "ph": "X", "pid": 0, "tid": rec.rank,
                           "ts": rec.start * us, "dur": max(rec.duration, 0.0) * us})
    for t in trace.transfers:
        events.append({"name": t.label, "cat": t.kind.name, "ph": "X", "pid": 1, "tid": t.src,
                       "ts": t.start * us, "dur": max(t.end - t.start, 0.0) * us, "args": {"bytes": t.num_bytes}})
    for mem in trace.memory:
        for time_s, num_bytes in mem.points:
            events.append({"name": f"activations rank {mem.rank}", "ph": "C", "pid": 0, "ts": time_s * us,
                           "args": {"bytes": num_bytes}})
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{trace.source}: compute"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"{trace.source}: transfers"}}]
    pathlib.Path(path).write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
