"""Model configs: presets, overrides, Hugging Face config.json parsing, and errors for bad names."""

from __future__ import annotations

import json
import pathlib

import pytest

from evenpipe.errors import ConfigError
from evenpipe.models.config import (
    PRESETS,
    Arch,
    Attention,
    ModelConfig,
    config_from_hf,
    load_model_config,
    model_config,
    runtime_config,
)
from evenpipe.cost import model_preset


def test_published_sizes_have_published_parameter_counts() -> None:
    # billions, from the papers / model cards (GPT ties its head to the token embedding)
    assert model_config("llama-7b").num_params / 1e9 == pytest.approx(6.74, abs=0.01)
    assert model_config("llama3-8b").num_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert model_config("llama2-70b").num_params / 1e9 == pytest.approx(68.98, abs=0.01)
    assert model_config("gpt3-175b").num_params / 1e9 == pytest.approx(174.6, abs=0.2)
    assert model_config("gpt-small").num_params / 1e6 == pytest.approx(124.4, abs=0.1)  # GPT-2 small


def test_every_preset_is_valid() -> None:
    for name in PRESETS:
        cfg = model_config(name)
        assert cfg.hidden % cfg.num_heads == 0, name


def test_overrides_and_string_enums() -> None:
    cfg = model_config("gpt-tiny", attention="eager", num_layers=8, hidden=128, dropout=None)
    assert cfg.attention is Attention.EAGER and cfg.num_layers == 8
    assert cfg.ffn_hidden == 512  # rescaled with hidden
    assert model_config("GPT-TINY") == model_config("gpt-tiny")


@pytest.mark.parametrize(("call", "match"), [
    (lambda: model_config("gpt-huge"), "unknown model 'gpt-huge'; choose one of: gpt-tiny"),
    (lambda: model_config("gpt-tiny", attention="fast"), "unknown attention kernel 'fast'"),
    (lambda: model_config("gpt-tiny", arch="bert"), "unknown model architecture 'bert'"),
    (lambda: model_config("gpt-tiny", layers=3), "unknown model config field 'layers'"),
    (lambda: model_config("gpt-tiny", hidden=65), "hidden 65 is not divisible by num_heads 4"),
    (lambda: model_config("llama-tiny", num_kv_heads=3), "not divisible by num_kv_heads 3"),
    (lambda: model_config("gpt-tiny", num_kv_heads=2), "GPT uses multi-head attention"),
    (lambda: model_config("gpt-tiny", num_layers=0), "num_layers must be a positive integer, got 0"),
    (lambda: model_config("gpt-tiny", dropout=1.0), "dropout must be in"),
])
def test_bad_values_raise_config_error(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        call()


def test_enum_fields_must_be_parsed() -> None:
    fields = dict(name="x", tied_embeddings=False, num_layers=1, hidden=8, num_heads=2, num_kv_heads=2, ffn_hidden=32, vocab=16, seq_len=8)
    with pytest.raises(ConfigError, match="Arch.parse"):
        ModelConfig(arch="gpt", **fields)  # type: ignore[arg-type]


def _write(tmp_path: pathlib.Path, data: object, name: str = "config.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_hf_llama_config(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False})
    cfg = config_from_hf(tmp_path)  # a directory holding config.json works too
    assert cfg == runtime_config(model_preset("llama3-8b"), name=cfg.name)
    assert config_from_hf(path, attention="eager").attention is Attention.EAGER


def test_hf_gpt2_config(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                             "n_positions": 1024, "vocab_size": 50257, "n_inner": None})
    cfg = config_from_hf(path)
    assert cfg.arch is Arch.GPT and cfg.tied_embeddings
    assert (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.ffn_hidden, cfg.seq_len) == (12, 768, 12, 3072, 1024)
    assert cfg == runtime_config(model_preset("gpt-small"), name=cfg.name, max_positions=1024)
    assert cfg.num_params == model_config("gpt-small").num_params


def test_hf_config_without_model_type_is_recognised_by_keys(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                             "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 32})
    cfg = config_from_hf(path)
    assert cfg.arch is Arch.LLAMA and cfg.num_kv_heads == 4  # defaults to multi-head


@pytest.mark.parametrize(("data", "match"), [
    ({"model_type": "bert", "num_hidden_layers": 2}, "unknown Hugging Face model_type .* 'bert'"),
    ({"model_type": "llama", "num_attention_heads": 4}, "lacks hidden_size"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_hf_configs(tmp_path: pathlib.Path, data: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_hf(_write(tmp_path, data))


def test_missing_or_broken_hf_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_hf(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_hf(tmp_path / "bad.json")


def test_config_module_is_pure() -> None:
    import subprocess
    import sys

    code = ("import sys, builtins\nreal = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    if name.split('.')[0] == 'torch': raise ImportError('blocked')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "import importlib.util, evenpipe.errors\n"
            "spec = importlib.util.spec_from_file_location('cfg', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec); sys.modules['cfg'] = mod; spec.loader.exec_module(mod)\n"
            "print(mod.model_config('llama-7b').num_params)\n")
    src = pathlib.Path(__file__).resolve().parents[3] / "src" / "evenpipe" / "models" / "config.py"
    out = subprocess.run([sys.executable, "-c", code, str(src)], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(model_config("llama-7b").num_params)


def test_load_model_config_takes_a_name_or_a_path(tmp_path: pathlib.Path) -> None:
    assert load_model_config("llama-tiny", attention="eager") == model_config("llama-tiny", attention="eager")
    path = _write(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
                             "max_position_embeddings": 32})
    assert load_model_config(path).num_layers == 2
    assert load_model_config(tmp_path, num_layers=3).num_layers == 3
    with pytest.raises(ConfigError, match="unknown model \\(a preset name or a Hugging Face config.json path\\)"):
        load_model_config("gpt-enormous")
