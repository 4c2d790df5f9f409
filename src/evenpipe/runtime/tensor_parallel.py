"""Tensor parallelism through DTensor (Shoeybi et al. 2019's Megatron split) of the reference models' blocks and
of Hugging Face Llama-family layers (llama, mistral, qwen2: separate ``q/k/v/o_proj`` and ``gate/up/down_proj``
linears, whose forward reshapes to ``(-1, head_dim)`` and so runs on the local heads unchanged).

Per block, with ``tp`` ranks on the mesh's ``tp`` dimension:

- attention: the fused q/k/v projection is split by columns (``ColwiseParallel``), so each rank computes
  ``H / tp`` query heads and ``K / tp`` key/value heads; the output projection is split by rows
  (``RowwiseParallel``) and its partial sums are all-reduced. ``H`` and ``K`` must be divisible by ``tp``.
- MLP: the up projections (GPT ``fc``; LLaMA ``gate`` and ``up``) by columns, the down projection by rows.
- Hugging Face: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` by columns, ``o_proj`` and
  ``down_proj`` by rows (separate projections need no reordering).
- norms, embeddings and the head stay replicated: every tensor-parallel rank holds them whole and computes the
  same values and the same gradients (their inputs and output gradients are replicated), so they need no
  reduction.

What crosses a stage boundary: a replicated, plain (local) ``torch.Tensor`` -- every block takes and returns
the full hidden state ``[B, T, h]`` (``use_local_output``), so the executor's point-to-point transfers and its
shape handshake are unchanged; tensor-parallel rank ``t`` of stage ``s`` talks to rank ``t`` of stage ``s+1``.

With ``sequence_parallel`` (Megatron's sequence parallelism, :mod:`evenpipe.runtime.sequence_parallel`) the
same linears are split the same way, but the column-parallel ones all-gather their input over the sequence and
the row-parallel ones reduce-scatter their output over it; between them the norms, dropout and residual adds run
on ``T / tp`` positions. The embedding's output is cut to this rank's slice and the head's input gathered, so
what crosses a stage boundary is ``[B, T / tp, h]``: tensor-parallel rank ``t`` sends its own slice to rank
``t`` of the next stage.

The fused q/k/v weight is stored ``[q heads | k heads | v heads]``; a column split of that would hand rank 0
all the query heads. :func:`parallelize_stage` therefore reorders its rows rank-major (rank ``t``'s query, key
and value heads contiguous) before sharding; :func:`reference_layout` undoes the reordering of a gathered
parameter or gradient, so it can be compared with (or saved as) the un-sharded model's.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import collective, through_flat
from evenpipe.runtime.sequence_parallel import (SEQUENCE_PARTIAL, gather_sequence, gathered_linear,
                                                reduce_scatter_sequence, scatter_sequence)

__all__ = ["parallelize_stage", "full_tensor", "local_shard", "reference_layout", "sum_sequence_partial_grads"]

_QKV_ORDER = "_evenpipe_tp_row_order"
"""Attribute of a reordered q/k/v linear: the row permutation applied before sharding."""


def _qkv_row_order(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Row permutation of ``[q | k | v]`` that makes each tensor-parallel rank's heads contiguous."""
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    q_per, kv_per = q_rows // tp, kv_rows // tp
    parts = []
    for t in range(tp):
        parts += [torch.arange(t * q_per, (t + 1) * q_per),
                  q_rows + torch.arange(t * kv_per, (t + 1) * kv_per),
                  q_rows + kv_rows + torch.arange(t * kv_per, (t + 1) * kv_per)]
    return torch.cat(parts)


@torch.no_grad()
def _reorder_rows(linear: nn.Linear, order: torch.Tensor) -> None:
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])
    setattr(linear, _QKV_ORDER, order)


