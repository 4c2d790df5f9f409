"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): with tensor parallelism over ``tp`` ranks, the parts of a block outside the tensor-parallel regions
(the norms, dropout and residual adds) run on ``T / tp`` of the sequence instead of all of it.

Shapes: ``B`` batch, ``T`` sequence, ``t = T / tp`` this rank's slice (rank ``r`` holds positions
``r*t .. (r+1)*t - 1``), ``h`` hidden.

The four sequence collectives, each an autograd function whose backward is the dual collective:

- :func:`scatter_sequence` (after the embedding, replicated ``[B, T, h]`` -> ``[B, t, h]``): forward takes this
  rank's slice, backward all-gathers the gradient (the embedding then gets the whole sequence's gradient on
  every rank, so it stays replicated with identical gradients).
- :func:`gather_sequence` (before the replicated LM head, ``[B, t, h]`` -> ``[B, T, h]``): forward
  all-gathers, backward takes this rank's slice of the gradient (every rank computes the same loss from the
  same logits, so that gradient is already the whole one).
- :func:`gathered_linear` (a column-parallel linear, Megatron's ``g``): forward all-gathers the input over the
  sequence and multiplies by this rank's columns; it saves only the ``[B, t, h]`` slice and all-gathers it again
  in backward for the weight gradient (Megatron's choice: what a stage keeps for backward, and what BPipe
  moves, shrinks by ``tp``); the input gradient, a partial sum over ranks, is reduce-scattered.
- :func:`reduce_scatter_sequence` (a row-parallel output, Megatron's ``g-bar``): forward reduce-scatters the
  partial sums over the sequence (instead of all-reducing them), backward all-gathers the gradient.

Parameters used on a slice (norm weights and biases, a row-parallel bias) get only their slice's share of the
gradient: :func:`evenpipe.runtime.tensor_parallel.sum_sequence_partial_grads` sums them over the tensor-parallel ranks once per step (the
executor calls it after the schedule), which keeps them replicated. Each collective runs inside
:func:`evenpipe.runtime.comm.collective`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from evenpipe.runtime.comm import collective

__all__ = ["scatter_sequence", "gather_sequence", "gathered_linear", "reduce_scatter_sequence", "SEQUENCE_PARTIAL"]

SEQUENCE_PARTIAL = "sequence_partial"
"""Attribute of a stage module: names of its parameters whose gradients are partial over the sequence slices."""


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, t, ...]`` on each rank -> ``[B, T, ...]`` in rank order."""
    size = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()  # [t, B, ...]: the collectives join along dim 0
    out = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    with collective("the sequence-parallel all-gather"):
        dist.all_gather_into_tensor(out, local, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, T, ...]`` partial sums on each rank -> this rank's ``[B, t, ...]`` slice of their sum."""
    size = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()  # [T, B, ...]
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    with collective("the sequence-parallel reduce-scatter"):
        dist.reduce_scatter_tensor(out, full, group=group)
    return out.transpose(0, 1).contiguous()


def _my_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=1)[rank].contiguous()


class _Dual(torch.autograd.Function):
    """``forward(x, group)`` whose gradient is ``backward(grad, group)``, its dual collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, forward: Callable[..., torch.Tensor],
                backward: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.group, ctx.dual = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.dual(grad, ctx.group), None, None, None


class _GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Any) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # the slice, not the gathered input
        return F.linear(_all_gather(x, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = _reduce_scatter(grad @ weight, ctx.group) if need_x else None
        grad_w = None
        if need_w:
            full = _all_gather(x, ctx.group)
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Replicated ``[B, T, ...]`` -> this rank's ``[B, t, ...]`` (backward: all-gather)."""
    return _Dual.apply(x, group, _my_slice, _all_gather)


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, t, ...]`` -> the whole ``[B, T, ...]``, identical on every rank (backward: this rank's slice)."""
    return _Dual.apply(x, group, _all_gather, _my_slice)


def reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Partial sums ``[B, T, ...]`` -> this rank's slice ``[B, t, ...]`` of their sum (backward: all-gather)."""
    return _Dual.apply(x, group, _reduce_scatter, _all_gather)


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.Tensor:
    """``linear(all_gather(x), weight, bias)`` for a sequence slice ``x`` ``[B, t, in]`` and this rank's
    columns ``weight`` ``[out / tp, in]``: ``[B, T, out / tp]``; keeps only ``x`` for backward."""
    return _GatheredLinear.apply(x, weight, bias, group)
