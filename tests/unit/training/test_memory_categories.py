"""Memory by category: model-state bytes counted from the tensors a rank holds, and the per-rank fold."""

from __future__ import annotations

import torch
from torch import nn

from evenpipe.cost.categories import MEMORY_CATEGORIES
from evenpipe.runtime.precision import MasterWeightOptimizer
from evenpipe.training.memory import state_bytes
from evenpipe.training.summary import RankReport, summarise


def _step(params: list[nn.Parameter], opt: object) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # type: ignore[attr-defined]


def test_float32_adamw_counts_params_grads_and_two_moments() -> None:
    model = nn.Linear(8, 4)  # 36 parameters
    params = list(model.parameters())
    opt = torch.optim.AdamW(params)
    _step(params, opt)
    assert state_bytes(params, opt) == {"parameters": 144, "gradients": 144, "master_weights": 0,
                                        "optimizer_state": 288}


def test_bfloat16_keeps_fp32_masters_their_grads_and_moments() -> None:
    model = nn.Linear(8, 4).to(torch.bfloat16)
    params = list(model.parameters())
    opt = MasterWeightOptimizer(torch.optim.AdamW, params)
    _step(params, opt)
    # bf16 weights and grads 2 B each, fp32 masters 4 B and their fp32 grads 4 B, two fp32 moments 8 B
    assert state_bytes(params, opt) == {"parameters": 72, "gradients": 72 + 144, "master_weights": 144,
                                        "optimizer_state": 288}


def _report(pp: int, dp: int, tp: int, states: int, act: int) -> RankReport:
    cats = dict.fromkeys(MEMORY_CATEGORIES, act) | {"parameters": states, "optimizer_state": states}
    return RankReport(pp_rank=pp, dp_rank=dp, tp_rank=tp, peak_bytes_by_category=cats, peak_own_bytes=0,
                      peak_hosted_bytes=0, peak_activation_bytes=0, evicted_bytes_per_step=0, peak_rss_bytes=0,
                      step_times_s=(1.0,))


def test_states_are_the_mean_over_replicas_activations_the_max() -> None:
    reports = [_report(0, 0, 0, 100, 5), _report(0, 1, 0, 60, 7), _report(1, 0, 0, 10, 1),
               _report(1, 1, 0, 20, 1), _report(1, 0, 1, 40, 3), _report(1, 1, 1, 40, 2)]
    s = summarise(reports, [1.0], [1.0], num_ranks=2, first_step=0, tokens_per_step=1)
    assert [c["optimizer_state"] for c in s.peak_bytes_by_category] == [80, 40]
    assert [c["own_activations"] for c in s.peak_bytes_by_category] == [7, 3]
    assert s.to_dict()["peak_bytes_by_category"][0]["parameters"] == 80
