"""Sharded data-parallel cases (issue 13): three AdamW steps of a pipeline with the distributed optimizer or
FSDP2 full sharding (optionally with tensor parallelism) give the losses and parameters of un-sharded,
un-pipelined AdamW on the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cases import Case, global_batch
from evenpipe.runtime.sharding import ShardedOptimizer
from evenpipe.runtime.stash import ActivationStash
from evenpipe.runtime.tensor_parallel import full_tensor, reference_layout
from tp_cases import grad_failures, norm_failure, run_in_layout, tp_pipeline

LR = 1e-3
EPS = 1e-6
"""AdamW's epsilon. Adam divides each gradient by its running RMS, so an element whose true gradient is ~0 (a
key bias: softmax is shift-invariant) turns last-bit reduction-order noise into a full ``lr`` step with the
default 1e-8; with 1e-6 such elements move by ``lr * noise / eps``, far below the tolerance, while every element
with a real gradient (>= 1e-5 here) still takes an Adam step."""
ADAM_TOL = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
"""Every gradient of every step (before the optimizer) against the reference's: the sharded reduction only
reorders sums."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardCase:
    case: Case
    """Schedule, pipeline ranks, replicas (dp >= 2), model."""
    sharding: str
    """``optimizer`` or ``full``."""
    tp: int = 1
    sequence_parallel: bool = False

    def __str__(self) -> str:
        return f"{self.case} TP={self.tp}{' SP' if self.sequence_parallel else ''} sharding={self.sharding}"


def run_shard_case(sc: ShardCase) -> list[str]:
    return run_in_layout(sc, sc.case, sc.tp, lambda groups: _run(sc, groups))


def _run(sc: ShardCase, groups) -> list[str]:
    case = sc.case
    pipe = tp_pipeline(case, groups, fully_shard=sc.sharding == "full", sequence_parallel=sc.sequence_parallel)
    params, ref_params = pipe.params.named, pipe.ref_params()
    if sc.sharding == "optimizer":
        opt = ShardedOptimizer(pipe.params,
                               make_optimizer=lambda ps: torch.optim.AdamW(list(ps.named.values()), lr=LR, eps=EPS),
                               dp_group=groups.dp_group, dp_ranks=groups.dp_ranks, dp_rank=groups.dp_rank)
    else:
        opt = torch.optim.AdamW(list(params.values()), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(pipe.ref.module.parameters(), lr=LR, eps=EPS)
    ex = pipe.executor(groups, ActivationStash())
    where = f"{sc} rank {groups.pp_rank}/{groups.dp_rank}/{groups.tp_rank}"
    failures: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor, **tol) -> None:
        try:
            torch.testing.assert_close(got, want, **tol)
        except AssertionError as e:
            failures.append(f"{where} {what}: {' '.join(str(e).splitlines()[:4])}")

    for step in range(3):
        tokens, targets = global_batch(case, pipe.vocab, step)
        result = ex.step(tokens, targets)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = pipe.ref_loss(tokens, targets, case.microbatches * case.dp)  # documents: per micro-batch
        ref_loss.backward()
        check(f"step {step} loss", torch.tensor(result.loss, dtype=torch.float64), ref_loss.detach().double(),
              **ADAM_TOL)
        failures += grad_failures(f"{where} step {step}", pipe, **GRAD_TOL)
        if step == 0:
            failures += norm_failure(where, pipe, groups)
        opt.step()
        ref_opt.step()
    if sc.sharding == "optimizer" and groups.dp > 1 and len(opt.owned) == len(params):
        failures.append(f"{where}: the distributed optimizer owns every parameter (state not sharded)")
    for name, p in params.items():
        check(f"parameter {name} after 3 AdamW steps", reference_layout(pipe.model.module, name, full_tensor(p.detach())),
              ref_params[name].detach(), **ADAM_TOL)
    return failures[:5]


def run_shard_cases(cases: list[ShardCase]) -> list[str]:
    out: list[str] = []
    for c in cases:
        out.extend(run_shard_case(c))
    return out


__all__ = ["ShardCase", "run_shard_case", "run_shard_cases"]
