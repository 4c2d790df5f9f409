"""The model adapter: what the pipeline needs from a model, whoever wrote it.

A :class:`PipelineModel` is the whole model (for an un-pipelined reference), its :class:`PipelineParts`
(``first`` tokens -> hidden, ``blocks`` hidden -> hidden, ``last`` hidden -> logits, and the weights tied between
``first`` and ``last``), its loss (``loss(logits, targets)``, the mean next-token loss of one micro-batch) and its
model record (:class:`evenpipe.cost.ModelSpec`, for the cost model), plus where it came from. Adapters:
:func:`reference_model` (evenpipe's GPT/LLaMA), :func:`evenpipe.models.hf.hf_model` (Hugging Face causal LMs);
a user's own modules need only :class:`PipelineParts` and a loss (see :mod:`evenpipe.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from evenpipe.cost.specs import ModelSpec
from evenpipe.models.config import ModelConfig
from evenpipe.models.lm import PipelineParts, build_model, lm_loss

__all__ = ["PipelineModel", "reference_model", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(logits, targets) -> scalar``: mean next-token loss of one micro-batch (targets are the next tokens)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineModel:
    """A model ready to be cut into pipeline stages."""

    module: nn.Module
    """The whole model (its parameters are the parts' parameters)."""
    parts: PipelineParts
    """First / blocks / last, sharing parameters with ``module``."""
    loss: LossFn
    """The model's own next-token loss on ``last``'s output."""
    spec: ModelSpec
    """The model record the cost model reads."""
    source: str
    """Where it came from: a preset name, a config.json path or a save_pretrained directory."""
    class_name: str
    """The model's Python class, e.g. ``LlamaForCausalLM``."""

    @property
    def num_params(self) -> int:
        """Distinct parameters of the whole model (a tied weight counted once)."""
        return sum(p.numel() for p in self.module.parameters())

    def describe(self) -> dict[str, Any]:
        """``{"source", "class", "num_params"}`` (the ``model`` entry of ``train --json-out``)."""
        return {"source": self.source, "class": self.class_name, "num_params": self.num_params}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Un-pipelined forward through the parts: tokens -> logits."""
        x = self.parts.first(tokens)
        for block in self.parts.blocks:
            x = block(x)
        return self.parts.last(x)


def reference_model(cfg: ModelConfig, *, seed: int, source: str = "", device: "torch.device | str | None" = None
                    ) -> PipelineModel:
    """evenpipe's reference GPT / LLaMA built from ``cfg`` with the deterministic initialisation of ``seed``."""
    model = build_model(cfg, seed=seed, device=device)
    return PipelineModel(module=model, parts=model.pipeline_parts(), loss=lm_loss, spec=cfg.spec,
                         source=source or cfg.name, class_name=type(model).__name__)
