"""Model presets, parameter counts and Hugging Face config loading."""

from __future__ import annotations

import json
import pathlib

import pytest

from evenpipe.cost import MODEL_PRESETS, Arch, ModelSpec, from_hf_config, model_preset
from evenpipe.errors import ConfigError

REQUIRED = ["gpt-1.7b", "gpt-3.6b", "gpt-7.5b", "gpt-18.4b", "gpt-39.1b", "gpt-76.1b", "gpt-145.6b", "gpt-310.1b",
            "gpt-529.6b", "gpt-1t", "gpt3-175b", "llama-7b", "llama-13b", "llama-33b", "llama-65b", "llama2-7b",
            "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b"]


def test_every_required_preset_exists() -> None:
    assert set(REQUIRED) <= set(MODEL_PRESETS)


@pytest.mark.parametrize("name,billions", [
    ("llama-7b", 6.74), ("llama-13b", 13.02), ("llama-65b", 65.29), ("llama2-70b", 68.98), ("llama3-8b", 8.03),
    ("llama3-70b", 70.55), ("llama3-405b", 405.85), ("gpt3-175b", 174.6), ("gpt-1t", 1008.0), ("gpt-145.6b", 145.6),
])
def test_parameter_counts_match_published_sizes(name: str, billions: float) -> None:
    assert model_preset(name).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_gpt_layer_is_twelve_h_squared_without_vectors() -> None:
    m = model_preset("gpt3-175b")
    assert m.matrix_params_per_layer == 12 * m.hidden ** 2
    assert m.params_per_layer == 12 * m.hidden ** 2 + 13 * m.hidden


def test_unknown_preset_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError) as e:
        model_preset("gpt-5")
    msg = str(e.value)
    assert "'gpt-5'" in msg and "llama2-70b" in msg and "\n" not in msg


def test_preset_lookup_is_case_insensitive() -> None:
    assert model_preset("LLaMA2-70B") is MODEL_PRESETS["llama2-70b"]


def test_spec_rejects_heads_not_dividing_hidden() -> None:
    with pytest.raises(ConfigError, match="hidden 1000"):
        ModelSpec(name="x", arch=Arch.GPT, num_layers=2, hidden=1000, num_heads=3, num_kv_heads=3, ffn_hidden=4000,
                  vocab=10, seq_len=8, tied_embeddings=True)


def test_from_hf_config_llama(tmp_path: pathlib.Path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
           "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 32000, "max_position_embeddings": 4096,
           "hidden_act": "silu", "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = from_hf_config(path)
    ref = model_preset("llama2-70b")
    assert spec.arch is Arch.LLAMA
    assert spec.num_params == ref.num_params
    assert (spec.num_kv_heads, spec.seq_len, spec.tied_embeddings) == (8, 4096, False)


def test_from_hf_config_gpt2(tmp_path: pathlib.Path) -> None:
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "vocab_size": 50257,
           "n_positions": 1024, "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = from_hf_config(path)
    assert spec.arch is Arch.GPT and spec.tied_embeddings
    assert spec.ffn_hidden == 4 * 768
    assert spec.num_params == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small


def test_from_hf_config_gpt_neox(tmp_path: pathlib.Path) -> None:
    cfg = {"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
           "num_hidden_layers": 6, "vocab_size": 50304, "max_position_embeddings": 2048, "hidden_act": "gelu",
           "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = from_hf_config(path)
    assert spec.arch is Arch.GPT and not spec.tied_embeddings and spec.num_layers == 6


def test_from_hf_config_errors_name_the_problem(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        from_hf_config(bad)
