"""Saved activation bytes of one transformer layer for one micro-batch on one tensor-parallel rank.

Activations of one transformer layer for one micro-batch on one tensor-parallel rank, in bytes (bf16 = 2 bytes,
dropout masks 1 byte; Korthikanti et al. 2022, section 4). For a GPT layer with f = 4h they are

    s·b·h·(10 + 24/t + 5·a·s/(h·t))   with tensor parallelism only,
    s·b·h·(34/t + 5·a·s/(h·t))        with sequence parallelism,

where the 10·s·b·h replicated over tensor ranks (split by sequence parallelism) are the two norm inputs (4), the
QKV and MLP inputs (2 + 2) and the two dropout masks (1 + 1); the 24·s·b·h/t split ones are Q and K (4), V (2),
the output-projection input (2), the GeLU input (8) and the second MLP GEMM's input (8); the score terms are the
softmax output (2), its dropout mask (1) and the dropout output (2), 5·a·s²·b/t. Written for any block:

    replicated = 4·sbh (norms) + 4·sbh (QKV and MLP inputs) + 2·sbh if the block has dropout (GPT, unless a
                 running model's dropout is 0: ``ModelSpec.has_dropout``)
    split      = 2·sbh (Q) + 4·sb·h_kv (K, V) + 2·sbh (projection input) + mlp
    mlp        = 4·sbf for GeLU (its input and the second GEMM's input), 6·sbf for SwiGLU (the gate and up
                 outputs, which a fused SwiGLU saves, and the down-projection input)
    scores     = 5·a·s²·b (eager with dropout), 2·a·s²·b (eager without dropout: the softmax output only)

A LLaMA block (RMSNorm, SwiGLU, grouped-query attention with h_kv = kv_heads·h/a, no dropout) therefore keeps
s·b·(8·h + (4·h + 4·h_kv + 6·f)/t) + 2·a·s²·b/t bytes. K and V are split over min(t, kv_heads) ranks.
Selective recomputation and flash attention both drop the score terms (flash keeps only the softmax statistics,
4·a·s·b/t bytes, which we neglect: < 0.2% for a/h <= 1/64). Full recomputation keeps the layer input only,
2·s·b·h bytes (2·s·b·h/t with sequence parallelism), plus one layer's full activations while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from evenpipe.cost.parallel import Attention, ParallelConfig, Recompute
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.specs import Arch, ModelSpec

__all__ = ["ActivationBytes", "activation_bytes", "layer_activation_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationBytes:
    """Bytes one micro-batch leaves behind on one tensor-parallel rank."""

    layer_full: float
    """One layer's saved activations without full recomputation."""
    layer_saved: float
    """What a layer keeps until its backward (``layer_full``, or its input under full recomputation)."""
    layer_weight_grad: float
    """What a layer keeps between the input-gradient and weight-gradient halves (the GEMM inputs)."""
    embedding: float
    """Embedding-stage extra (dropout mask)."""
    head: float
    """Last-stage extra: final norm input, head input, fp32 logits for the loss."""
    sent: float = 0.0
    """The stage output sent to the next stage (the boundary message)."""
    boundary: float = 0.0
    """What a stage that receives its input keeps for its backward besides its layers' saved bytes (0 when the
    first layer's saved bytes include its input)."""
    head_weight_grad: float = 0.0
    """Of ``head``, what the last stage keeps between the input-gradient and weight-gradient halves."""


def layer_activation_bytes(model: ModelSpec, cfg: ParallelConfig) -> float:
    """Saved bytes of one layer for one micro-batch on one tensor-parallel rank (see the module docstring)."""
    return activation_bytes(model, cfg).layer_saved


def activation_bytes(model: ModelSpec, cfg: ParallelConfig, shape: MicrobatchShape | None = None) -> ActivationBytes:
    """All the per-micro-batch activation sizes of ``model`` under ``cfg`` (see the module docstring), for one
    micro-batch of ``shape`` (default ``b`` full rows of ``seq_len``; documents of varying length: ``s·b`` becomes
    its tokens and ``s²·b`` its squared lengths)."""
    s, b, h, t = model.seq_len, cfg.microbatch_size, model.hidden, cfg.tp
    tokens, squares = (s * b, s * s * b) if shape is None or shape.padded else (shape.num_tokens, shape.sum_squares)
    sbh = float(tokens * h)
    sp_div = t if cfg.sequence_parallel else 1
    dropout = model.has_dropout
    replicated = (8.0 + (2.0 if dropout else 0.0)) * sbh
    kv = 4.0 * tokens * model.kv_hidden / min(t, model.num_kv_heads)
    mlp = (6.0 if model.arch is Arch.LLAMA else 4.0) * tokens * model.ffn_hidden
    split = 4.0 * sbh + mlp
    scores = (5.0 if dropout else 2.0) * model.num_heads * squares
    # the recomputed layer under full recomputation materialises its scores again (eager attention)
    keeps_scores = cfg.recompute is not Recompute.SELECTIVE and cfg.attention is Attention.EAGER
    full = replicated / sp_div + split / t + kv + (scores / t if keeps_scores else 0.0)
    layer_input = 2.0 * sbh / sp_div
    saved = layer_input if cfg.recompute is Recompute.FULL else full
    # GEMM inputs (needed for weight gradients): norm outputs feeding QKV and MLP, projection and MLP-out inputs.
    gemm_inputs = 4.0 * sbh / sp_div + 2.0 * sbh / t + (
        (4.0 if model.arch is Arch.LLAMA else 2.0) * tokens * model.ffn_hidden / t)
    weight_grad = min(saved, gemm_inputs)
    embedding = (sbh if dropout else 0.0) / sp_div
    head = 4.0 * sbh / sp_div + 4.0 * tokens * model.vocab / t
    return ActivationBytes(layer_full=full, layer_saved=saved, layer_weight_grad=weight_grad,
                           embedding=embedding, head=head, sent=2.0 * sbh / t)
