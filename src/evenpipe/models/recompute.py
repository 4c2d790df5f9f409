"""Selective activation recomputation (Korthikanti et al. 2022, section 4.2; Megatron-LM's ``--recompute-granularity
selective``): the attention core -- scores ``q k^T``, their scaling and mask, the softmax, its dropout and
``probs @ v`` -- keeps nothing of its own for backward but its inputs ``q``, ``k``, ``v`` (packed documents add
their runs' bounds, plain integers), and runs again inside the backward to give their gradients.

:class:`AttentionCore` is a ``torch.autograd.Function``: its forward runs the core without a graph and saves
``q``, ``k``, ``v`` with ``ctx.save_for_backward``, so they pass through the activation stash's saved-tensor hooks
(the stash counts them, and BPipe moves them with the rest of the micro-batch); its backward rebuilds the core's
graph from detached copies, with the random state of the forward (so dropout draws the same mask), and returns
the gradients of ``q``, ``k`` and ``v``. The core has no parameters, so its backward belongs wholly to the input
gradient (``I``) of a split backward. What it frees, per layer and micro-batch on a tensor-parallel rank, is the
cost model's score terms (``5·a·s²·b/t`` bytes eager with dropout, ``2·a·s²·b/t`` without; for a fused kernel, its
output and softmax statistics): see :mod:`evenpipe.cost.activations`.

Switch it on per module with :func:`set_selective_recompute` (the reference models' ``CausalSelfAttention``; a
Hugging Face attention module through :mod:`evenpipe.models.hf`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["AttentionCore", "recompute_core", "set_selective_recompute", "SELECTIVE_ATTR"]

SELECTIVE_ATTR = "recompute_core"
"""Attribute of an attention module: True when its core is recomputed in backward."""

Core = Callable[..., torch.Tensor]
"""``core(q, k, v, *args) -> out``: the attention core; ``args`` are passed through unchanged."""


class _Rng:
    """The CPU (and, for CUDA inputs, that device's) random state before the forward ran the core."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class AttentionCore(torch.autograd.Function):
    """``out = core(q, k, v, *args)`` saving only ``q``, ``k``, ``v`` (and tensor ``args``); recomputed in
    backward. ``random``: the core draws random numbers (dropout), so the backward replays the forward's state."""

    @staticmethod
    def forward(ctx: Any, core: Core, random: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *args: Any) -> torch.Tensor:
        ctx.core, ctx.args = core, [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.rng = _Rng(q.device) if random else None
        ctx.save_for_backward(q, k, v, *(args[i] for i in ctx.tensor_args))
        return core(q, k, v, *args)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, *tensor_args = ctx.saved_tensors
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_args, tensor_args):
            args[i] = t
        needs = ctx.needs_input_grad[2:5]
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs)]
        with torch.enable_grad(), ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext():
            out = ctx.core(*inputs, *args)
        wanted = [t for t, n in zip(inputs, needs) if n]
        got = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (None, None, *(next(got) if n else None for n in needs), *(None for _ in args))


def recompute_core(core: Core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                   random: bool = False) -> torch.Tensor:
    """``core(q, k, v, *args)``, recomputed in backward when a graph is being recorded (see :class:`AttentionCore`);
    a plain call otherwise."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return core(q, k, v, *args)
    out: torch.Tensor = AttentionCore.apply(core, random, q, k, v, *args)
    return out


def set_selective_recompute(module: nn.Module, on: bool = True) -> int:
    """Recompute (or stop recomputing) the attention core of every attention module inside ``module`` that
    supports it; returns how many were switched (0: nothing in ``module`` can be recomputed selectively)."""
    switched = 0
    for m in module.modules():
        if hasattr(m, SELECTIVE_ATTR):
            setattr(m, SELECTIVE_ATTR, on)
            switched += 1
    return switched
