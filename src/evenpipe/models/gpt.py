"""GPT-2/3-style parts: token + learned position embedding, pre-LayerNorm blocks with a GELU MLP of width
``ffn_hidden`` (4h), final LayerNorm and a linear head, tied to the token embedding when
``cfg.tied_embeddings`` (the GPT presets, as GPT-2 and Megatron-LM; see :mod:`evenpipe.cost.specs`)."""

from __future__ import annotations

import torch
from torch import nn

from evenpipe.models.config import ModelConfig
from evenpipe.models.documents import Documents
from evenpipe.models.layers import CausalSelfAttention, check_seq_len

__all__ = ["GPTEmbedding", "GPTBlock", "GPTHead"]


class GPTEmbedding(nn.Module):
    """Tokens ``[B, T]`` (int64) -> hidden ``[B, T, h]``; with ``documents``, positions restart per document."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.num_positions, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        check_seq_len(tokens.shape[-1], self.cfg)
        if documents is None:
            positions = torch.arange(tokens.shape[-1], device=tokens.device)
        else:
            positions = documents.positions  # [B, T], restarting per document
        return self.drop(self.tok(tokens) + self.pos(positions))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden)
        self.proj.residual_out = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GPTBlock(nn.Module):
    """Hidden -> hidden: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, bias=True, rotary=None)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = _MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), documents))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPTHead(nn.Module):
    """Hidden ``[B, T, h]`` -> logits ``[B, T, vocab]``: final LayerNorm and a bias-free linear head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))
