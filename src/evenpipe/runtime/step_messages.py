"""The executor's pipeline-message handlers: ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``.

Each returns the one message its action posts (:data:`~evenpipe.runtime.step_context.Posting`) on the pipeline
group, tagged by :meth:`~evenpipe.runtime.step_context.StepContext.tag`; the executor posts the messages of a
run of transfer actions together. A ``SEND_F`` releases (and, with ``free_outputs``, frees) the output it sends;
a receive's buffer waits in the mailbox for the compute that consumes it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from evenpipe.runtime.comm import PendingBatch, Transfer
from evenpipe.runtime.step_context import Handler, Phase, Posting, StepContext, register_handler
from evenpipe.schedule.ir import Action, ActionKind

__all__: list[str] = []  # registers its handlers on import

_K = ActionKind


def _message(a: Action, ctx: StepContext, tensor: torch.Tensor, *, send: bool, part: int = 0,
             num_parts: int = 1) -> Transfer:
    assert a.peer is not None
    return Transfer(send=send, tensor=tensor, peer=ctx.groups.global_rank(a.peer), group=ctx.groups.pp_group,
                    tag=ctx.tag(a, part=part, num_parts=num_parts),
                    what=f"{a.kind.name} stage {a.stage} mb {a.microbatch}")


def _link_delay(a: Action, ctx: StepContext) -> float:
    """Seconds an emulated slow link to ``a``'s peer adds to each message (0: none)."""
    emu = ctx.emulation
    return emu.send_delay_s.get(a.peer, 0.0) if emu is not None and a.peer is not None else 0.0


def _send(a: Action, ctx: StepContext, payload: torch.Tensor, keep: Callable[[PendingBatch], None] | None
          ) -> list[Posting]:
    """The message of a send; on an emulated slow link also the time it may be read (this host's monotonic
    clock plus the delay, :mod:`evenpipe.runtime.emulation`), as a second part: the sender goes on at once."""
    delay = _link_delay(a, ctx)
    if not delay:
        return [(_message(a, ctx, payload, send=True), keep)]
    due = torch.tensor([time.monotonic() + delay], dtype=torch.float64, device=payload.device)
    return [(_message(a, ctx, payload, send=True, num_parts=2), keep),
            (_message(a, ctx, due, send=True, part=1, num_parts=2), None)]


def _send_output(a: Action, ctx: StepContext) -> list[Posting]:
    """``SEND_F``: the stage output goes on; its batch is kept (an EVICT or OFFLOAD waits on it)."""
    key, live = a.key, ctx.live
    out = live.outputs[key]
    payload = out.detach()
    if a.stage in ctx.recompute_stages:
        ctx.stash.release(key, live.outputs.pop(key))
    elif ctx.free_outputs:
        ctx.stash.release(key, out)
        out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def keep(batch: PendingBatch) -> None:
        ctx.mail.output_sends[key] = batch
    return _send(a, ctx, payload, keep)


def _send_input_grad(a: Action, ctx: StepContext) -> list[Posting]:
    """``SEND_B``: the gradient of the stage input goes back."""
    return _send(a, ctx, ctx.live.in_grads.pop(a.key), None)


def _receive(a: Action, ctx: StepContext) -> list[Posting]:
    """``RECV_F``/``RECV_B``: a buffer shaped like the boundary's output for this micro-batch, taken by the
    consuming compute (on an emulated slow link not before the time the sender stamped, see :func:`_send`)."""
    boundary = a.stage - 1 if a.kind is _K.RECV_F else a.stage
    shape, dtype = ctx.shapes[a.microbatch][boundary]
    buf = torch.empty(shape, dtype=dtype, device=ctx.device)
    due = torch.empty(1, dtype=torch.float64, device=ctx.device) if _link_delay(a, ctx) else None

    def expect(batch: PendingBatch) -> None:
        ctx.mail.expect(a.kind, a.stage, a.microbatch, batch, buf, due=due)
    if due is None:
        return [(_message(a, ctx, buf, send=False), expect)]
    return [(_message(a, ctx, buf, send=False, num_parts=2), expect),
            (_message(a, ctx, due, send=False, part=1, num_parts=2), None)]


for _kind, _post in ((_K.SEND_F, _send_output), (_K.SEND_B, _send_input_grad), (_K.RECV_F, _receive),
                     (_K.RECV_B, _receive)):
    register_handler(_kind, Handler(owner="executor", phase=Phase.PIPE_MESSAGE, post=_post))
