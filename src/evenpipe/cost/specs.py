"""The one model record: :class:`ModelSpec`, the preset table and the Hugging Face ``config.json`` parser.

Pure (no torch): ``estimate``, ``plan``, ``simulate`` and ``train`` all read models through this module; the torch
side (:class:`evenpipe.models.ModelConfig`) only adds runtime fields (attention kernel, dropout).

Vocabulary: ``hidden`` is h, ``num_heads`` a, ``num_kv_heads`` the key/value heads (grouped-query attention;
equal to a for multi-head attention), ``ffn_hidden`` the MLP inner size f, ``vocab`` V, ``seq_len`` s.

Parameter counts (per transformer layer):
- GPT: attention 4·h² (+ 4·h biases), MLP 2·h·f (+ f + h biases), two LayerNorms 4·h.
- LLaMA: attention 2·h² + 2·h·(kv·h/a) (no biases, or q/k/v biases for Qwen2), SwiGLU MLP 3·h·f, two RMSNorms 2·h.
``count_norm_and_bias=False`` drops the vector parameters: Korthikanti et al. 2022 and Narayanan et al. 2021
count the 12·h² weight matrices of a GPT layer only.

Tied embeddings. Every GPT preset ties the output head to the token embedding: GPT-2 does (Radford et al. 2019;
Hugging Face's ``GPT2LMHeadModel`` shares ``wte``), GPT-3 "uses the same model and architecture as GPT-2" (Brown
et al. 2020, section 2.1), and Megatron-LM ties by default (``--untie-embeddings-and-output-weights`` is opt-in);
Narayanan et al. 2021's parameter formula 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) counts V·h once. LLaMA models
are untied (their published ``config.json`` files say ``tie_word_embeddings: false``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from evenpipe.errors import ConfigError, choice_error, parse_choice

if TYPE_CHECKING:
    import pathlib

__all__ = ["Arch", "ModelSpec", "MODEL_PRESETS", "model_preset", "from_hf_config", "hf_model_type", "read_hf_config",
           "swiglu_ffn_hidden", "HF_MODEL_TYPES", "replace_spec"]


class Arch(enum.Enum):
    """Block architecture."""

    GPT = "gpt"
    """LayerNorm, GeLU MLP with biases, learned positions, tied embeddings."""
    LLAMA = "llama"
    """RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases, untied head."""

    @classmethod
    def parse(cls, name: "str | Arch") -> "Arch":
        return parse_choice(cls, name, "model architecture")


def swiglu_ffn_hidden(hidden: int) -> int:
    """SwiGLU MLP width when none is given: 8h/3 rounded up to a multiple of 256 (Touvron et al. 2023,
    ``multiple_of=256``), or of 16 for hidden sizes under 1024 so tiny models stay tiny."""
    multiple = 256 if hidden >= 1024 else 16
    return multiple * math.ceil((8 * hidden // 3) / multiple)


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
    """Training sequence length (s); also the learned position table's size unless ``max_positions`` is set."""
    tied_embeddings: bool
    """Whether the output head shares the input embedding's weights."""
    count_norm_and_bias: bool = True
    """Count bias and norm vectors as parameters (False reproduces papers that count weight matrices only)."""
    max_positions: int | None = None
    """Rows of GPT's learned position table (``n_positions`` of a GPT-2 config); ``None`` means ``seq_len``."""
    qkv_bias: bool = False
    """LLaMA-family blocks with biases on the q, k and v projections (Qwen2)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary embedding base (LLaMA family)."""

    def __post_init__(self) -> None:
        if not isinstance(self.arch, Arch):
            raise ConfigError(f"model arch must be an Arch, got {self.arch!r}; use Arch.parse()")
        for field_name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {field_name} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            raise ConfigError(f"model hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model num_heads {self.num_heads} is not divisible by num_kv_heads "
                              f"{self.num_kv_heads}")
        if self.arch is Arch.LLAMA and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dimension, got {self.head_dim} "
                              f"(hidden {self.hidden} / num_heads {self.num_heads})")
        if self.max_positions is not None and self.max_positions < 1:
            raise ConfigError(f"model max_positions must be >= 1, got {self.max_positions}")
        if not self.norm_eps > 0:
            raise ConfigError(f"model norm_eps must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"model rope_theta must be > 0, got {self.rope_theta}")

    @property
    def has_dropout(self) -> bool:
        """Whether a block applies dropout (and saves its masks): GPT as Megatron trains it (Korthikanti et al.
        2022), not LLaMA. A running model with dropout 0 says False (:class:`evenpipe.models.config.ModelConfig`)."""
        return self.arch is Arch.GPT

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Width of the key (or value) projection: ``num_kv_heads · head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_positions(self) -> int:
        """Rows of the learned position table (GPT; 0 for rotary models)."""
        if self.arch is not Arch.GPT:
            return 0
        return self.max_positions if self.max_positions is not None else self.seq_len

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
            return 2 * h + ((h + 2 * self.kv_hidden) if self.qkv_bias else 0)  # RMSNorms (+ q/k/v biases)
        return (h + 2 * self.kv_hidden) + h + self.ffn_hidden + h + 4 * h  # biases + two LayerNorms

    @property
    def params_per_layer(self) -> int:
        return self.matrix_params_per_layer + self.vector_params_per_layer

    @property
    def position_params(self) -> int:
        """Learned position embedding parameters (GPT; counted with the vectors)."""
        return self.num_positions * self.hidden if self.count_norm_and_bias else 0

    @property
    def embedding_params(self) -> int:
        """Input embedding (token table, plus learned positions for GPT)."""
        return self.vocab * self.hidden + self.position_params

    @property
    def final_norm_params(self) -> int:
        """The final norm before the head."""
        if not self.count_norm_and_bias:
            return 0
        return self.hidden if self.arch is Arch.LLAMA else 2 * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (no extra matrix when tied: it reuses the embedding)."""
        return self.final_norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        """All distinct parameters."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params


def replace_spec(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """``dataclasses.replace`` typed loosely (re-validates)."""
    return dataclasses.replace(spec, **changes)


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 51200, seq_len: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, arch=Arch.GPT, num_layers=layers, hidden=hidden, num_heads=heads,
                     num_kv_heads=heads, ffn_hidden=4 * hidden, vocab=vocab, seq_len=seq_len, tied_embeddings=True)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int = 32000,
           seq_len: int = 2048, rope_theta: float = 10000.0) -> ModelSpec:
    return ModelSpec(name=name, arch=Arch.LLAMA, num_layers=layers, hidden=hidden, num_heads=heads,
                     num_kv_heads=kv_heads, ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, tied_embeddings=False,
                     rope_theta=rope_theta)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    # byte-level test and demo sizes (vocab 256: bytes as tokens)
    _gpt("gpt-tiny", 4, 64, 4, vocab=256, seq_len=64),
    _gpt("gpt-mini", 8, 512, 8, vocab=256, seq_len=256),
    _llama("llama-tiny", 4, 64, 4, 2, 176, vocab=256, seq_len=64),
    _llama("llama-mini", 8, 512, 8, 4, 1376, vocab=256, seq_len=256),
    # GPT-2 (Radford et al. 2019): GPT-2 BPE vocabulary, s = 1,024
    _gpt("gpt-small", 12, 768, 12, vocab=50257, seq_len=1024),
    _gpt("gpt-medium", 24, 1024, 16, vocab=50257, seq_len=1024),
    _gpt("gpt-large", 36, 1280, 20, vocab=50257, seq_len=1024),
    _gpt("gpt-xl", 48, 1600, 25, vocab=50257, seq_len=1024),
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
    # Brown et al. 2020 (GPT-3, table 2.1), GPT-2 BPE vocabulary, s = 2,048.
    _gpt("gpt3-1.3b", 24, 2048, 16, vocab=50257),
    _gpt("gpt3-2.7b", 32, 2560, 32, vocab=50257),
    _gpt("gpt3-6.7b", 32, 4096, 32, vocab=50257),
    _gpt("gpt3-13b", 40, 5120, 40, vocab=50257),
    _gpt("gpt3-175b", 96, 12288, 96, vocab=50257),
    # Touvron et al. 2023 (LLaMA), s = 2,048.
    _llama("llama-7b", 32, 4096, 32, 32, 11008),
    _llama("llama-13b", 40, 5120, 40, 40, 13824),
    _llama("llama-33b", 60, 6656, 52, 52, 17920),
    _llama("llama-65b", 80, 8192, 64, 64, 22016),
    # Llama 2 (s = 4,096; 70B uses grouped-query attention with 8 KV heads).
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, seq_len=4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, seq_len=4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, seq_len=4096),
    # Llama 3 / 3.1 (s = 8,192 pre-training, vocab 128,256, GQA with 8 KV heads, rope base 500,000).
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192, rope_theta=500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192, rope_theta=500000.0),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, vocab=128256, seq_len=8192, rope_theta=500000.0),
)}
"""Named model presets, one table for every command; see :func:`model_preset`."""


