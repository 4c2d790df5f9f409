"""Hugging Face ``transformers`` causal LMs as pipeline stages, split by module name (no tracing).

Supported ``model_type``: llama, mistral, qwen2 (``model.embed_tokens`` / ``model.layers`` / ``model.norm`` /
``lm_head``, rotary ``model.rotary_emb``) and gpt2 (``transformer.wte`` + ``wpe`` + ``drop`` / ``transformer.h`` /
``transformer.ln_f`` / ``lm_head``). Built from a local ``config.json`` with random initialisation (seeded), or
loaded from a local ``save_pretrained`` directory holding safetensors weights; nothing is fetched from a hub
(``HF_HUB_OFFLINE`` is set and loading passes ``local_files_only``).

Each block wrapper builds what the model's own forward would pass its layers: position ids ``0..T-1``, the causal
mask (``transformers.masking_utils.create_causal_mask`` with the model's config, so eager and SDPA attention both
work) and, for rotary models, the position embeddings from the model's rotary module, which every block holds (it
has buffers only). With :class:`evenpipe.models.documents.Documents` (packed rows) the position ids restart per
document and ``create_causal_mask`` reads the packing from them (its packed-sequence path), so attention stays
inside each document. ``use_cache`` is off. A tied input/output embedding stays tied: ``PipelineParts.tied`` names
it, so two ranks holding copies sum its gradient before the optimizer step. The loss is the model's own
``loss_function`` (``ForCausalLMLoss``) with ``shift_labels`` = the next tokens.
"""

from __future__ import annotations

import copy
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from evenpipe.cost.specs import from_hf_config, read_hf_config
from evenpipe.errors import ConfigError, choice_error
from evenpipe.models.adapter import PipelineModel
from evenpipe.models.documents import Documents
from evenpipe.models.lm import PipelineParts
from evenpipe.models.recompute import recompute_core

