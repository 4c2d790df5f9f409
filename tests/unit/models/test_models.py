"""Reference models: eager == sdpa, causality, pipeline parts compose to the full model, deterministic init."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from evenpipe.models import build_model, init_parameters, lm_loss, model_config
from evenpipe.models.lm import TransformerLM

MODELS = ["gpt-tiny", "llama-tiny"]


def _tokens(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_eager_and_sdpa_agree_in_loss_and_gradients(name: str) -> None:
    tokens, targets = _tokens(), _tokens(seed=2)
    results = []
    for attention in ("eager", "sdpa"):
        model = build_model(model_config(name, attention=attention), seed=3)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_e, grads_e), (loss_s, grads_s) = results
    torch.testing.assert_close(loss_e, loss_s, rtol=1e-5, atol=1e-6)
    assert grads_e.keys() == grads_s.keys()
    for n in grads_e:
        torch.testing.assert_close(grads_e[n], grads_s[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_causal_later_token_does_not_change_earlier_logits(name: str, attention: str) -> None:
    model = build_model(model_config(name, attention=attention), seed=0)
    tokens = _tokens(batch=1, seq=20)
    changed = tokens.clone()
    changed[0, 12] = (changed[0, 12] + 7) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_parts_compose_to_full_forward(name: str) -> None:
    model = build_model(model_config(name), seed=5)
    tokens = _tokens()
    parts = model.pipeline_parts()
    assert len(parts.blocks) == model.cfg.num_layers
    with torch.no_grad():
        x = parts.first(tokens)
        assert x.shape == (2, 24, model.cfg.hidden)
        for block in parts.blocks:
            x = block(x)
        logits = parts.last(x)
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
    assert logits.shape == (2, 24, 256)
    # the parts are the model's own modules: parameters are shared, not copied
    part_params = {id(p) for m in [parts.first, *parts.blocks, parts.last] for p in m.parameters()}
    assert part_params == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_init_is_deterministic_and_per_parameter(name: str) -> None:
    cfg = model_config(name)
    a, b, c = build_model(cfg, seed=7), build_model(cfg, seed=7), build_model(cfg, seed=8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.std() > 0:  # norms (ones) and biases (zeros) do not depend on the seed
            assert not torch.equal(pa, pc), n
    # initialising one block alone, under its name in the model, gives the same values as the whole model
    alone = TransformerLM(cfg).blocks[2]
    init_parameters(alone, seed=7, num_layers=cfg.num_layers, prefix="blocks.2")
    for pa, pb in zip(alone.parameters(), a.blocks[2].parameters()):
        assert torch.equal(pa, pb)
    # distinct blocks get distinct values
    assert not torch.equal(a.blocks[0].attn.qkv.weight, a.blocks[1].attn.qkv.weight)


def test_residual_projections_use_scaled_init() -> None:
    cfg = model_config("gpt-tiny", hidden=256, num_layers=8)
    model = build_model(cfg, seed=0)
    std_proj = model.blocks[0].mlp.proj.weight.std().item()
    std_fc = model.blocks[0].mlp.fc.weight.std().item()
    assert std_fc == pytest.approx(0.02, rel=0.05)
    assert std_proj == pytest.approx(0.02 / 4, rel=0.05)  # sqrt(2 * 8) = 4


def test_gqa_has_fewer_kv_parameters() -> None:
    cfg = model_config("llama-tiny")
    assert cfg.num_kv_heads < cfg.num_heads
    model = build_model(cfg, seed=0)
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params


def test_gpt_param_count_matches_formula() -> None:
    cfg = model_config("gpt-tiny")
    assert sum(p.numel() for p in build_model(cfg, seed=0).parameters()) == cfg.num_params


def test_too_long_input_is_refused() -> None:
    from evenpipe.errors import ConfigError

    model = build_model(model_config("gpt-tiny", seq_len=16), seed=0)
    with pytest.raises(ConfigError, match="17 exceeds"):
        model(_tokens(batch=1, seq=17))


def test_lm_loss_is_mean_cross_entropy() -> None:
    logits = torch.zeros(2, 3, 256)
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert lm_loss(logits, targets).item() == pytest.approx(torch.log(torch.tensor(256.0)).item())
    logits[0, 0, 0] = 100.0  # one position certain and right: mean falls by a sixth
    assert lm_loss(logits, targets).item() == pytest.approx(5 / 6 * torch.log(torch.tensor(256.0)).item(),
                                                             rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_cost_layer_parameter_count_equals_the_built_model_for_every_preset(tied: bool) -> None:
    """One model record: the cost layer's count is the torch model's ``sum(p.numel())`` for every preset, tied or
    not (built on the meta device, so even llama3-405b costs no memory)."""
    from evenpipe.cost import MODEL_PRESETS, model_preset
    from evenpipe.models import TransformerLM
    for name in MODEL_PRESETS:
        cfg = model_config(name, tied_embeddings=tied)
        with torch.device("meta"):
            model = TransformerLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params == \
            dataclasses.replace(model_preset(name), tied_embeddings=tied).num_params, name
