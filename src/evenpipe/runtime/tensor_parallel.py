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
Sequence parallelism of the norms is not implemented (boundaries would then be sequence-sharded).

The fused q/k/v weight is stored ``[q heads | k heads | v heads]``; a column split of that would hand rank 0
all the query heads. :func:`parallelize_stage` therefore reorders its rows rank-major (rank ``t``'s query, key
and value heads contiguous) before sharding; :func:`reference_layout` undoes the reordering of a gathered
parameter or gradient, so it can be compared with (or saved as) the un-sharded model's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from evenpipe.errors import ConfigError

__all__ = ["parallelize_stage", "full_tensor", "local_shard", "reference_layout"]

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


def parallelize_stage(stage: nn.Module, tp_mesh: Any) -> nn.Module:
    """Split ``stage``'s attention and MLP modules over the 1-D device mesh ``tp_mesh`` (in place).

    Call it once per stage module, before building the optimizer (parameters become DTensors).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from evenpipe.models.layers import CausalSelfAttention
    tp = tp_mesh.size()
    if tp == 1:
        return stage
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
            parallelize_module(module, tp_mesh, plan)
            module.num_heads //= tp  # the forward now sees this rank's heads only
            module.num_kv_heads //= tp
        else:
            parallelize_module(module, tp_mesh, plan)
    blocks: Sequence[nn.Module] = getattr(stage, "blocks", ())
    if not split and len(blocks):
        layer = getattr(blocks[0], "layer", blocks[0])  # a Hugging Face layer inside its block wrapper
        raise ConfigError(f"--tp {tp}: tensor parallelism splits the reference GPT/LLaMA blocks and Hugging Face "
                          f"Llama-family layers (q/k/v/o and gate/up/down projections); this model's "
                          f"{type(layer).__name__} has no tensor-parallel plan (use --tp 1)")
    return stage


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