__all__ = ["hf_model", "HF_SPLITS", "has_weights", "require_transformers"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSplit:
    """Where one architecture keeps its parts (module names inside ``*ForCausalLM``)."""

    embed: str
    """Token embedding."""
    blocks: str
    """ModuleList of decoder layers."""
    norm: str
    """Final norm."""
    head: str = "lm_head"
    """Output projection."""
    rotary: str | None = None
    """Rotary embedding module (position embeddings for every layer), if any."""
    positions: str | None = None
    """Learned position embedding, if any."""
    dropout: str | None = None
    """Embedding dropout, if any."""


_LLAMA_LIKE = HFSplit(embed="model.embed_tokens", blocks="model.layers", norm="model.norm", rotary="model.rotary_emb")
HF_SPLITS: dict[str, HFSplit] = {
    "llama": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE,
    "gpt2": HFSplit(embed="transformer.wte", positions="transformer.wpe", dropout="transformer.drop",
                    blocks="transformer.h", norm="transformer.ln_f"),
}
"""The module-name split of each supported ``model_type``."""


def _positions(x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
    if documents is not None:
        return documents.positions  # [B, T], restarting per document
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, T]


class HFEmbedding(nn.Module):
    """Tokens ``[B, T]`` -> hidden ``[B, T, h]``: token (+ learned position) embedding (+ dropout)."""

    def __init__(self, tok: nn.Module, positions: nn.Module | None, dropout: nn.Module | None) -> None:
        super().__init__()
        self.tok = tok
        self.positions = positions
        self.dropout = dropout

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = self.tok(tokens)
        if self.positions is not None:
            x = x + self.positions(_positions(tokens, documents))
        return self.dropout(x) if self.dropout is not None else x


class HFBlock(nn.Module):
    """One decoder layer, hidden -> hidden, given the position ids, causal mask and rotary embeddings it needs.

    ``recompute_core = True`` recomputes its attention core in backward (selective recomputation): the layer's
    attention module gets a copy of the config whose attention implementation is evenpipe's wrapper around the
    one it had (``sdpa`` or ``eager``); the causal mask is still built for that one."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self._config = config

    @property
    def recompute_core(self) -> bool:
        return hasattr(_attention_of(self.layer), _BASE_ATTENTION)

    @recompute_core.setter
    def recompute_core(self, on: bool) -> None:
        attn = _attention_of(self.layer)
        if on and not hasattr(attn, _BASE_ATTENTION):
            _register_selective()
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            impl = attn.config._attn_implementation
            eager = getattr(sys.modules[type(attn).__module__], "eager_attention_forward")
            setattr(attn, _BASE_ATTENTION, (attn.config, ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)))
            config = copy.copy(attn.config)
            config._attn_implementation = _SELECTIVE
            attn.config = config
        elif not on and hasattr(attn, _BASE_ATTENTION):
            attn.config = getattr(attn, _BASE_ATTENTION)[0]
            delattr(attn, _BASE_ATTENTION)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        position_ids = _positions(x, documents)
        mask = create_causal_mask(config=self._config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        extra = {"position_embeddings": self.rotary(x, position_ids=position_ids)} if self.rotary is not None else {}
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, use_cache=False, **extra)
        return out[0] if isinstance(out, tuple) else out


_SELECTIVE = "evenpipe_selective"
"""The attention implementation name of a selectively recomputed Hugging Face attention module."""
_BASE_ATTENTION = "_evenpipe_base_attention"
"""Attribute of such a module: its own config and the attention function the wrapper recomputes."""


def _attention_of(layer: nn.Module) -> Any:
    """The layer's attention module (``self_attn`` of the Llama family, ``attn`` of GPT-2)."""
    found = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
    if found is None or not hasattr(found, "config"):
        raise ConfigError(f"--recompute selective: {type(layer).__name__} has no attention module evenpipe knows")
    return found


def _selective_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The module's own attention function, its core recomputed in backward (no attention weights returned)."""
    base = getattr(module, _BASE_ATTENTION)[1]

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = base(module, q, k, v, mask, **kwargs)[0]
        return out
    random = module.training and float(kwargs.get("dropout") or 0.0) > 0
    return recompute_core(core, query, key, value, attention_mask, random=random), None


def _register_selective() -> None:
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register(_SELECTIVE, _selective_attention)


class HFHead(nn.Module):
    """Hidden -> logits: final norm and output projection."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def has_weights(path: "str | pathlib.Path") -> bool:
    """Whether ``path`` is a directory holding safetensors weights (a ``save_pretrained`` output)."""
    p = pathlib.Path(path)
    return p.is_dir() and any(p.glob("*.safetensors"))


def require_transformers() -> None:
    """One-line ConfigError when the optional ``transformers`` / ``safetensors`` packages are missing."""
    import importlib.util
    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"Hugging Face models need {' and '.join(missing)}: install the 'hf' extra "
                          "(pip install 'evenpipe[hf]', pinned versions)")


def _build(raw: dict[str, Any], weights: pathlib.Path | None, *, seed: int, attention: str,
           dtype: torch.dtype) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub
    require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    config = AutoConfig.for_model(raw["model_type"], **fields)
    config.use_cache = False
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, config=config, local_files_only=True,
                                                     attn_implementation=attention, dtype=dtype)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the same initial weights on every rank
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    return model.train()


def hf_model(path: "str | pathlib.Path", *, seed: int = 0, attention: str = "sdpa",
             dtype: torch.dtype = torch.float32) -> PipelineModel:
    """A Hugging Face causal LM from ``path`` as a :class:`PipelineModel`: a ``config.json`` file (random
    initialisation from ``seed``, the same on every rank), or a directory holding one, whose safetensors weights
    (a ``save_pretrained`` output) are loaded when present. ``attention`` is ``"sdpa"`` or ``"eager"``."""
    if attention not in ("sdpa", "eager"):
        raise choice_error("Hugging Face attention implementation", attention, ["sdpa", "eager"])
    config_path, raw = read_hf_config(path)
    spec = from_hf_config(config_path)  # checks model_type and the sizes, one-line errors
    model_type = str(raw.get("model_type") or ("gpt2" if "n_layer" in raw else "llama"))
    split = HF_SPLITS.get(model_type)
    if split is None:
        raise choice_error(f"Hugging Face model_type in {config_path} for training:", model_type, list(HF_SPLITS))
    raw = {**raw, "model_type": model_type}
    weights = pathlib.Path(path) if has_weights(path) else None  # a directory's weights; a file: random init
    model: Any = _build(raw, weights, seed=seed, attention=attention, dtype=dtype)  # a transformers model
    get = model.get_submodule
    rotary = get(split.rotary) if split.rotary else None
    config = model.config
    first = HFEmbedding(get(split.embed), get(split.positions) if split.positions else None,
                        get(split.dropout) if split.dropout else None)
    blocks: list[nn.Module] = [HFBlock(layer, config, rotary) for layer in cast(nn.ModuleList, get(split.blocks))]
    last = HFHead(get(split.norm), get(split.head))
    tied = (("tok.weight", "head.weight"),) if last.head.weight is first.tok.weight else ()
    vocab = int(config.vocab_size)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=targets.contiguous())
    source = str(weights if weights is not None else config_path)
    return PipelineModel(module=model, parts=PipelineParts(first=first, blocks=blocks, last=last, tied=tied),
                         loss=loss, spec=spec, source=source, class_name=type(model).__name__)
