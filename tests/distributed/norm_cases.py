"""Gradient clipping by the whole model's norm, run inside the shared 4-rank correctness world: the pipelined
global norm equals the un-pipelined model's (``torch.nn.utils.clip_grad_norm_``), and clipping scales every
rank's gradients so the whole model's norm becomes the limit.

Layouts: interleaved P=4 V=2 (a rank holds two stages, the embedding and head on different ranks) and 1F1B P=2
with DP=2 (replicas must not be counted twice).
"""

from __future__ import annotations

import torch

from cases import Case, global_batch, schedule_for, tiny_config
from evenpipe.models import build_model, lm_loss
from evenpipe.runtime.comm import build_groups
from evenpipe.runtime.executor import PipelineExecutor
from evenpipe.training.optim import clip_grad_global_norm, global_grad_norm
from evenpipe.training.params import build_rank_stages

NORM_CASES = [Case(family="interleaved", pp=4, chunks=2, microbatches=4),
              Case(family="1f1b", pp=2, dp=2, microbatches=2)]
REL = 1e-6


def norm_label(case: Case) -> str:
    return f"global-norm {case}"


def grad_norm_checks() -> list[str]:
    failures: list[str] = []
    for case in NORM_CASES:
        groups = build_groups(case.pp, case.dp, timeout_s=30.0)
        if groups is not None:
            failures += _check(case, groups)
    return failures


def _check(case: Case, groups) -> list[str]:
    schedule = schedule_for(case)
    cfg = tiny_config(case.model, schedule.num_stages)
    model, ref = build_model(cfg, seed=11), build_model(cfg, seed=11)
    stages, params = build_rank_stages(model, model.pipeline_parts(), schedule, groups.pp_rank)
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss)
    tokens, targets = global_batch(case, cfg.vocab, 0)
    ex.step(tokens, targets)
    lm_loss(ref(tokens), targets).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    got = global_grad_norm(params, groups)
    label = f"{norm_label(case)} rank {groups.pp_rank}/{groups.dp_rank}"
    failures = [] if abs(got - want) <= REL * want else [f"{label}: norm {got!r} != un-pipelined {want!r}"]
    before = clip_grad_global_norm(params, groups, want / 4)
    after = global_grad_norm(params, groups)
    if before != got or abs(after - want / 4) > 1e-5 * want:
        failures.append(f"{label}: clipping to {want / 4!r} left a norm of {after!r} (before {before!r})")
    return failures