_HF_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Linear layers of a Hugging Face Llama-family attention (llama, mistral, qwen2)."""
_HF_MLP = ("gate_proj", "up_proj", "down_proj")
"""Linear layers of a Hugging Face Llama-family gated MLP."""


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _plans(module: nn.Module) -> dict[str, Any] | None:
    """The colwise/rowwise plan of a module this file knows, or None."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from evenpipe.models.gpt import _MLP
    from evenpipe.models.layers import CausalSelfAttention
    from evenpipe.models.llama import _SwiGLU
    if isinstance(module, CausalSelfAttention):
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
    if isinstance(module, _MLP):
        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if isinstance(module, _SwiGLU):
        return {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    if _has_linears(module, _HF_ATTENTION):  # its forward reshapes to (-1 heads, head_dim): local heads work
        return {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel()}
    if _has_linears(module, _HF_MLP):
        return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    return None


def _check_heads(module: nn.Module, tp: int) -> None:
    """Query and key/value heads of an attention module must split evenly over ``tp`` ranks."""
    config = getattr(module, "config", None)
    heads = getattr(module, "num_heads", getattr(config, "num_attention_heads", None))
    kv_heads = getattr(module, "num_kv_heads", getattr(config, "num_key_value_heads", heads))
    if heads is not None and (heads % tp or (kv_heads if kv_heads is not None else heads) % tp):
        raise ConfigError(f"--tp {tp} does not divide the attention's {heads} query heads and {kv_heads} "
                          "key/value heads")


def parallelize_stage(stage: nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False) -> nn.Module:
    """Split ``stage``'s attention and MLP modules over the 1-D device mesh ``tp_mesh`` (in place); with
    ``sequence_parallel``, shard the rest of each block over the sequence too (see the module docstring).

    Call it once per stage module, before building the optimizer (parameters become DTensors).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from evenpipe.models.layers import CausalSelfAttention
    tp = tp_mesh.size()
    if tp == 1:
        return stage
    if sequence_parallel:
        _check_sequence_parallel(stage, tp)
    split = 0
    for module in list(stage.modules()):
        plan = _plans(module)
        if plan is None:
            continue
        split += 1
        if isinstance(module, CausalSelfAttention) or _has_linears(module, _HF_ATTENTION):
            _check_heads(module, tp)
        if isinstance(module, CausalSelfAttention):
            _reorder_rows(module.qkv, _qkv_row_order(module.num_heads, module.num_kv_heads, module.head_dim, tp))
            module.num_heads //= tp  # the forward now sees this rank's heads only
            module.num_kv_heads //= tp
        if sequence_parallel:
            _sequence_parallel_linears(module, plan, tp_mesh)
        else:
            parallelize_module(module, tp_mesh, plan)
    blocks: Sequence[nn.Module] = getattr(stage, "blocks", ())
    if not split and len(blocks):
        layer = getattr(blocks[0], "layer", blocks[0])  # a Hugging Face layer inside its block wrapper
        raise ConfigError(f"--tp {tp}: tensor parallelism splits the reference GPT/LLaMA blocks and Hugging Face "
                          f"Llama-family layers (q/k/v/o and gate/up/down projections); this model's "
                          f"{type(layer).__name__} has no tensor-parallel plan (use --tp 1)")
    if sequence_parallel:
        _shard_sequence(stage, tp_mesh.get_group())
    return stage


def _check_sequence_parallel(stage: nn.Module, tp: int) -> None:
    """Sequence parallelism runs the reference blocks (their norms and residuals are this file's to shard)."""
    from evenpipe.models.gpt import GPTBlock, GPTHead
    from evenpipe.models.llama import LlamaBlock, LlamaHead
    blocks: Sequence[nn.Module] = getattr(stage, "blocks", ())
    last = getattr(stage, "last", None)
    odd = [type(m).__name__ for m in (*blocks, *([last] if last is not None else []))
           if not isinstance(m, (GPTBlock, LlamaBlock, GPTHead, LlamaHead))]
    if odd:
        raise ConfigError(f"--sequence-parallel with --tp {tp} shards the reference GPT/LLaMA blocks; this model's "
                          f"{odd[0]} computes positions and masks from the sequence it receives (drop "
                          "--sequence-parallel)")


def _sequence_parallel_linears(module: nn.Module, plan: dict[str, Any], tp_mesh: Any) -> None:
    """Shard each linear of ``plan`` by columns or rows as DTensors and give it the sequence-parallel forward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for name, style in plan.items():
        linear = getattr(module, name)
        column = isinstance(style, ColwiseParallel)
        for p_name, param in list(linear.named_parameters(recurse=False)):
            dim = 0 if column else (1 if p_name == "weight" else None)  # a row-parallel bias stays whole
            local = param.detach() if dim is None else param.detach().chunk(tp, dim=dim)[rank]
            placement = Replicate() if dim is None else Shard(dim)
            shard = DTensor.from_local(local.clone(), tp_mesh, [placement], run_check=False)
            linear.register_parameter(p_name, nn.Parameter(shard, requires_grad=param.requires_grad))
        linear.sequence_group = tp_mesh.get_group()
        linear.__class__ = _SequenceColumnLinear if column else _SequenceRowLinear


class _SequenceColumnLinear(nn.Linear):
    """A column-parallel linear whose input is a sequence slice: all-gather, then this rank's columns."""

    sequence_group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else _to_local(self.bias)
        return gathered_linear(x, _to_local(self.weight), bias, self.sequence_group)


class _SequenceRowLinear(nn.Linear):
    """A row-parallel linear whose partial sums are reduce-scattered over the sequence (bias added after)."""

    sequence_group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_scatter_sequence(F.linear(x, _to_local(self.weight)), self.sequence_group)
        return out if self.bias is None else out + _to_local(self.bias)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard, differentiably (its gradient flows back to the DTensor)."""
    local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
    return local


def _shard_sequence(stage: nn.Module, group: Any) -> None:
    """Cut the embedding's output to this rank's slice, gather the head's input, and name the parameters whose
    gradients are partial over the slices (norms, row-parallel biases: summed by the executor each step)."""
    first, last = getattr(stage, "first", None), getattr(stage, "last", None)
    if first is not None:
        first.register_forward_hook(lambda _m, _args, out: scatter_sequence(out, group))
    if last is not None:
        last.head.register_forward_pre_hook(lambda _m, args: (gather_sequence(args[0], group), *args[1:]))
    partial = [name for name, p in stage.named_parameters()
               if (name.startswith("blocks.") and not _is_sharded(p))
               or (name.startswith("last.") and not name.startswith("last.head."))]
    setattr(stage, SEQUENCE_PARTIAL, tuple(partial))
    stage.sequence_group = group


def sum_sequence_partial_grads(stages: Iterable[nn.Module], group: Any) -> None:
    """Sum over the tensor-parallel ranks the gradients of every stage's parameters named in its
    ``SEQUENCE_PARTIAL`` list (one flat all-reduce; a DTensor gradient by its local shard): each rank's gradient
    counts only its sequence slice."""
    grads = [local_shard(g) for stage in stages for name in getattr(stage, SEQUENCE_PARTIAL, ())
             if (g := stage.get_parameter(name).grad) is not None]

    def total(flat: torch.Tensor) -> None:
        with collective("the sequence-parallel gradient all-reduce over tensor parallelism"):
            dist.all_reduce(flat, group=group)

    through_flat(grads, total, dtype=torch.float32)  # summed in fp32 whatever the model's dtype


def _is_sharded(t: torch.Tensor) -> bool:
    return any(not pl.is_replicate() for pl in getattr(t, "placements", ()))


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (tensor parallelism, FSDP): a view of the storage that really holds its
    bytes; a plain tensor unchanged."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (collective over its mesh); a plain tensor unchanged."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference_layout(module: nn.Module, param_name: str, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a gathered parameter or gradient of ``module.<param_name>``) in the un-sharded model's layout."""
    owner_name, _, _ = param_name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    order = getattr(owner, _QKV_ORDER, None)
    if order is None:
        return full
    out = torch.empty_like(full)
    out[order] = full
    return out
