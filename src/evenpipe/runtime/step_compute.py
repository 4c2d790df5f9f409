"""The executor's compute handlers: ``F``, ``R``, ``B``, ``I``, ``W`` (host moves: :mod:`evenpipe.runtime.host_offload`).

Each is registered for its kind (:func:`evenpipe.runtime.step_context.register_handler`) and works on the step
context: it takes a stage's input from the mailbox (a received message) or from this rank's previous stage,
keeps what the backward needs in ``ctx.live``, and declares every kept tensor to the stash. See
:mod:`evenpipe.runtime.executor` for what freeing outputs, recomputation and the zero-bubble split mean.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from evenpipe.runtime.split_backward import backward_input, backward_weight, run_backward
from evenpipe.runtime.step_context import Handler, Phase, RngState, StashKey, StepContext, register_handler
from evenpipe.schedule.ir import Action, ActionKind

__all__: list[str] = []  # registers its handlers on import

_K = ActionKind


def _stage_input(ctx: StepContext, key: StashKey) -> torch.Tensor:
    s, mb = key
    if s == 0:
        return ctx.live.mb_inputs[mb]
    buf = ctx.mail.take(_K.RECV_F, s, mb)
    if buf is None:  # previous stage on this rank: local hand-off (its output stays the root of its backward)
        buf = ctx.live.handoffs.pop((s - 1, mb), None)
    if buf is None:
        buf = ctx.live.outputs[(s - 1, mb)].detach()
    return buf


def _run_stage(ctx: StepContext, key: StashKey, x: torch.Tensor) -> torch.Tensor:
    s, mb = key
    out = ctx.stages[s](x)
    if s == ctx.last_stage:
        loss = ctx.loss_fn(out, ctx.live.mb_targets[mb])
        return loss / ctx.schedule.num_microbatches
    return out


def _forward(a: Action, ctx: StepContext) -> None:
    key = a.key
    s = a.stage
    x = _stage_input(ctx, key)
    stash, live = ctx.stash, ctx.live
    if s in ctx.recompute_stages:
        live.rng[key] = _rng_state(ctx.device)
        with torch.no_grad():
            out = _run_stage(ctx, key, x)
    else:
        if s > 0 and x.is_floating_point():
            x.requires_grad_(True)
        with stash.capture(key):
            out = _run_stage(ctx, key, x)
    if s > 0:
        live.inputs[key] = x
        stash.hold(key, x)
    if s == ctx.last_stage:
        ctx.loss_sum += float(out.detach())
        if s in ctx.recompute_stages:
            return
    live.outputs[key] = out
    if s != ctx.last_stage:
        stash.hold(key, out)


def _recompute(a: Action, ctx: StepContext) -> None:
    key = a.key
    s, mb = key
    ctx.before_backward(key)
    live, stash = ctx.live, ctx.stash
    x = live.mb_inputs[mb] if s == 0 else live.inputs[key]
    if s > 0 and x.is_floating_point():
        x = x.detach().requires_grad_(True)
        stash.release(key, live.inputs[key])
        live.inputs[key] = x
        stash.hold(key, x)
    with _restored_rng(live.rng.pop(key), ctx.device), stash.capture(key):
        out = _run_stage(ctx, key, x)
    if ctx.free_outputs and s != ctx.last_stage:
        out.data = torch.empty(0, dtype=out.dtype, device=out.device)
    live.outputs[key] = out


def _output_grad(ctx: StepContext, key: StashKey) -> torch.Tensor | None:
    s, mb = key
    if s == ctx.last_stage:
        return None
    buf = ctx.mail.take(_K.RECV_B, s, mb)
    if buf is None:
        buf = ctx.live.out_grads.pop(key)
    return buf


def _deliver_input_grad(ctx: StepContext, key: StashKey, grad: torch.Tensor | None) -> None:
    s, mb = key
    if s == 0 or grad is None:
        return
    if ctx.schedule.rank_of(s - 1) == ctx.groups.pp_rank and (s - 1) in ctx.stages:
        ctx.live.out_grads[(s - 1, mb)] = grad
    else:
        ctx.live.in_grads[key] = grad


def _backward(a: Action, ctx: StepContext) -> None:
    """``B``, or ``I`` (the input half of the zero-bubble split, its weight half deferred to ``W``)."""
    key = a.key
    ctx.before_backward(key)
    out = ctx.live.outputs.pop(key)
    grad = _output_grad(ctx, key)
    x = ctx.live.inputs.get(key)
    roots, grads = [out], [grad if grad is not None else torch.ones_like(out)]
    needs_x = x is not None and x.requires_grad
    if a.kind is _K.BACKWARD_INPUT:
        xs = (x,) if needs_x and x is not None else ()
        gxs, ctx.live.deferred_w[key] = backward_input(roots, grads, xs, ctx.graph_params(a.stage))
        _deliver_input_grad(ctx, key, gxs[0] if xs else None)
        return
    if needs_x:
        assert x is not None
        x.grad = None
    run_backward(roots, grads, keep_graph=False)
    _deliver_input_grad(ctx, key, x.grad if needs_x and x is not None else None)
    _done(ctx, key)


def _weight(a: Action, ctx: StepContext) -> None:
    backward_weight(ctx.live.deferred_w.pop(a.key), ctx.graph_params(a.stage))
    _done(ctx, a.key)


def _done(ctx: StepContext, key: StashKey) -> None:
    x = ctx.live.inputs.pop(key, None)
    if x is not None:
        ctx.stash.release(key, x)
    ctx.stash.release_all_of(key)


def _rng_state(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _restored_rng:
    """Run a block with a saved RNG state (for recomputation), restoring the current state afterwards."""

    def __init__(self, state: RngState, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)


def _emulated(run: Callable[[Action, StepContext], None]) -> Callable[[Action, StepContext], None]:
    """``run``, then, on an emulated slow rank, a sleep of ``factor - 1`` times the action's own seconds (its wait
    for a received input excluded): see :mod:`evenpipe.runtime.emulation` for why a sleep. Without emulation the
    only cost is one test of ``ctx.emulation``."""
    def go(a: Action, ctx: StepContext) -> None:
        emu = ctx.emulation
        if emu is None or emu.compute_factor == 1.0:
            run(a, ctx)
            return
        waited, t0 = ctx.mail.waited_s, time.perf_counter()
        run(a, ctx)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        own = time.perf_counter() - t0 - (ctx.mail.waited_s - waited)
        time.sleep(max(0.0, own) * (emu.compute_factor - 1.0))
    return go


for _kind, _run in ((_K.FORWARD, _forward), (_K.RECOMPUTE, _recompute), (_K.BACKWARD, _backward),
                    (_K.BACKWARD_INPUT, _backward), (_K.BACKWARD_WEIGHT, _weight)):
    register_handler(_kind, Handler(owner="executor", phase=Phase.COMPUTE, run=_emulated(_run)))
