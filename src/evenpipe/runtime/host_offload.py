"""Host offload: the ``OFFLOAD`` and ``RELOAD`` handlers and their per-step state (an add-on, as BPipe's is).

``OFFLOAD(s, m)`` copies what the stash holds for the key (everything autograd saved in its forward, and the
input kept for its backward) into one host buffer and frees the device storages in place
(:meth:`~evenpipe.runtime.stash.ActivationStash.export`, ``drop``; the graph keeps its handles), so the rank's
own activation bytes drop and the copy is counted apart, as offloaded bytes (host memory). ``RELOAD(s, m)``
brings the bytes back into the same storages before the key's recompute or backward; the schedule issues it one
forward early (:func:`evenpipe.schedule.build.add_offload` with ``prefetch``).

On a GPU the copies run on a side CUDA stream, one per executor, so they overlap the compute stream:

- offload: the side stream first waits for the compute stream's work so far (the forward that wrote the
  activations), then copies them into pinned host memory; the freed storages are recorded on the side stream,
  so the caching allocator reuses their memory only after the copy read it.
- reload: the storages are allocated again on the compute stream; the side stream waits for the compute stream's
  work so far (the memory's previous user), copies the bytes in and records an event; the compute stream waits for
  that event only when the key is first used (``before_backward``), so the copy overlaps the forward between.

Off a GPU the host buffer is a separate tensor (the export's copy) and the storages are freed as on a GPU.

A stage output that the next stage, on this rank, has not read yet (the V-shaped placements' turn) is handed to
that stage as a copy before its storage goes: a storage may belong to one key only when it is offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from evenpipe.runtime.step_context import Handler, Phase, StashKey, StepContext, register_addon, register_handler
from evenpipe.schedule.ir import Action, ActionKind

__all__ = ["HostMoves", "OWNER"]

OWNER = "offload"
"""The add-on's name in :attr:`StepContext.addons`."""


@dataclass(slots=True)
class HostMoves:
    """One step's host moves on one rank: the side stream (GPU) and the reloads whose copies may still run."""

    device: torch.device
    stream: Any = None
    """The side CUDA stream (None off a GPU)."""
    pending: dict[StashKey, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    """A reloaded key's copy-done event and the pinned buffer it reads, until the key's first use waits for it
    (GPU)."""
    empty: set[StashKey] = field(default_factory=set)
    """Offloaded keys with nothing saved (a recomputed first stage keeps only token ids)."""

    def before_compute(self, a: Action) -> None:
        """Nothing: a reload is waited for at its key's first use."""

    def before_backward(self, key: StashKey) -> None:
        """The compute stream waits for the key's reload copy (GPU; no-op otherwise)."""
        done = self.pending.pop(key, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done[0])

    def finish(self) -> None:
        """End of step: every offloaded key came back and was used."""
        assert not self.pending and not self.empty, f"offloaded keys left: {sorted(self.pending) + sorted(self.empty)}"


def _make(ctx: StepContext, kept: dict[Any, Any]) -> HostMoves:
    """This step's state; the side stream is made once per executor, on first use of a GPU."""
    stream = None
    if ctx.device.type == "cuda":
        stream = kept.get("stream")
        if stream is None:
            stream = kept["stream"] = torch.cuda.Stream(ctx.device)
    return HostMoves(ctx.device, stream)


def _moves(ctx: StepContext) -> HostMoves:
    moves = ctx.addons[OWNER]
    assert isinstance(moves, HostMoves)
    return moves


def _hand_off_output(ctx: StepContext, key: StashKey) -> None:
    """Give the next stage on this rank a copy of this key's output when it has not read it yet."""
    s, mb = key
    nxt = (s + 1, mb)
    if s == ctx.last_stage or s + 1 not in ctx.stages or nxt in ctx.live.inputs:
        return
    out = ctx.live.outputs.get(key)
    if out is not None and out.numel():
        ctx.live.handoffs[key] = out.detach().clone()


def _offload(a: Action, ctx: StepContext) -> None:
    key, stash, moves = a.key, ctx.stash, _moves(ctx)
    sent = ctx.mail.output_sends.pop(key, None)
    if sent is not None:  # the stage output may be one of the storages freed in place: send it first
        sent.wait_sends()
    if key not in stash.keys():
        moves.empty.add(key)
        return
    _hand_off_output(ctx, key)
    if moves.stream is not None:
        moves.stream.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(moves.stream):
            meta, host = stash.export(key, to_host=True)
    else:
        meta, host = stash.export(key, to_host=True)
    stash.drop(key, stream=moves.stream)
    stash.shelve(key, meta, host)


def _reload(a: Action, ctx: StepContext) -> None:
    key, moves = a.key, _moves(ctx)
    if key in moves.empty:
        moves.empty.discard(key)
        return
    meta, host = ctx.stash.unshelve(key)
    ctx.stash.restore(key, meta, host, stream=moves.stream)
    if moves.stream is not None:
        moves.pending[key] = (moves.stream.record_event(), host)


register_handler(ActionKind.OFFLOAD, Handler(owner="executor", phase=Phase.HOST_MOVE, run=_offload))
register_handler(ActionKind.RELOAD, Handler(owner="executor", phase=Phase.HOST_MOVE, run=_reload))
register_addon(OWNER, _make)
