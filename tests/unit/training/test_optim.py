"""Optimizer realism without processes: the learning-rate curve, the weight-decay groups, canonical names and
the ownership of a parameter two stages share."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.models import build_model, model_config
from evenpipe.schedule import build_schedule
from evenpipe.training.config import OptimizerOptions
from evenpipe.training.optim import build_lr_scheduler, build_optimizer
from evenpipe.training.params import build_rank_stages, rank_parameters


def test_warmup_then_cosine_to_min_lr() -> None:
    o = OptimizerOptions(lr=1.0, schedule="cosine", warmup_steps=4, min_lr=0.1, decay_steps=14)
    lrs = [o.lr_at(k, total_steps=100) for k in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[9], 0.1 + 0.45, rel_tol=1e-12)  # half-way down the cosine
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[14:] == [0.1] * 6


def test_scheduler_follows_the_curve() -> None:
    o = OptimizerOptions(lr=2e-3, schedule="cosine", warmup_steps=2)
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=o.lr)
    sched = build_lr_scheduler(opt, o, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([o.lr_at(k, total_steps=6) for k in range(6)], rel=1e-12)


@pytest.mark.parametrize("kw,needle", [({"min_lr": 2.0}, "--min-lr"), ({"warmup_steps": -1}, "--warmup-steps"),
                                       ({"schedule": "linear"}, "unknown learning-rate schedule"),
                                       ({"clip_grad_norm": 0.0}, "--clip-grad-norm")])
def test_bad_optimizer_options(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        OptimizerOptions(**kw)


def test_weight_decay_skips_biases_and_norm_gains() -> None:
    cfg = model_config("gpt-tiny", num_layers=2, hidden=32, num_heads=2, seq_len=16)
    model = build_model(cfg, seed=0)
    stages, params = build_rank_stages(model, model.pipeline_parts(),
                                       build_schedule("1f1b", num_ranks=1, num_microbatches=1), 0)
    opt = build_optimizer(params, OptimizerOptions(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert set(params.named) == {n for n, _ in model.named_parameters()}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # one parameter, used by the first and the last stage


def test_a_shared_parameter_is_owned_by_one_stage_only() -> None:
    m = _Tied()
    stages = {0: nn.ModuleList([m.embed]), 1: nn.ModuleList([m.head])}
    first, last = rank_parameters(m, stages, {0}), rank_parameters(m, stages, {1})
    assert list(first.named) == list(last.named) == ["embed.weight"]  # one canonical name
    assert first.owned == {"embed.weight"} and last.owned == frozenset()
