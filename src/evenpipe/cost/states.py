"""Model states: parameters per tensor-parallel rank and Megatron's bytes per parameter (mixed-precision Adam;
Rajbhandari et al. 2020): bf16 weights 2 bytes, fp32 gradients 4 bytes, fp32 master weights and two Adam
moments 12 bytes."""

from __future__ import annotations

from evenpipe.cost.parallel import ParallelConfig
from evenpipe.cost.specs import Arch, ModelSpec

__all__ = ["BYTES_WEIGHT", "BYTES_GRAD", "BYTES_OPTIMIZER", "BYTES_MASTER", "layer_params_per_rank",
           "embedding_params_per_rank", "head_params_per_rank", "head_params"]

BYTES_WEIGHT = 2
"""bf16 weights."""
BYTES_GRAD = 4
"""fp32 gradient accumulation buffers (Megatron's ``main_grad``)."""
BYTES_OPTIMIZER = 12
"""fp32 master weights + Adam first and second moments."""
BYTES_MASTER = 4
"""fp32 master weights (part of ``BYTES_OPTIMIZER``)."""


def layer_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h = model.hidden
    kv_split = min(tp, model.num_kv_heads)
    matrices = (2 * h * h + (model.num_mlp_matrices * h * model.ffn_hidden)) / tp \
        + 2 * h * model.kv_hidden / kv_split
    if not model.count_norm_and_bias:
        return matrices
    if model.arch is Arch.LLAMA:  # RMSNorm weights, replicated (+ column-parallel q/k/v biases)
        return matrices + 2 * h + ((h / tp + 2 * model.kv_hidden / kv_split) if model.qkv_bias else 0.0)
    split_bias = (h + model.ffn_hidden) / tp + 2 * model.kv_hidden / kv_split  # column-parallel biases
    return matrices + split_bias + 2 * h + 4 * h  # row-parallel biases and LayerNorms, replicated


def embedding_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Embedding parameters on the first rank: the vocab-parallel token table and the learned positions."""
    return -(-model.vocab // tp) * model.hidden + model.position_params


def head_params_per_rank(model: ModelSpec, cfg: ParallelConfig) -> float:
    """Output-layer parameters on the last rank: untied head, or Megatron's tied copy when pp > 1."""
    return head_params(model, tp=cfg.tp, pp=cfg.pp)


def head_params(model: ModelSpec, *, tp: int, pp: int) -> float:
    """:func:`head_params_per_rank` of a configuration with these tensor- and pipeline-parallel sizes."""
    norm = float(model.final_norm_params)
    needs_matrix = not model.tied_embeddings or pp > 1
    return norm + (-(-model.vocab // tp) * model.hidden if needs_matrix else 0.0)
