"""Pipeline your own model with evenpipe: ``torchrun --nproc-per-node=2 examples/own_model.py``.

A small model written here (not evenpipe's), cut into first / blocks / last, trained one step with each of
1F1B, ZB-H1 and BPipe (BPipe needs at least 2 ranks); every rank checks that the pipelined loss and the gradients
of its own parameters equal those of the same model run un-pipelined on the whole batch. Exit code 0 only if all
match on every rank.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from evenpipe.pipeline import Pipeline, PipelineParts

VOCAB, WIDTH, SEQ, LAYERS = 64, 32, 12, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos[: tokens.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = Embed(), nn.ModuleList(Block() for _ in range(LAYERS)), Head()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def check(schedule: str, reference: TinyLM, tokens: torch.Tensor, targets: torch.Tensor) -> list[str]:
    model = copy.deepcopy(reference)  # same weights on every rank
    pipe = Pipeline(PipelineParts(first=model.embed, blocks=list(model.blocks), last=model.head), loss=loss_fn,
                    schedule=schedule, microbatches=4)
    result = pipe.step(tokens, targets)
    reference.zero_grad(set_to_none=True)
    ref_loss = loss_fn(reference(tokens), targets)
    ref_loss.backward()
    problems = []
    try:
        torch.testing.assert_close(torch.tensor(result.loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        problems.append(f"{schedule}: loss {result.loss} vs {ref_loss.item()}: {e}")
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    mine = {id(p) for p in pipe.parameters()}
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        try:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6)
        except (AssertionError, TypeError) as e:
            problems.append(f"{schedule}: gradient of {name}: {str(e).splitlines()[0]}")
    print(f"rank {dist.get_rank()} {schedule:6s} loss {result.loss:.6f} (un-pipelined {ref_loss.item():.6f}), "
          f"{len(mine)} parameters checked, peak activations {result.peak_activation_bytes / 1024:.1f} KiB",
          flush=True)
    return problems


def main() -> int:
    torch.manual_seed(0)
    reference = TinyLM()
    data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1], data[:, 1:]
    problems: list[str] = []
    for schedule in ("1f1b", "zb-h1", "bpipe"):
        problems += check(schedule, reference, tokens, targets)
    for p in problems:
        print(f"rank {dist.get_rank()} MISMATCH {p}", file=sys.stderr)
    failed = torch.tensor([len(problems)])
    dist.all_reduce(failed)
    dist.destroy_process_group()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
