"""Measured trace records: what each rank's executor did and when, turned into the simulator's ``Trace`` type.

Times come from ``time.perf_counter`` (a system-wide monotonic clock on Linux, so ranks on one host share it) and
are shifted so that the earliest step start over all ranks is 0. Memory is the stash's own plus hosted bytes
after each action.

Transfers are recorded on both sides. The sender notes when it posted a message and when it first saw the send
complete; the receiver notes when it posted the receive, when a compute (or BPipe) first waited for it and when
it first saw it complete (receives are polled after every compute, so that is within one compute of the arrival;
gloo may report a send-only batch complete only once it is waited, so the sender's stamp is looser). A message's
:class:`TransferRecord` starts when both sides had posted it and ends when the receiver saw it arrive; its
``exposed_s`` is how long the receiving rank blocked waiting for it. A transfer action's ``ActionRecord`` keeps the
simulator's meaning: ``start`` when posted, ``end`` when its message was delivered. A compute that waits inside
for a message (a forward for its input, a backward for its output gradient or a BPipe load) starts, in the trace,
when that message arrived: the wait before it is idle time, as in the simulator.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.validate import message_key
from evenpipe.sim.trace import ActionRecord, MemoryTimeline, Trace, TransferRecord

if TYPE_CHECKING:
    import torch

    from evenpipe.runtime.comm import PendingBatch
    from evenpipe.runtime.step_context import Stash

__all__ = ["RankRecorder", "SendRecord", "RecvRecord", "measured_trace", "write_chrome_trace", "save_trace",
           "load_trace"]

_WAITED_INSIDE = {ActionKind.FORWARD: (ActionKind.RECV_F,), ActionKind.BACKWARD: (ActionKind.RECV_B, ActionKind.LOAD),
                  ActionKind.BACKWARD_INPUT: (ActionKind.RECV_B, ActionKind.LOAD),
                  ActionKind.RECOMPUTE: (ActionKind.LOAD,)}
"""Compute kind -> receives of the same stage and micro-batch the executor waits for inside the compute."""
_MessageKey = tuple[int, int, int]
"""A message as :func:`~evenpipe.schedule.validate.message_key` names it (the same on both sides)."""


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


@dataclass(slots=True, kw_only=True)
class RecvRecord:
    """One message received by this rank (mutable until its arrival is seen)."""

    action: Action
    """The receiving action (RECV_F, RECV_B, ACCEPT or LOAD)."""
    num_bytes: int
    """Payload bytes."""
    posted: float
    """When the receive was posted."""
    wait_start: float = -1.0
    """When the rank first blocked on it (``arrived`` if it had arrived by then)."""
    arrived: float = -1.0
    """When first seen complete."""

    def stamp(self, wait_start: float, done_at: float) -> None:
        if done_at >= self.arrived:  # of several parts, the last to complete
            self.wait_start, self.arrived = wait_start, done_at


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
    recvs: list[RecvRecord] = field(default_factory=list)
    """Messages received."""

    def received(self, action: Action, buffer: torch.Tensor, posted: float, batch: PendingBatch) -> None:
        """Note the receive into ``buffer`` of ``action``, posted in ``batch``, stamped when that receive is first
        seen complete: the parts of one action (BPipe's header and buffer) add up in one record, stamped by the
        part that completes last."""
        num_bytes = buffer.numel() * buffer.element_size()
        if self.recvs and self.recvs[-1].action is action and self.recvs[-1].posted == posted:
            rec = self.recvs[-1]
            rec.num_bytes += num_bytes
        else:
            rec = RecvRecord(action=action, num_bytes=num_bytes, posted=posted)
            self.recvs.append(rec)
        batch.observe(rec.stamp, buffer)

    def action(self, index: int, action: Action, start: float, end: float, stash: Stash) -> None:
        self.actions.append((index, action, start, end))
        self.memory.append((end, int(stash.own_bytes) + int(stash.hosted_bytes)))

    @property
    def t0(self) -> float:
        return min((a[2] for a in self.actions), default=0.0)


def _transfers(recs: Sequence[RankRecorder], t0: float) -> list[tuple[_MessageKey, TransferRecord]]:
    """Every message sent, matched with its receive by message key, as (key, record)."""
    recv_of = {(r.rank, message_key(r.rank, rv.action)): rv for r in recs for rv in r.recvs}
    out = []
    for r in recs:
        for s in r.sends:
            key = message_key(r.rank, s.action)
            rv = recv_of.get((s.dst, key))
            if rv is not None and rv.arrived >= 0:
                start, end = max(s.start, rv.posted), max(rv.arrived, s.start, rv.posted)
                exposed = max(0.0, rv.arrived - rv.wait_start)
            else:  # the receiver never saw it (not traced): the sender's stamp is the bound
                start, end, exposed = s.start, max(s.end, s.start), 0.0
            out.append((key, TransferRecord(src=r.rank, dst=s.dst, kind=s.action.kind, stage=s.action.stage,
                                            microbatch=s.action.microbatch, num_bytes=float(s.num_bytes),
                                            start=start - t0, end=end - t0, exposed_s=exposed)))
    return out


def measured_trace(schedule: Schedule, recorders: Sequence[RankRecorder],
                   unit_bytes: Sequence[float] | None = None) -> Trace:
    """Combine every pipeline rank's records of one step into a ``Trace`` with ``source='measured'``."""
    recs = sorted(recorders, key=lambda r: r.rank)
    t0 = min((r.t0 for r in recs if r.actions), default=0.0)
    keyed = _transfers(recs, t0)
    transfers = sorted((t for _, t in keyed), key=lambda t: t.end)
    delivered = {(rank, key): t.end for key, t in keyed for rank in (t.src, t.dst)}  # both sides of a message

    arrived = {(r.rank, rv.action.kind, rv.action.stage, rv.action.microbatch): rv.arrived - t0
               for r in recs for rv in r.recvs if rv.arrived >= 0}

    def end_of(rank: int, a: Action, start: float, end: float) -> float:
        if not a.kind.is_transfer:
            return end - t0
        return max(delivered.get((rank, message_key(rank, a)), end - t0), start - t0)

    def start_of(rank: int, a: Action, start: float, end: float) -> float:
        """A compute starts once the messages it waits for inside it have arrived (the wait is idle time)."""
        waits = [arrived.get((rank, kind, a.stage, a.microbatch), -1.0) for kind in _WAITED_INSIDE.get(a.kind, ())]
        return min(max([start - t0, *waits]), end - t0)
    actions = tuple(tuple(ActionRecord(rank=r.rank, index=i, action=a, start=start_of(r.rank, a, s, e),
                                       end=end_of(r.rank, a, s, e))
                          for i, a, s, e in sorted(r.actions, key=lambda x: x[0])) for r in recs)
    memory = tuple(MemoryTimeline(rank=r.rank, points=((0.0, 0.0),) + tuple((t - t0, float(b)) for t, b in r.memory))
                   for r in recs)
    ends = [a.end for acts in actions for a in acts] + [t.end for t in transfers]
    peaks = tuple(float(max((b for _, b in r.memory), default=0)) for r in recs)
    return Trace(schedule=schedule, actions=actions, transfers=tuple(transfers), memory=memory,
                 unit_bytes=tuple(unit_bytes) if unit_bytes is not None else peaks,
                 step_time=max(ends, default=0.0), source="measured")


def save_trace(trace: Trace, path: str | pathlib.Path) -> None:
    """Write ``trace`` as evenpipe trace JSON (:meth:`Trace.to_json`)."""
    pathlib.Path(path).write_text(trace.to_json())


def load_trace(path: str | pathlib.Path) -> Trace:
    """Read a trace written by :func:`save_trace` or ``evenpipe simulate --out`` (ConfigError if unreadable)."""
    from evenpipe.errors import ConfigError
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"trace file {str(p)!r} does not exist")
    return Trace.from_json(p.read_text())


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
