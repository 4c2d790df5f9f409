"""Split backward (zero-bubble I/W): same gradients as one full backward, and W does only the weight work."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from evenpipe.models import build_model, model_config
from evenpipe.runtime.split_backward import backward_input, backward_weight
from evenpipe.runtime.stages import build_stage_modules

HIDDEN, VOCAB, BATCH, SEQ = 64, 256, 2, 16


def _stages(name: str) -> dict[int, nn.Module]:
    """Stages 0 (embedding + 1 block), 1 (2 blocks) and 2 (1 block + head) of a tiny preset."""
    model = build_model(model_config(name), seed=0)
    return dict(build_stage_modules(model.pipeline_parts(), num_stages=3, stages=[0, 1, 2], layout=[1, 2, 1]))


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


def _full(stage: nn.Module, x: torch.Tensor, seed: Callable[[torch.Tensor], torch.Tensor]
          ) -> tuple[torch.Tensor | None, list[torch.Tensor], int]:
    """Reference: one full backward. Returns input grad, param grads and its FLOPs."""
    for p in _params(stage):
        p.grad = None
    x = x.detach().requires_grad_(x.is_floating_point())
    out = stage(x)
    with FlopCounterMode(display=False) as fc:
        torch.autograd.backward([out], [seed(out)])
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in _params(stage)]
    return x.grad, grads, fc.get_total_flops()


def _split(stage: nn.Module, x: torch.Tensor, seed: Callable[[torch.Tensor], torch.Tensor]
           ) -> tuple[torch.Tensor | None, list[torch.Tensor], int, int]:
    """I then W. Returns input grad, param grads, I's FLOPs and W's FLOPs."""
    for p in _params(stage):
        p.grad = None
    x = x.detach().requires_grad_(x.is_floating_point())
    out = stage(x)
    params = _params(stage)
    with FlopCounterMode(display=False) as fi:
        (gx,), state = backward_input([out], [seed(out)], [x], params)
    for p in params:
        assert p.grad is None, "I must not touch parameter gradients"
    with FlopCounterMode(display=False) as fw:
        backward_weight(state, params)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    return gx, grads, fi.get_total_flops(), fw.get_total_flops()


def _seeded(shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    return lambda out: g


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_middle_stage_matches_full_backward_and_w_is_cheap(name: str) -> None:
    stage = _stages(name)[1]
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    seed = _seeded((BATCH, SEQ, HIDDEN))
    ref_gx, ref_grads, full = _full(stage, x, seed)
    gx, grads, flops_i, flops_w = _split(stage, x, seed)
    assert gx is not None and ref_gx is not None
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-7)
    _close(grads, ref_grads)
    assert all(g.abs().sum() > 0 for g in grads)  # every parameter really got a gradient
    assert flops_w < 0.6 * full, (flops_i, flops_w, full)
    assert flops_i < 0.6 * full, (flops_i, flops_w, full)
    assert flops_i + flops_w <= full  # nothing is computed twice


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_first_and_last_stages_match(name: str) -> None:
    stages = _stages(name)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    # first stage: integer input, no input gradient; W is the whole backward
    seed = _seeded((BATCH, SEQ, HIDDEN))
    _, ref, _ = _full(stages[0], tokens, seed)
    gx, grads, flops_i, _ = _split(stages[0], tokens, seed)
    assert gx is None and flops_i == 0
    _close(grads, ref)
    # last stage: scalar loss seeded with one
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))

    class WithLoss(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            logits = self.inner(h)
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    last = WithLoss(stages[2])
    h = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    ref_gx, ref, _ = _full(last, h, torch.ones_like)
    gx, grads, _, _ = _split(last, h, torch.ones_like)
    assert gx is not None and ref_gx is not None
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-7)
    _close(grads, ref)


def test_w_accumulates_like_backward() -> None:
    stage = _stages("gpt-tiny")[1]
    params = _params(stage)
    xs = [torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in (5, 6)]
    gy = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(8))
    for p in params:
        p.grad = None
    for x in xs:
        stage(x.clone().requires_grad_(True)).backward(gy)
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    states = []
    for x in xs:  # both I's first, then both W's, as a zero-bubble schedule does
        xi = x.clone().requires_grad_(True)
        states.append(backward_input([stage(xi)], [gy], [xi], params)[1])
    for st in states:
        backward_weight(st, params)
    _close([p.grad for p in params], ref)


def test_weight_used_twice_along_the_input_path() -> None:
    lin = nn.Linear(8, 8)
    torch.manual_seed(0)
    x0, gy = torch.randn(4, 8), torch.randn(4, 8)
    x = x0.clone().requires_grad_(True)
    torch.tanh(lin(torch.tanh(lin(x)))).backward(gy)
    ref_gx, ref = x.grad, [p.grad.clone() for p in lin.parameters()]
    for p in lin.parameters():
        p.grad = None
    x = x0.clone().requires_grad_(True)
    (gx,), state = backward_input([torch.tanh(lin(torch.tanh(lin(x))))], [gy], [x], list(lin.parameters()))
    backward_weight(state, list(lin.parameters()))
    assert gx is not None and ref_gx is not None
    torch.testing.assert_close(gx, ref_gx)
    _close([p.grad for p in lin.parameters()], ref)
