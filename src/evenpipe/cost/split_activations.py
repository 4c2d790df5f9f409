"""The part of a block's saved activations that tensor parallelism divides, as evenpipe's reference blocks
(``models/gpt.py``, ``models/llama.py``) save them: the tensors between a column-parallel and a row-parallel
linear, per micro-batch of ``b`` sequences of ``s`` tokens, in bytes (``e`` the training dtype's element size).

A block's other saved tensors -- its input, the norms' inputs, outputs and statistics -- are replicated over the
tensor-parallel ranks, so a profile measured at tp 1 gives them as they are; a rank at tp ``t`` keeps
``whole - split(1) + split(t)`` (:func:`tp_block_bytes`). Counted from what autograd saves (torch 2.x, the fused
attention kernel), each a distinct storage:

- GPT: the fused q/k/v output ``h + 2·h_kv`` (q, k, v are views of it), the attention output ``h`` (the output
  projection's input is a view of it), the MLP's first output and its GeLU ``2·f``:
  ``e·s·b·(2h + 2h_kv + 2f) / t``.
- LLaMA: the fused q/k/v output ``h + 2·h_kv`` (v a view of it), the rotated q and k ``h + h_kv``, the attention
  output ``h``, the gate and up outputs, SiLU's output and their product ``4·f``:
  ``e·s·b·(3h + 3h_kv + 4f) / t``.
- both: the attention kernel's log-sum-exp, ``4·a·s·b / t`` bytes in fp32, which selective recomputation drops
  (its core saves q, k and v only).

Key/value widths divide by ``min(t, kv_heads)`` (replicated heads beyond their number). Sequence parallelism is
not covered (it also divides the replicated part).
"""

from __future__ import annotations

from evenpipe.cost.specs import Arch, ModelSpec

__all__ = ["tp_split_bytes", "tp_block_bytes"]

_LSE_BYTES = 4
"""The log-sum-exp's element: fp32 whatever the training dtype."""


def tp_split_bytes(model: ModelSpec, *, tp: int, microbatch_size: int, seq_len: int, element_bytes: int,
                   selective: bool = False) -> float:
    """Bytes of one block's tensor-parallel-split activations on one of ``tp`` ranks (see the module doc)."""
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_hidden
    kv_tp = min(tp, model.num_kv_heads)
    sb = float(microbatch_size * seq_len)
    if model.arch is Arch.LLAMA:
        elements = (3 * h + 4 * f) / tp + 3 * kv / kv_tp
    else:
        elements = (2 * h + 2 * f) / tp + 2 * kv / kv_tp
    lse = 0.0 if selective else _LSE_BYTES * model.num_heads * sb / tp
    return element_bytes * sb * elements + lse


def tp_block_bytes(whole: float, model: ModelSpec, *, tp: int, microbatch_size: int, seq_len: int,
                   element_bytes: int, selective: bool = False) -> float:
    """A block's saved bytes ``whole`` (measured at tp 1 without selective recomputation) as one of ``tp`` ranks
    keeps them, with or without ``selective`` recomputation."""

    def split(t: int, drop_lse: bool) -> float:
        return tp_split_bytes(model, tp=t, microbatch_size=microbatch_size, seq_len=seq_len,
                              element_bytes=element_bytes, selective=drop_lse)
    return whole - split(1, False) + split(tp, selective)
