"""The torch models' configuration: :class:`ModelConfig` is the one model record
(:class:`evenpipe.cost.specs.ModelSpec`) plus the fields only a running model needs (attention kernel, dropout).

Pure (no torch), so that planners and the CLI can read model sizes without importing torch. Presets and the
Hugging Face ``config.json`` parser are the cost layer's (:data:`evenpipe.cost.specs.MODEL_PRESETS`,
:func:`evenpipe.cost.specs.from_hf_config`); strings are parsed once here, at the edge, into enums and records.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from evenpipe.cost.parallel import Attention
from evenpipe.cost.specs import MODEL_PRESETS, Arch, ModelSpec, from_hf_config, swiglu_ffn_hidden
from evenpipe.errors import ConfigError, choice_error, parse_choice

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
    "default_ffn_hidden",
    "runtime_config",
]

PRESETS: Mapping[str, ModelSpec] = MODEL_PRESETS
"""The one preset table (the cost layer's)."""


def parse_arch(value: "str | Arch") -> Arch:
    """``"gpt"`` / ``"llama"`` (or an :class:`Arch`) -> :class:`Arch`; anything else is a ConfigError."""
    return parse_choice(Arch, value, "model architecture")


def parse_attention(value: "str | Attention") -> Attention:
    """``"eager"`` / ``"flash"`` (alias ``"sdpa"``), or an :class:`Attention`; else ConfigError."""
    return Attention.parse(value)


def default_ffn_hidden(arch: Arch, hidden: int) -> int:
    """MLP width when none is given: ``4h`` for GPT, :func:`evenpipe.cost.specs.swiglu_ffn_hidden` for LLaMA."""
    return 4 * hidden if arch is Arch.GPT else swiglu_ffn_hidden(hidden)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig(ModelSpec):
    """A :class:`ModelSpec` plus what a running reference model needs."""

    attention: Attention = Attention.FLASH
    """Attention kernel: eager (materialised scores) or flash (``scaled_dot_product_attention``)."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and residual branches (0 disables it)."""

    def __post_init__(self) -> None:
        ModelSpec.__post_init__(self)
        if not isinstance(self.attention, Attention):
            raise ConfigError(f"ModelConfig.attention must be an Attention, got {self.attention!r}; "
                              "use parse_attention()")
        if self.arch is Arch.GPT and self.num_kv_heads != self.num_heads:
            raise ConfigError(f"GPT uses multi-head attention: num_kv_heads {self.num_kv_heads} must equal "
                              f"num_heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model dropout must be in [0, 1), got {self.dropout}")

    @property
    def has_dropout(self) -> bool:
        """Whether the blocks save dropout masks: a GPT block with dropout > 0 (what the cost model counts)."""
        return self.arch is Arch.GPT and self.dropout > 0

    @property
    def spec(self) -> ModelSpec:
        """The plain model record (runtime fields dropped)."""
        return ModelSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSpec)})


_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def runtime_config(spec: ModelSpec, **overrides: Any) -> ModelConfig:
    """``spec`` as a :class:`ModelConfig` with field ``overrides`` (strings allowed for ``arch`` and ``attention``;
    ``None`` values are ignored). Overriding ``hidden`` alone rescales ``ffn_hidden`` by the family's rule."""
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(_FIELDS))
    if unknown:
        raise choice_error("model config field", unknown[0], list(_FIELDS))
    merged = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}
    merged.update(given)
    merged["arch"] = parse_arch(merged["arch"])
    merged["attention"] = parse_attention(merged.get("attention", Attention.FLASH))
    if "hidden" in given and "ffn_hidden" not in given:  # keep the family's MLP ratio
        merged["ffn_hidden"] = default_ffn_hidden(merged["arch"], merged["hidden"])
    if merged["arch"] is Arch.GPT and "num_heads" in given and "num_kv_heads" not in given:
        merged["num_kv_heads"] = merged["num_heads"]
    return ModelConfig(**merged)


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset called ``name`` (see :data:`PRESETS`) with field ``overrides`` (see :func:`runtime_config`).
    Unknown names or fields raise ConfigError."""
    preset = PRESETS.get(str(name).lower())
    if preset is None:
        raise choice_error("model", name, list(PRESETS))
    return runtime_config(preset, **overrides)


def config_from_hf(path: "str | pathlib.Path", **overrides: Any) -> ModelConfig:
    """A Hugging Face ``config.json`` (a file, or a directory holding one) as a :class:`ModelConfig` for the
    reference models; the record is :func:`evenpipe.cost.specs.from_hf_config`'s (tied embeddings honoured)."""
    return runtime_config(from_hf_config(path), **overrides)


def load_model_config(spec: "str | pathlib.Path", **overrides: Any) -> ModelConfig:
    """A preset name, or a path to a Hugging Face ``config.json`` (or its directory)."""
    text = str(spec)
    if text.lower() in PRESETS:
        return model_config(text, **overrides)
    if text.endswith(".json") or pathlib.Path(text).is_dir() or pathlib.Path(text).is_file():
        return config_from_hf(text, **overrides)
    raise choice_error("model (a preset name or a Hugging Face config.json path)", spec, list(PRESETS))
