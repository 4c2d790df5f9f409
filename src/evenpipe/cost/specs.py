"""Transformer model specifications: GPT (Megatron-style) and LLaMA-style blocks, presets and HF configs.

Vocabulary: ``hidden`` is h, ``num_heads`` a, ``num_kv_heads`` the key/value heads (grouped-query attention;
equal to a for multi-head attention), ``ffn_hidden`` the MLP inner size f, ``vocab`` V, ``seq_len`` s.

Parameter counts (per transformer layer):
- GPT: attention 4·h² (+ 4·h biases), MLP 2·h·f (+ f + h biases), two LayerNorms 4·h.
- LLaMA: attention 2·h² + 2·h·(kv·h/a) (no biases), SwiGLU MLP 3·h·f, two RMSNorms 2·h.
``count_norm_and_bias=False`` drops the vector parameters: Korthikanti et al. 2022 and Narayanan et al. 2021
count the 12·h² weight matrices of a GPT layer only.
"""

from __future__ import annotations

import enum
import json
import pathlib
from dataclasses import dataclass

from evenpipe.errors import ConfigError, choice_error, parse_choice

__all__ = ["Arch", "ModelSpec", "MODEL_PRESETS", "model_preset", "from_hf_config"]


class Arch(enum.Enum):
    """Block architecture."""

    GPT = "gpt"
    """LayerNorm, GeLU MLP with biases, learned positions, (usually) tied embeddings."""
    LLAMA = "llama"
    """RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases, untied head."""

    @classmethod
    def parse(cls, name: "str | Arch") -> "Arch":
        return parse_choice(cls, name, "architecture")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Shape of a decoder-only transformer."""

    name: str
    """Label shown in reports (a preset name or a file name)."""
    arch: Arch
    """Block architecture."""
    num_layers: int
    """Transformer layers (L)."""
    hidden: int
    """Hidden size (h)."""
    num_heads: int
    """Attention (query) heads (a)."""
    num_kv_heads: int
    """Key/value heads; ``num_heads`` for multi-head attention, fewer for grouped-query attention."""
    ffn_hidden: int
    """MLP inner size (f): 4·h for GPT, about 8/3·h for SwiGLU."""
    vocab: int
    """Vocabulary size (V)."""
    seq_len: int
    """Training sequence length (s)."""
    tied_embeddings: bool
    """Whether the output head shares the input embedding's weights."""
    count_norm_and_bias: bool = True
    """Count bias and norm vectors as parameters (False reproduces papers that count weight matrices only)."""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {field_name} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Width of the key (or value) projection: ``num_kv_heads · head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_mlp_matrices(self) -> int:
        """2 for a GeLU MLP (up, down), 3 for SwiGLU (gate, up, down)."""
        return 3 if self.arch is Arch.LLAMA else 2

    @property
    def matrix_params_per_layer(self) -> int:
        """Weight-matrix parameters of one layer (12·h² for a GPT layer with f = 4·h)."""
        h = self.hidden
        attention = 2 * h * h + 2 * h * self.kv_hidden
        return attention + self.num_mlp_matrices * h * self.ffn_hidden

    @property
    def vector_params_per_layer(self) -> int:
        """Bias and norm parameters of one layer (0 when ``count_norm_and_bias`` is False)."""
        if not self.count_norm_and_bias:
            return 0
        h = self.hidden
        if self.arch is Arch.LLAMA:
            return 2 * h  # two RMSNorm weights
        return (h + 2 * self.kv_hidden) + h + self.ffn_hidden + h + 4 * h  # biases + two LayerNorms

    @property
    def params_per_layer(self) -> int:
        return self.matrix_params_per_layer + self.vector_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Input embedding (token table, plus learned positions for GPT)."""
        positions = self.seq_len * self.hidden if self.arch is Arch.GPT and self.count_norm_and_bias else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (0 extra matrix when tied: it reuses the embedding)."""
        norm = 0 if not self.count_norm_and_bias else (self.hidden if self.arch is Arch.LLAMA else 2 * self.hidden)
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        """All distinct parameters."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 51200, seq_len: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, arch=Arch.GPT, num_layers=layers, hidden=hidden, num_heads=heads,
                     num_kv_heads=heads, ffn_hidden=4 * hidden, vocab=vocab, seq_len=seq_len, tied_embeddings=True)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int,
           seq_len: int) -> ModelSpec:
    return ModelSpec(name=name, arch=Arch.LLAMA, num_layers=layers, hidden=hidden, num_heads=heads,
                     num_kv_heads=kv_heads, ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, tied_embeddings=False)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    # Narayanan et al. 2021 (SC'21), Table 1 weak-scaling GPT models; vocab 51,200 and s = 2,048.
    _gpt("gpt-1.7b", 24, 2304, 24),
    _gpt("gpt-3.6b", 30, 3072, 32),
    _gpt("gpt-7.5b", 36, 4096, 32),
    _gpt("gpt-18.4b", 40, 6144, 48),
    _gpt("gpt-39.1b", 48, 8192, 64),
    _gpt("gpt-76.1b", 60, 10240, 80),
    _gpt("gpt-145.6b", 80, 12288, 96),
    _gpt("gpt-310.1b", 96, 16384, 128),
    _gpt("gpt-529.6b", 105, 20480, 128),
    _gpt("gpt-1t", 128, 25600, 160),
    # Korthikanti et al. 2022's 22B model.
    _gpt("gpt-22b", 48, 6144, 64),
    # Brown et al. 2020 (GPT-3), GPT-2 BPE vocabulary.
    _gpt("gpt3-175b", 96, 12288, 96, vocab=50257),
    # Touvron et al. 2023 (LLaMA), s = 2,048.
    _llama("llama-7b", 32, 4096, 32, 32, 11008, vocab=32000, seq_len=2048),
    _llama("llama-13b", 40, 5120, 40, 40, 13824, vocab=32000, seq_len=2048),
    _llama("llama-33b", 60, 6656, 52, 52, 17920, vocab=32000, seq_len=2048),
    _llama("llama-65b", 80, 8192, 64, 64, 22016, vocab=32000, seq_len=2048),
    # Llama 2 (s = 4,096; 70B uses grouped-query attention with 8 KV heads).
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, vocab=32000, seq_len=4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, vocab=32000, seq_len=4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, vocab=32000, seq_len=4096),
    # Llama 3 / 3.1 (s = 8,192 pre-training, vocab 128,256, GQA with 8 KV heads).
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, vocab=128256, seq_len=8192),
)}
"""Named model presets; see :func:`model_preset`."""


def model_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive); unknown names raise ConfigError listing the valid ones."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise choice_error("model preset", name, list(MODEL_PRESETS)) from None


def _first(cfg: dict[str, object], *keys: str) -> object | None:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return None


def _int_key(cfg: dict[str, object], path: str, *keys: str) -> int:
    value = _first(cfg, *keys)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: missing or non-integer {'/'.join(keys)} (got {value!r})")
    return value


def from_hf_config(path: str | pathlib.Path, *, seq_len: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (LLaMA/Mistral, GPT-2 or GPT-NeoX style keys) into a ModelSpec.

    ``seq_len`` overrides the config's maximum positions (``max_position_embeddings``/``n_positions``).
    """
    p = pathlib.Path(path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read HF config {str(p)!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    model_type = str(cfg.get("model_type", "")).lower()
    is_llama = "intermediate_size" in cfg and model_type not in ("gpt_neox", "gpt2") \
        and cfg.get("hidden_act", "silu") in ("silu", "swish")
    hidden = _int_key(cfg, str(p), "hidden_size", "n_embd", "d_model")
    heads = _int_key(cfg, str(p), "num_attention_heads", "n_head")
    kv = _first(cfg, "num_key_value_heads")
    ffn = _first(cfg, "intermediate_size", "n_inner")
    positions = seq_len if seq_len is not None else _int_key(
        cfg, str(p), "max_position_embeddings", "n_positions", "n_ctx")
    name = str(_first(cfg, "_name_or_path") or p.parent.name or p.stem)
    return ModelSpec(
        name=name,
        arch=Arch.LLAMA if is_llama else Arch.GPT,
        num_layers=_int_key(cfg, str(p), "num_hidden_layers", "n_layer"),
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=kv if isinstance(kv, int) else heads,
        ffn_hidden=ffn if isinstance(ffn, int) else 4 * hidden,
        vocab=_int_key(cfg, str(p), "vocab_size"),
        seq_len=positions,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", not is_llama)),
    )