def model_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive); unknown names raise ConfigError listing the valid ones."""
    try:
        return MODEL_PRESETS[str(name).lower()]
    except KeyError:
        raise choice_error("model preset", name, list(MODEL_PRESETS)) from None


HF_MODEL_TYPES: dict[str, Arch] = {"gpt2": Arch.GPT, "gpt_neox": Arch.GPT, "llama": Arch.LLAMA,
                                    "mistral": Arch.LLAMA, "qwen2": Arch.LLAMA}
"""Hugging Face ``model_type`` values the parser reads, and the block architecture each maps to."""


def read_hf_config(path: "str | pathlib.Path") -> tuple[pathlib.Path, dict[str, Any]]:
    """``(config.json path, its JSON object)`` for a ``config.json`` or a directory holding one; no download."""
    import json  # here: presets need no file, and the planner and simulator import this module
    import pathlib

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
    return p, raw


def _get(raw: Mapping[str, Any], path: object, *keys: str, default: Any = ...) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is ...:
        raise ConfigError(f"{path}: Hugging Face config lacks {' / '.join(keys)}")
    return default


def _int(raw: Mapping[str, Any], path: object, *keys: str, default: Any = ...) -> int:
    value = _get(raw, path, *keys, default=default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: {'/'.join(keys)} must be an integer, got {value!r}")
    return value


def _model_type(raw: Mapping[str, Any], p: pathlib.Path) -> str:
    given = raw.get("model_type")
    if given is None:  # older files: the key names decide
        given = "gpt2" if "n_layer" in raw else "llama" if "num_hidden_layers" in raw else None
    if given not in HF_MODEL_TYPES:
        raise choice_error(f"Hugging Face model_type in {p}:", given, list(HF_MODEL_TYPES))
    return str(given)


def hf_model_type(path: "str | pathlib.Path") -> str:
    """The (checked) ``model_type`` of a Hugging Face ``config.json`` or a directory holding one."""
    p, raw = read_hf_config(path)
    return _model_type(raw, p)


def from_hf_config(path: "str | pathlib.Path", *, seq_len: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a file, or a directory holding one) into a ModelSpec; no download.

    ``model_type`` llama, mistral, qwen2 (LLaMA-family blocks), gpt2 or gpt_neox (GPT blocks). ``seq_len``
    defaults to the config's maximum positions. ``tie_word_embeddings`` is honoured (default: tied for GPT-2,
    untied otherwise, as ``transformers`` does for these classes).
    """
    p, raw = read_hf_config(path)
    model_type = _model_type(raw, p)
    arch = HF_MODEL_TYPES[model_type]
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError(f"{p}: attention_bias/mlp_bias = true is not modelled; only Qwen2's q/k/v biases are")
    if model_type == "gpt2":
        hidden, heads = _int(raw, p, "n_embd"), _int(raw, p, "n_head")
        fields: dict[str, Any] = dict(
            num_layers=_int(raw, p, "n_layer"), hidden=hidden, num_heads=heads, num_kv_heads=heads,
            ffn_hidden=_int(raw, p, "n_inner", default=4 * hidden), max_positions=_int(raw, p, "n_positions", "n_ctx"),
            norm_eps=float(_get(raw, p, "layer_norm_epsilon", default=1e-5)))
    else:
        hidden, heads = _int(raw, p, "hidden_size"), _int(raw, p, "num_attention_heads")
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads:
            raise ConfigError(f"{p}: head_dim {head_dim} != hidden_size / num_attention_heads = {hidden // heads} "
                              "is not supported")
        fields = dict(
            num_layers=_int(raw, p, "num_hidden_layers"), hidden=hidden, num_heads=heads,
            num_kv_heads=_int(raw, p, "num_key_value_heads", default=heads),
            ffn_hidden=_int(raw, p, "intermediate_size", default=4 * hidden if arch is Arch.GPT else ...),
            norm_eps=float(_get(raw, p, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
            rope_theta=float(_get(raw, p, "rope_theta", default=10000.0)),
            qkv_bias=model_type == "qwen2")
    positions = fields["max_positions"] if model_type == "gpt2" else _int(raw, p, "max_position_embeddings")
    tied = bool(raw.get("tie_word_embeddings", model_type == "gpt2"))
    return ModelSpec(name=str(raw.get("_name_or_path") or p.parent.name or p.stem), arch=arch,
                     vocab=_int(raw, p, "vocab_size"), seq_len=seq_len if seq_len is not None else positions,
                     tied_embeddings=tied, **fields)
