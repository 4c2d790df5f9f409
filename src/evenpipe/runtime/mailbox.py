"""One step's messages on one rank: posting batches, receives waiting for their consumer, sends to retire.

Sends are waited lazily: a batch posted before a compute is waited after the next compute
(:meth:`Mailbox.retire_sends`), and every send is waited at the end of the step. A receive is taken (waited)
just before the compute that consumes it. With tracing, every posted message gets a record (see
:mod:`evenpipe.runtime.trace`). The mailbox also counts its communication buffers: the bytes of pipeline
receives posted and not yet taken plus pipeline sends posted and not yet waited, and their peak over the step.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from evenpipe.runtime.comm import PendingBatch, Transfer, post_batch
from evenpipe.runtime.stash import StashKey
from evenpipe.runtime.trace import RankRecorder, SendRecord
from evenpipe.schedule.ir import Action, ActionKind

__all__ = ["Mailbox"]

_PIPELINE = frozenset((ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B))
"""The pipeline messages, whose buffers the mailbox counts (BPipe's moves are activations: the stash counts them)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Mailbox:
    """The pending messages of one step (see the module docstring)."""

    def __init__(self, *, timeout_s: float, recorder: RankRecorder | None) -> None:
        self.timeout_s = timeout_s
        self.recorder = recorder
        self.recvs: dict[tuple[ActionKind, int, int], tuple[PendingBatch, torch.Tensor, torch.Tensor | None]] = {}
        """Posted pipeline receives by (kind, stage, micro-batch), until a compute takes them; with the buffer of
        the time an emulated slow link lets it be read, if any."""
        self.sends: list[PendingBatch] = []
        """Send batches posted since the last compute."""
        self.earlier_sends: list[PendingBatch] = []
        """... posted before it: waited after the next compute."""
        self.output_sends: dict[StashKey, PendingBatch] = {}
        """The ``SEND_F`` batch of each key (an EVICT or OFFLOAD waits on it before freeing the output)."""
        self._send_records: dict[int, list[SendRecord]] = {}
        self.buffer_bytes = 0
        """Bytes of pipeline messages in flight now (receives not taken, sends not waited)."""
        self.peak_buffer_bytes = 0
        """The largest ``buffer_bytes`` of the step."""
        self._send_bytes: dict[int, int] = {}
        self.waited_s = 0.0
        """Seconds computes spent waiting in :meth:`take` for their received inputs."""

    def post(self, items: list[tuple[Transfer, Callable[[PendingBatch], None] | None, Action]], t0: float, *,
             track_sends: bool = True) -> PendingBatch:
        """Post ``items`` (message, what to do with its batch, its action) as one batch started at ``t0``; its
        sends are retired by the step unless ``track_sends`` is False (BPipe waits its own)."""
        batch = post_batch([t for t, _, _ in items], timeout_s=self.timeout_s)
        rec = self.recorder
        for t, on_posted, a in items:
            if on_posted is not None:
                on_posted(batch)
            if t.send and rec is not None:  # one record per sending action (all its messages)
                recs = self._send_records.setdefault(id(batch), [])
                if not recs or recs[-1].action is not a:
                    recs.append(SendRecord(action=a, dst=a.peer if a.peer is not None else -1, num_bytes=0,
                                           start=t0))
                    rec.sends.append(recs[-1])
                recs[-1].num_bytes += t.tensor.numel() * t.tensor.element_size()
            elif rec is not None:
                rec.received(a, t.tensor, t0, batch)
        if track_sends and any(t.send for t, _, _ in items):
            self.sends.append(batch)
        self._count(batch, [(t, a) for t, _, a in items if a.kind in _PIPELINE])
        return batch

    def _count(self, batch: PendingBatch, items: list[tuple[Transfer, Action]]) -> None:
        """Add the pipeline messages just posted in ``batch`` to the communication buffers."""
        sent = sum(_nbytes(t.tensor) for t, _ in items if t.send)
        if sent:
            self._send_bytes[id(batch)] = self._send_bytes.get(id(batch), 0) + sent
        self.buffer_bytes += sum(_nbytes(t.tensor) for t, _ in items)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    def expect(self, kind: ActionKind, stage: int, mb: int, batch: PendingBatch, buf: torch.Tensor, *,
               due: torch.Tensor | None = None) -> None:
        """A receive into ``buf`` was posted in ``batch``; a compute takes it with :meth:`take`. ``due`` receives
        (in the same batch) the monotonic time before which an emulated slow link lets no one read it."""
        self.recvs[(kind, stage, mb)] = (batch, buf, due)

    def take(self, kind: ActionKind, stage: int, mb: int) -> torch.Tensor | None:
        """Wait for and return the posted receive (None when there is none: a local hand-off)."""
        item = self.recvs.pop((kind, stage, mb), None)
        if item is None:
            return None
        batch, buf, due = item
        t0 = time.perf_counter()
        batch.wait_for(buf)
        if due is not None:  # an emulated slow link: the message lands its delay after it was sent
            batch.wait_for(due)
            time.sleep(max(0.0, float(due.item()) - time.monotonic()))
            self.buffer_bytes -= _nbytes(due)
        self.waited_s += time.perf_counter() - t0
        self.buffer_bytes -= _nbytes(buf)
        return buf

    def poll_receives(self) -> None:
        """Look at every posted receive (stamps arrivals for the trace, see ``RankRecorder.received``)."""
        for batch, _, _ in self.recvs.values():
            batch.is_completed()

    def retire_sends(self) -> None:
        """After each compute: wait for the sends posted before the compute that just ran, and release them.

        Each send so overlaps at least one compute, and its payload (a stage output, a gradient) is freed one
        compute later instead of at the end of the step (gloo reports a send complete only once it is waited).
        Waiting for a send later than its own place in the rank's list is never stricter than the rendezvous
        semantics the validator proves deadlock-free, so this cannot deadlock.
        """
        for b in self.earlier_sends:
            b.wait_sends()
            self.sent(b)
        self.earlier_sends = self.sends
        self.sends = []

    def sent(self, batch: PendingBatch) -> None:
        """``batch``'s sends were waited: stamp their records and release their buffers."""
        self.buffer_bytes -= self._send_bytes.pop(id(batch), 0)
        if self.recorder is not None:
            now = time.perf_counter()
            for rec in self._send_records.pop(id(batch), []):
                rec.end = now

    def finish(self) -> None:
        """End of step: wait every send still pending; every receive was consumed."""
        for b in self.earlier_sends + self.sends:  # a send posted before the last compute is still unwaited
            b.wait_sends()
            self.sent(b)
        self.sends.clear()
        self.earlier_sends.clear()
        self.output_sends.clear()
        leftover = [k for k in self.recvs]
        assert not leftover, f"receives never consumed: {leftover}"
