"""Reference models for demos, tests and profiling: a GPT and a LLaMA-style decoder, sizes from tiny to the
published ones, eager or SDPA attention, cut into ``first`` / ``blocks`` / ``last`` for pipelining.

``evenpipe.models.config`` is pure (no torch); importing this package imports torch.
"""

from evenpipe.models.config import (
    PRESETS,
    Arch,
    Attention,
    ModelConfig,
    config_from_hf,
    load_model_config,
    model_config,
    parse_arch,
    parse_attention,
)
from evenpipe.models.lm import PipelineParts, TransformerLM, build_model, init_parameters, lm_loss

__all__ = [
    "Arch",
    "Attention",
    "ModelConfig",
    "PRESETS",
    "model_config",
    "config_from_hf",
    "load_model_config",
    "parse_arch",
    "parse_attention",
    "PipelineParts",
    "TransformerLM",
    "build_model",
    "init_parameters",
    "lm_loss",
]
