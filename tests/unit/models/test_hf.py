"""Hugging Face adapter: split by module name, parts compose to the model's own logits and loss, tied weights
stay tied, the cost record counts the built model's parameters, save_pretrained directories load locally."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

from evenpipe.errors import ConfigError  # noqa: E402
from evenpipe.models.hf import hf_model  # noqa: E402
from evenpipe.runtime.stages import build_stage_modules  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf"
NAMES = {"tiny-llama": ("LlamaForCausalLM", False), "tiny-gpt2": ("GPT2LMHeadModel", True),
         "tiny-qwen2": ("Qwen2ForCausalLM", True), "tiny-mistral": ("MistralForCausalLM", False)}


def _batch(vocab: int, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_stages_compose_to_the_model_and_its_own_loss(name: str, attention: str) -> None:
    built = hf_model(FIXTURES / name, seed=1, attention=attention)
    cls, tied = NAMES[name]
    assert built.class_name == cls and bool(built.parts.tied) is tied
    assert built.spec.num_params == built.num_params == sum(p.numel() for p in built.module.parameters())
    assert built.spec.tied_embeddings is tied
    tokens, targets = _batch(built.spec.vocab)
    stages = build_stage_modules(built.parts, num_stages=2, stages=[0, 1])
    logits = stages[1](stages[0](tokens))
    out = built.module(input_ids=tokens, labels=tokens, shift_labels=targets)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)
    torch.testing.assert_close(built.loss(logits, targets), out.loss, rtol=0, atol=0)
    if tied:  # the same Parameter on both ends, listed by each end's stage
        assert stages[0].tied_params[0] is stages[1].tied_params[0]


def test_rotary_module_is_on_every_block_and_cache_is_off() -> None:
    built = hf_model(FIXTURES / "tiny-llama", seed=0)
    rotary = {id(b.rotary) for b in built.parts.blocks}
    assert len(rotary) == 1 and None not in rotary and built.module.config.use_cache is False


def test_same_seed_same_weights_and_save_pretrained_round_trip(tmp_path: pathlib.Path) -> None:
    a, b = hf_model(FIXTURES / "tiny-gpt2", seed=5), hf_model(FIXTURES / "tiny-gpt2", seed=5)
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n
    a.module.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = hf_model(tmp_path, seed=99)  # the weights, not the seed
    assert loaded.source == str(tmp_path)
    for (n, p), (_, q) in zip(a.module.named_parameters(), loaded.module.named_parameters()):
        assert torch.equal(p, q), n


def test_unsupported_configs_are_one_line_errors(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="unknown Hugging Face model_type"):
        hf_model(tmp_path)
    with pytest.raises(ConfigError, match="attention implementation"):
        hf_model(FIXTURES / "tiny-llama", attention="flash_attention_2")
