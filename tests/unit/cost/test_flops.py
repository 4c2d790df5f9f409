"""FLOP counts against Narayanan et al. 2021's closed forms."""

from __future__ import annotations

import pytest

from evenpipe.cost import ParallelConfig, Recompute, executed_flops_per_step, model_flops_per_step, model_preset
from evenpipe.cost.flops import layer_forward_flops


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt3-175b", "gpt-1t"])
def test_model_flops_is_megatrons_72_formula(name: str) -> None:
    m = model_preset(name)
    B, s, L, h, V = 512, m.seq_len, m.num_layers, m.hidden, m.vocab
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops_per_step(m, B) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt3-175b", "gpt-1t"])
def test_full_recompute_flops_is_megatrons_96_formula(name: str) -> None:
    m = model_preset(name)
    B, s, L, h, V = 1536, m.seq_len, m.num_layers, m.hidden, m.vocab
    expected = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    cfg = ParallelConfig(global_batch=B, recompute=Recompute.FULL)
    assert executed_flops_per_step(m, cfg) == pytest.approx(expected, rel=1e-12)


def test_selective_adds_only_the_attention_core() -> None:
    m = model_preset("gpt3-175b")
    none = executed_flops_per_step(m, ParallelConfig(global_batch=8))
    sel = executed_flops_per_step(m, ParallelConfig(global_batch=8, recompute=Recompute.SELECTIVE))
    assert none == model_flops_per_step(m, 8)
    assert sel - none == pytest.approx(8 * 4 * m.seq_len ** 2 * m.hidden * m.num_layers, rel=1e-12)


def test_layer_flops_split_evenly_over_tensor_ranks() -> None:
    m = model_preset("llama2-70b")  # 8 KV heads: K and V split over tp <= 8
    one = layer_forward_flops(m, tp=1, microbatch_size=2)
    assert layer_forward_flops(m, tp=8, microbatch_size=2) * 8 == pytest.approx(one, rel=1e-12)
    s = m.seq_len
    assert one == pytest.approx(2 * 2 * s * m.matrix_params_per_layer + 4 * 2 * s * s * m.hidden, rel=1e-12)
