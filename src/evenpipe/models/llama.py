"""LLaMA-style parts: token embedding, pre-RMSNorm blocks with rotary grouped-query attention and a SwiGLU
MLP, final RMSNorm and a head, untied unless ``cfg.tied_embeddings`` (Touvron et al. 2023)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from evenpipe.models.config import ModelConfig
from evenpipe.models.documents import Documents
from evenpipe.models.layers import CausalSelfAttention, check_seq_len

__all__ = ["LlamaEmbedding", "LlamaBlock", "LlamaHead"]


class LlamaEmbedding(nn.Module):
    """Tokens ``[B, T]`` (int64) -> hidden ``[B, T, h]`` (positions enter through rotary attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``documents`` is accepted for a uniform signature; LLaMA's positions are rotary (in attention)."""
        check_seq_len(tokens.shape[-1], self.cfg)
        return self.drop(self.tok(tokens))


class _SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)
        self.down.residual_out = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Hidden -> hidden: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; ``rotary`` is the shared
    ``(cos, sin)`` table from :func:`evenpipe.models.layers.rotary_table`."""

    def __init__(self, cfg: ModelConfig, rotary: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, bias=False, rotary=rotary)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = _SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), documents))
        return x + self.drop(self.mlp(self.norm2(x)))


class LlamaHead(nn.Module):
    """Hidden ``[B, T, h]`` -> logits ``[B, T, vocab]``: final RMSNorm and a bias-free linear head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))
