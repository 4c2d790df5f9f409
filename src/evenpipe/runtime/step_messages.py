"""The executor's pipeline-message handlers: ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``.

Each returns the one message its action posts (:data:`~evenpipe.runtime.step_context.Posting`) on the pipeline
group, tagged by :meth:`~evenpipe.runtime.step_context.StepContext.tag`; the executor posts the messages of a
run of transfer actions together. A ``SEND_F`` releases (and, with ``free_outputs``, frees) the output it sends;
a receive's buffer waits in the mailbox for the compute that consumes it.
"""

from __future__ import annotations

import time

import torch

from evenpipe.runtime.comm import PendingBatch, Transfer
from evenpipe.runtime.step_context import Handler, Phase, Posting, StepContext, register_handler
from evenpipe.schedule.ir import Action, ActionKind

__all__: list[str] = []  # registers its handlers on import

_K = ActionKind


def _message(a: Action, ctx: StepContext, tensor: torch.Tensor, *, send: bool) -> Transfer:
    assert a.peer is not None
    if send and ctx.emulation is not None:  # an emulated slow link: the sender waits before posting
        time.sleep(ctx.emulation.send_delay_s.get(a.peer, 0.0))
    return Transfer(send=send, tensor=tensor, peer=ctx.groups.global_rank(a.peer), group=ctx.groups.pp_group,
                    tag=ctx.tag(a), what=f"{a.kind.name} stage {a.stage} mb {a.microbatch}")


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
    return [(_message(a, ctx, payload, send=True), keep)]


def _send_input_grad(a: Action, ctx: StepContext) -> list[Posting]:
    """``SEND_B``: the gradient of the stage input goes back."""
    return [(_message(a, ctx, ctx.live.in_grads.pop(a.key), send=True), None)]


def _receive(a: Action, ctx: StepContext) -> list[Posting]:
    """``RECV_F``/``RECV_B``: a buffer shaped like the boundary's output for this micro-batch, taken by the
    consuming compute."""
    boundary = a.stage - 1 if a.kind is _K.RECV_F else a.stage
    shape, dtype = ctx.shapes[a.microbatch][boundary]
    buf = torch.empty(shape, dtype=dtype, device=ctx.device)

    def expect(batch: PendingBatch) -> None:
        ctx.mail.expect(a.kind, a.stage, a.microbatch, batch, buf)
    return [(_message(a, ctx, buf, send=False), expect)]


for _kind, _post in ((_K.SEND_F, _send_output), (_K.SEND_B, _send_input_grad), (_K.RECV_F, _receive),
                     (_K.RECV_B, _receive)):
    register_handler(_kind, Handler(owner="executor", phase=Phase.PIPE_MESSAGE, post=_post))
