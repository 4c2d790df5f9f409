"""FLOP counts of a transformer layer, the embedding and the head, as GEMM shapes per tensor-parallel rank.

Convention (Narayanan et al. 2021, appendix; also PaLM appendix B): a GEMM of shape (m×k)·(k×n) costs 2·m·n·k
FLOPs; the backward of a GEMM costs twice its forward (input gradient and weight gradient, one forward each);
attention scores are counted over the full s×s matrix (no causal halving), as Megatron's formula does.

Model FLOPs per step (the MFU numerator, no recomputation) with T = B·s tokens:
    3 · T · (2·N_layers_matrix + 4·L·s·h + 2·h·V)
which for a GPT layer (N = 12·h²·L) is Megatron's 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)). Executed (hardware)
FLOPs add the recomputed forward: the whole layer forward under full recomputation (giving Megatron's
96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))) and the attention core under selective recomputation. The extra work
that FlashAttention does internally in its backward is not counted (as in the FlashAttention paper's MFU).
"""

from __future__ import annotations

from dataclasses import dataclass

from evenpipe.cost.parallel import ParallelConfig, Recompute
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.specs import Arch, ModelSpec

__all__ = ["Gemm", "layer_gemms", "attention_core_flops", "head_gemm", "model_flops_per_step",
           "executed_flops_per_step", "layer_forward_flops", "step_flops"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemm:
    """One matrix multiply (m×k)·(k×n), repeated ``count`` times, on one tensor-parallel rank."""

    m: int
    """Rows (tokens)."""
    n: int
    """Output columns."""
    k: int
    """Reduction dimension."""
    count: int = 1
    """Identical multiplies (e.g. batched heads)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def _kv_shards(model: ModelSpec, tp: int) -> int:
    """Tensor-parallel ranks the KV heads are split over (replicated beyond the number of KV heads)."""
    return min(tp, model.num_kv_heads)


def layer_gemms(model: ModelSpec, *, tp: int, microbatch_size: int, tokens: int | None = None) -> tuple[Gemm, ...]:
    """The weight GEMMs of one layer's forward on one tensor-parallel rank (QKV, output, MLP in, MLP out), over
    ``tokens`` rows (default ``microbatch_size * seq_len``)."""
    tokens = microbatch_size * model.seq_len if tokens is None else tokens
    h, t = model.hidden, tp
    qkv_cols = h // t + 2 * model.kv_hidden // _kv_shards(model, t)
    mlp_in = (2 if model.arch is Arch.LLAMA else 1) * model.ffn_hidden // t  # SwiGLU: gate and up fused
    return (
        Gemm(m=tokens, n=qkv_cols, k=h),
        Gemm(m=tokens, n=h, k=h // t),
        Gemm(m=tokens, n=mlp_in, k=h),
        Gemm(m=tokens, n=h, k=model.ffn_hidden // t),
    )


def attention_core_flops(model: ModelSpec, *, tp: int, microbatch_size: int, squares: int | None = None) -> float:
    """Forward FLOPs of scores (Q·Kᵀ) and weighted values (P·V) on one rank: 4·b·s²·h/t (full s×s), or
    4·squares·h/t for documents whose squared lengths sum to ``squares`` (each attends to itself)."""
    if squares is not None:
        return 4.0 * squares * model.hidden / tp
    return 4.0 * microbatch_size * model.seq_len ** 2 * model.hidden / tp


def head_gemm(model: ModelSpec, *, tp: int, microbatch_size: int, tokens: int | None = None) -> Gemm:
    """The output projection to the (vocab-parallel) logits on one rank, over ``tokens`` rows (default b·s)."""
    return Gemm(m=microbatch_size * model.seq_len if tokens is None else tokens, n=-(-model.vocab // tp),
                k=model.hidden)


def layer_forward_flops(model: ModelSpec, *, tp: int = 1, microbatch_size: int = 1,
                        shape: MicrobatchShape | None = None) -> float:
    """Forward FLOPs of one layer on one tensor-parallel rank (weight GEMMs plus attention core), for ``b`` full
    rows or a micro-batch of documents of varying length (``shape``)."""
    varied = shape is not None and not shape.padded
    tokens = shape.num_tokens if shape is not None and varied else None
    squares = shape.sum_squares if shape is not None and varied else None
    gemms = sum(g.flops for g in layer_gemms(model, tp=tp, microbatch_size=microbatch_size, tokens=tokens))
    return gemms + attention_core_flops(model, tp=tp, microbatch_size=microbatch_size, squares=squares)


def _forward_flops_per_sequence(model: ModelSpec) -> tuple[float, float, float]:
    """(layer GEMMs, attention core, head) forward FLOPs of one whole sequence, all layers, no parallelism."""
    s = model.seq_len
    layer_matrix = 2.0 * s * model.matrix_params_per_layer * model.num_layers
    attention = 4.0 * s * s * model.hidden * model.num_layers
    head = 2.0 * s * model.hidden * model.vocab
    return layer_matrix, attention, head


def model_flops_per_step(model: ModelSpec, global_batch: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward = 3 forwards, no recomputation)."""
    layers, attention, head = _forward_flops_per_sequence(model)
    return 3.0 * global_batch * (layers + attention + head)


def step_flops(model: ModelSpec, cfg: ParallelConfig) -> tuple[float, float]:
    """(model, executed) FLOPs of one step: :func:`model_flops_per_step` and :func:`executed_flops_per_step`, or,
    for a configuration with micro-batch shapes (documents of varying length), their sums over its micro-batches'
    computed tokens and squared lengths (padding counted), on every replica alike."""
    if cfg.microbatch_shapes is None:
        return model_flops_per_step(model, cfg.global_batch), executed_flops_per_step(model, cfg)
    useful = extra = 0.0
    for sh in cfg.microbatch_shapes:
        layers = 2.0 * sh.num_tokens * model.matrix_params_per_layer * model.num_layers
        attention = 4.0 * sh.sum_squares * model.hidden * model.num_layers
        head = 2.0 * sh.num_tokens * model.hidden * model.vocab
        useful += 3.0 * (layers + attention + head)
        extra += {Recompute.NONE: 0.0, Recompute.SELECTIVE: attention, Recompute.FULL: layers + attention}[cfg.recompute]
    return cfg.dp * useful, cfg.dp * (useful + extra)


def executed_flops_per_step(model: ModelSpec, cfg: ParallelConfig) -> float:
    """Hardware FLOPs of one step: model FLOPs plus recomputed forwards (see the module docstring)."""
    layers, attention, _ = _forward_flops_per_sequence(model)
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: attention, Recompute.FULL: layers + attention}
    return model_flops_per_step(model, cfg.global_batch) + cfg.global_batch * extra[cfg.recompute]
