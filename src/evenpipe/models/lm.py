"""The reference language model: ``first`` (tokens -> hidden), ``blocks`` (hidden -> hidden), ``last``
(hidden -> logits), with a deterministic, order-independent initialisation.

Initialisation (GPT-2, Radford et al. 2019): linear and embedding weights ~ N(0, 0.02), residual output
projections ~ N(0, 0.02 / sqrt(2 * num_layers)), biases 0, norm weights 1 (and LayerNorm biases 0). Every
parameter draws from its own generator seeded by ``(seed, parameter name)``, so a parameter's initial value
depends only on the seed and its name -- not on which other parts a process builds or in which order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from evenpipe.models.config import Arch, ModelConfig
from evenpipe.models.documents import Documents
from evenpipe.models.gpt import GPTBlock, GPTEmbedding, GPTHead
from evenpipe.models.layers import rotary_table
from evenpipe.models.llama import LlamaBlock, LlamaEmbedding, LlamaHead

__all__ = ["PipelineParts", "TransformerLM", "build_model", "lm_loss", "init_parameters"]

INIT_STD = 0.02
"""Standard deviation of weight initialisation (GPT-2)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineParts:
    """A model cut into pipeline-able pieces; the modules are the model's own (parameters shared)."""

    first: nn.Module
    """Tokens ``[B, T]`` -> hidden ``[B, T, h]`` (embeddings)."""
    blocks: list[nn.Module]
    """Transformer blocks, each hidden -> hidden."""
    last: nn.Module
    """Hidden -> logits ``[B, T, vocab]`` (final norm and head)."""
    tied: tuple[tuple[str, str], ...] = ()
    """Weights shared by ``first`` and ``last``: (parameter name in ``first``, name in ``last``) pairs. When the
    two parts run on different ranks each holds a copy, and their gradients are summed before the optimizer step
    (Megatron's embedding group)."""


class TransformerLM(nn.Module):
    """A decoder-only language model built from a :class:`ModelConfig`; ``forward(tokens) -> logits``, or
    ``forward(tokens, documents)`` for packed rows (attention kept inside each document)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.arch is Arch.GPT:
            self.first: nn.Module = GPTEmbedding(cfg)
            self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
            self.last: nn.Module = GPTHead(cfg)
        else:
            rotary = rotary_table(cfg)  # one table, shared by every block
            self.first = LlamaEmbedding(cfg)
            self.blocks = nn.ModuleList(LlamaBlock(cfg, rotary) for _ in range(cfg.num_layers))
            self.last = LlamaHead(cfg)
        if cfg.tied_embeddings:
            self.last.head.weight = self.first.tok.weight

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = self.first(tokens, documents)
        for block in self.blocks:
            x = block(x, documents)
        return self.last(x)

    def pipeline_parts(self) -> PipelineParts:
        """The model's own ``first``, ``blocks`` and ``last`` modules (not copies)."""
        tied = (("tok.weight", "head.weight"),) if self.cfg.tied_embeddings else ()
        return PipelineParts(first=self.first, blocks=list(self.blocks), last=self.last, tied=tied)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@torch.no_grad()
def init_parameters(module: nn.Module, *, seed: int, num_layers: int, prefix: str = "") -> None:
    """(Re)initialise ``module``'s parameters as described in the module docstring; ``prefix`` is the
    module's name inside the full model (so a part initialised alone matches the whole model)."""
    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    seen: set[int] = set()  # a tied weight is initialised once, under its first name
    for mod_name, mod in module.named_modules(prefix=prefix):
        for p_name, param in mod.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                param.fill_(1.0 if p_name == "weight" else 0.0)
            elif p_name == "bias":
                param.zero_()
            else:
                std = residual_std if getattr(mod, "residual_out", False) else INIT_STD
                draw = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=_generator(seed, full))
                param.copy_(draw)


def build_model(cfg: ModelConfig, *, seed: int, device: "torch.device | str | None" = None,
                dtype: torch.dtype | None = None) -> TransformerLM:
    """A :class:`TransformerLM` initialised deterministically from ``seed`` (see module docstring)."""
    model = TransformerLM(cfg)
    init_parameters(model, seed=seed, num_layers=cfg.num_layers)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: logits ``[B, T, V]``, targets ``[B, T]`` int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
