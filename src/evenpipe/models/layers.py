"""Building blocks shared by the reference models: causal self-attention (eager or SDPA, with optional
grouped-query heads and rotary positions) and the rotary table.

Shapes: ``B`` batch, ``T`` sequence, ``H`` query heads, ``K`` key/value heads, ``D`` head width.

With :class:`evenpipe.models.documents.Documents` (packed rows), attention stays inside each document: the core
runs once per document (a run of a row), causal, on that document's queries, keys and values alone, so a row
computes the sum of its documents' squared lengths, not the square of the row's (a dense ``[T, T]`` mask computes
every pair and keeps a fused kernel from skipping the masked blocks); rotary positions restart per document.
Without, the causal path is unchanged.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.models.config import Attention, ModelConfig
from evenpipe.models.documents import Documents
from evenpipe.models.recompute import recompute_core

__all__ = ["CausalSelfAttention", "rotary_table", "apply_rotary", "check_seq_len"]


def check_seq_len(seq: int, cfg: ModelConfig) -> None:
    """Refuse an input longer than the model's position table."""
    limit = cfg.num_positions or cfg.seq_len
    if seq > limit:
        raise ConfigError(f"input sequence length {seq} exceeds the model's {limit} positions")


def rotary_table(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[seq_len, D]`` float32, in the rotate-half layout (Su et al. 2021; the layout of
    Hugging Face's LLaMA), frequencies ``theta ** (-2i / D)``."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` by the first ``T`` rows of the table, or by the rows ``positions``
    ``[B, T]`` (positions that restart per document)."""
    if positions is None:
        seq = x.shape[-2]
        cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    else:
        cos, sin = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)  # [B, 1, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention computed step by step (scores, mask, softmax, dropout, ``probs @ v``)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head i reads key/value head i // groups (as SDPA's enable_gqa)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, T, T]
    hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention by ``torch``'s fused kernel (``is_causal``: the masked blocks are skipped)."""
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=True, is_causal=True)
        except TypeError:  # torch < 2.5 has no enable_gqa
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _by_document(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``attend`` run causally on each document of each row, the outputs put back in place: ``core(q, k, v,
    dropout_p, segments)`` with ``segments`` per row its runs' ``(start, end)``
    (:attr:`evenpipe.models.documents.Documents.segments`)."""
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
             segments: tuple[tuple[tuple[int, int], ...], ...]) -> torch.Tensor:
        rows = []
        for b, runs in enumerate(segments):
            parts = [attend(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], dropout_p) for s, e in runs]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return core


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with one fused q/k/v projection."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, bias: bool, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.proj.residual_out = True  # type: ignore[assignment]  # scaled init (see models.lm)
        self.dropout = cfg.dropout
        self.attend = _eager_attention if cfg.attention is Attention.EAGER else _sdpa_attention
        self.attend_documents = _by_document(self.attend)
        self.rotary = rotary is not None
        self.recompute_core = False
        """Selective recomputation: the core (scores to ``probs @ v``) keeps only q, k, v and runs again in
        backward (:mod:`evenpipe.models.recompute`)."""
        if rotary is not None:  # constant tables: buffers, so the stash recognises them as non-activations
            self.register_buffer("rope_cos", rotary[0], persistent=False)
            self.register_buffer("rope_sin", rotary[1], persistent=False)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, ...]: under sequence parallelism x holds T / tp positions, qkv all T
        batch, seq = qkv.shape[:2]
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, K, T, D]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        positions = None if documents is None else documents.positions  # None: 0..T-1, the plain causal path
        if self.rotary:
            q = apply_rotary(q, self.rope_cos, self.rope_sin, positions)
            k = apply_rotary(k, self.rope_cos, self.rope_sin, positions)
        attend = self.attend if documents is None else self.attend_documents
        args = (dropout,) if documents is None else (dropout, documents.segments)
        if self.recompute_core:
            out = recompute_core(attend, q, k, v, *args, random=dropout > 0)  # [B, H, T, D]
        else:
            out = attend(q, k, v, *args)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))
