"""Model configurations: the :class:`ModelConfig` record, named presets and Hugging Face ``config.json`` parsing.

This module is pure (no torch) so that planners and the CLI can read model sizes without importing torch.
Strings (``"gpt"``, ``"sdpa"``, preset names) are parsed once here, at the edge, into enums and records.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from evenpipe.cost.specs import Arch  # one architecture enum for the cost model and the models
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
]


class Attention(enum.Enum):
    """How attention is computed; both give the same numbers (up to float rounding)."""

    EAGER = "eager"
    """Materialised ``[batch, heads, seq, seq]`` scores, causal mask and softmax (saves the probabilities)."""
    SDPA = "sdpa"
    """``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` (flash path on GPU)."""


def parse_arch(value: "str | Arch") -> Arch:
    """``"gpt"`` / ``"llama"`` (or an :class:`Arch`) -> :class:`Arch`; anything else is a ConfigError."""
    return parse_choice(Arch, value, "model architecture")


def parse_attention(value: "str | Attention") -> Attention:
    """``"eager"`` / ``"sdpa"`` (or an :class:`Attention`) -> :class:`Attention`; else ConfigError."""
    return parse_choice(Attention, value, "attention implementation")


def default_ffn_hidden(arch: Arch, hidden: int) -> int:
    """MLP width when none is given: ``4h`` for GPT; for LLaMA ``8h/3`` rounded up to a multiple of 256
    (Touvron et al. 2023, ``multiple_of=256``), or of 16 for hidden sizes under 1024 so tiny models stay tiny."""
    if arch is Arch.GPT:
        return 4 * hidden
    multiple = 256 if hidden >= 1024 else 16
    return multiple * math.ceil((8 * hidden // 3) / multiple)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Size and flavour of a reference decoder-only transformer language model."""

    arch: Arch
    """Model family (GPT or LLaMA)."""
    num_layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width ``h`` (embedding and residual stream size)."""
    num_heads: int
    """Attention (query) heads; ``hidden`` must be divisible by it."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); divides ``num_heads``; equals it for GPT."""
    ffn_hidden: int
    """Inner width of the MLP (GPT: 4h; LLaMA: the SwiGLU width)."""
    vocab: int
    """Vocabulary size (256 for byte-level tokens)."""
    seq_len: int
    """Maximum sequence length (learned positions for GPT, rotary table for LLaMA)."""
    attention: Attention = Attention.SDPA
    """Attention implementation."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and residual branches (0 disables it)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary embedding base (LLaMA only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.arch, Arch):
            raise ConfigError(f"ModelConfig.arch must be an Arch, got {self.arch!r}; use parse_arch()")
        if not isinstance(self.attention, Attention):
            raise ConfigError(f"ModelConfig.attention must be an Attention, got {self.attention!r}; "
                              "use parse_attention()")
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {name} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            raise ConfigError(f"model hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model num_heads {self.num_heads} is not divisible by num_kv_heads "
                              f"{self.num_kv_heads}")
        if self.arch is Arch.GPT and self.num_kv_heads != self.num_heads:
            raise ConfigError(f"GPT uses multi-head attention: num_kv_heads {self.num_kv_heads} must equal "
                              f"num_heads {self.num_heads}")
        if self.arch is Arch.LLAMA and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dimension, got {self.head_dim} "
                              f"(hidden {self.hidden} / num_heads {self.num_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ConfigError(f"model norm_eps must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"model rope_theta must be > 0, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads

    def block_params(self) -> int:
        """Parameters of one transformer block (weights and biases, norms included)."""
        h, f, kv = self.hidden, self.ffn_hidden, self.num_kv_heads * self.head_dim
        if self.arch is Arch.GPT:  # qkv + proj (with biases), MLP (with biases), two LayerNorms
            return (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return (h * h + 2 * h * kv) + h * h + 3 * h * f + 2 * h  # q,k,v,o; gate, up, down; two RMSNorms

    def first_params(self) -> int:
        """Parameters of the embedding part (token, plus learned positions for GPT)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.arch is Arch.GPT else 0)

    def last_params(self) -> int:
        """Parameters of the final norm and the (untied) output head."""
        norm = 2 * self.hidden if self.arch is Arch.GPT else self.hidden
        return norm + self.hidden * self.vocab

    def num_params(self) -> int:
        """Total parameter count."""
        return self.first_params() + self.num_layers * self.block_params() + self.last_params()


def _gpt(layers: int, hidden: int, heads: int, *, vocab: int = 50257, seq_len: int = 1024) -> dict[str, Any]:
    return dict(arch=Arch.GPT, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads,
                ffn_hidden=4 * hidden, vocab=vocab, seq_len=seq_len)


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int = 32000,
           seq_len: int = 2048, rope_theta: float = 10000.0) -> dict[str, Any]:
    return dict(arch=Arch.LLAMA, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, rope_theta=rope_theta)


PRESETS: Mapping[str, Callable[[], dict[str, Any]]] = {
    # byte-level test and demo sizes
    "gpt-tiny": lambda: _gpt(4, 64, 4, vocab=256, seq_len=64),
    "gpt-mini": lambda: _gpt(8, 512, 8, vocab=256, seq_len=256),
    "llama-tiny": lambda: _llama(4, 64, 4, 2, 176, vocab=256, seq_len=64),
    "llama-mini": lambda: _llama(8, 512, 8, 4, 1376, vocab=256, seq_len=256),
    # GPT-2 (Radford et al. 2019), with an untied head
    "gpt-small": lambda: _gpt(12, 768, 12),
    "gpt-medium": lambda: _gpt(24, 1024, 16),
    "gpt-large": lambda: _gpt(36, 1280, 20),
    "gpt-xl": lambda: _gpt(48, 1600, 25),
    # GPT-3 (Brown et al. 2020, table 2.1)
    "gpt3-1.3b": lambda: _gpt(24, 2048, 16, seq_len=2048),
    "gpt3-2.7b": lambda: _gpt(32, 2560, 32, seq_len=2048),
    "gpt3-6.7b": lambda: _gpt(32, 4096, 32, seq_len=2048),
    "gpt3-13b": lambda: _gpt(40, 5120, 40, seq_len=2048),
    "gpt3-175b": lambda: _gpt(96, 12288, 96, seq_len=2048),
    # LLaMA (Touvron et al. 2023), Llama 2 and Llama 3 (Meta's published config.json files)
    "llama-7b": lambda: _llama(32, 4096, 32, 32, 11008),
    "llama-13b": lambda: _llama(40, 5120, 40, 40, 13824),
    "llama-33b": lambda: _llama(60, 6656, 52, 52, 17920),
    "llama-65b": lambda: _llama(80, 8192, 64, 64, 22016),
    "llama2-7b": lambda: _llama(32, 4096, 32, 32, 11008, seq_len=4096),
    "llama2-70b": lambda: _llama(80, 8192, 64, 8, 28672, seq_len=4096),
    "llama3-8b": lambda: _llama(32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192, rope_theta=500000.0),
    "llama3-70b": lambda: _llama(80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192, rope_theta=500000.0),
}


_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def _build(fields: dict[str, Any], given: Mapping[str, Any]) -> ModelConfig:
    overrides = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise choice_error("model config field", unknown[0], list(_FIELDS))
    merged = {**fields, **overrides}
    merged["arch"] = parse_arch(merged["arch"])
    merged["attention"] = parse_attention(merged.get("attention", Attention.SDPA))
    if "hidden" in overrides and "ffn_hidden" not in overrides:  # keep the family's MLP ratio
        merged["ffn_hidden"] = default_ffn_hidden(merged["arch"], merged["hidden"])
    if merged["arch"] is Arch.GPT and "num_heads" in overrides and "num_kv_heads" not in overrides:
        merged["num_kv_heads"] = merged["num_heads"]
    return ModelConfig(**merged)


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset called ``name`` (see :data:`PRESETS`) with field ``overrides`` (strings allowed for
    ``arch`` and ``attention``; ``None`` values are ignored). Overriding ``hidden`` alone rescales
    ``ffn_hidden`` by the family's rule. Unknown names or fields raise ConfigError."""
    preset = PRESETS.get(str(name).lower())
    if preset is None:
        raise choice_error("model", name, list(PRESETS))
    return _build(preset(), overrides)


def _hf_get(raw: Mapping[str, Any], keys: tuple[str, ...], path: object, default: Any = ...) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is ...:
        raise ConfigError(f"{path}: Hugging Face config lacks {' / '.join(keys)}")
    return default


def config_from_hf(path: "str | pathlib.Path", **overrides: Any) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (a file, or a directory holding one); no download.

    ``model_type`` ``"llama"`` (also ``"mistral"``/``"qwen2"``-style keys) or ``"gpt2"``; without a
    ``model_type`` the key names decide. The head is always untied here: ``tie_word_embeddings=true`` is
    ignored with a warning. ``overrides`` as in :func:`model_config` (e.g. ``attention="eager"``).
    """
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read Hugging Face config {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type") or ("gpt2" if "n_layer" in raw else "llama" if "num_hidden_layers" in raw
                                           else None)
    gpt_types, llama_types = ("gpt2",), ("llama", "mistral", "qwen2")
    if model_type in gpt_types:
        hidden = int(_hf_get(raw, ("n_embd",), p))
        heads = int(_hf_get(raw, ("n_head",), p))
        fields: dict[str, Any] = dict(
            arch=Arch.GPT, num_layers=int(_hf_get(raw, ("n_layer",), p)), hidden=hidden, num_heads=heads,
            num_kv_heads=heads, ffn_hidden=int(_hf_get(raw, ("n_inner",), p, 4 * hidden)),
            vocab=int(_hf_get(raw, ("vocab_size",), p)), seq_len=int(_hf_get(raw, ("n_positions", "n_ctx"), p)),
            norm_eps=float(_hf_get(raw, ("layer_norm_epsilon",), p, 1e-5)))
        tied_default = True
    elif model_type in llama_types:
        heads = int(_hf_get(raw, ("num_attention_heads",), p))
        fields = dict(
            arch=Arch.LLAMA, num_layers=int(_hf_get(raw, ("num_hidden_layers",), p)),
            hidden=int(_hf_get(raw, ("hidden_size",), p)), num_heads=heads,
            num_kv_heads=int(_hf_get(raw, ("num_key_value_heads",), p, heads)),
            ffn_hidden=int(_hf_get(raw, ("intermediate_size",), p)), vocab=int(_hf_get(raw, ("vocab_size",), p)),
            seq_len=int(_hf_get(raw, ("max_position_embeddings",), p)),
            norm_eps=float(_hf_get(raw, ("rms_norm_eps",), p, 1e-6)),
            rope_theta=float(_hf_get(raw, ("rope_theta",), p, 10000.0)))
        tied_default = False
    else:
        raise choice_error(f"Hugging Face model_type in {p}:", model_type, list(gpt_types + llama_types))
    if raw.get("tie_word_embeddings", tied_default):
        warnings.warn(f"{p}: tie_word_embeddings is ignored; evenpipe's reference models use an untied head",
                      stacklevel=2)
    return _build(fields, overrides)


def load_model_config(spec: "str | pathlib.Path", **overrides: Any) -> ModelConfig:
    """A preset name, or a path to a Hugging Face ``config.json`` (or its directory): the CLI's ``--model``."""
    text = str(spec)
    if text.lower() in PRESETS:
        return model_config(text, **overrides)
    if text.endswith(".json") or pathlib.Path(text).is_dir() or pathlib.Path(text).is_file():
        return config_from_hf(text, **overrides)
    raise choice_error("model (a preset name or a Hugging Face config.json path)", spec, list(PRESETS))
