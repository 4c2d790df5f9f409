"""Tensor-parallel correctness cases (issue 13): a ``dp x pp x tp`` pipeline step vs. the un-pipelined,
un-sharded model on the same global batch.

Every rank builds the reference itself; each rank gathers every parameter's full gradient (``full_tensor()``
of a DTensor, in the reference layout) and compares it, and the loss, with ``assert_close`` in float32, for two
SGD steps, then the parameters after them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from cases import TIGHT, Case, global_batch, schedule_for
from harness import ran
from evenpipe.models import build_model, lm_loss, model_config
from evenpipe.runtime.comm import build_groups
from evenpipe.runtime.executor import PipelineExecutor
from evenpipe.runtime.sharding import fully_shard_stages
from evenpipe.runtime.stash import ActivationStash
from evenpipe.runtime.tensor_parallel import full_tensor, parallelize_stage, reference_layout
from evenpipe.training.optim import global_grad_norm
from evenpipe.training.params import build_rank_stages

CASE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TpCase:
    case: Case
    """Schedule, pipeline ranks, replicas, model."""
    tp: int = 2

    def __str__(self) -> str:
        return f"{self.case} TP={self.tp}"


def tp_config(name: str, num_stages: int):
    """A tiny model whose heads (4) and key/value heads (2 for LLaMA) split two ways."""
    return model_config(name, num_layers=max(2, num_stages), hidden=32, num_heads=4, seq_len=16,
                        **({"num_kv_heads": 2} if name.startswith("llama") else {}))


def run_in_layout(label: object, case: Case, tp: int, body) -> list[str]:
    """``body(groups)`` on the ranks of the case's ``dp x pp x tp`` layout (others sit it out: ``[]``), with this
    rank's proof that it ran; an exception stops this process, as the other ranks of the case are now out of
    step."""
    import torch.distributed as dist
    groups = build_groups(case.pp, case.dp, tp=tp, timeout_s=CASE_TIMEOUT_S)
    if groups is None:
        return []
    try:
        return body(groups) + [ran(f"{label} rank {groups.pp_rank}/{groups.dp_rank}/{groups.tp_rank}")]
    except Exception as e:
        raise RuntimeError(f"{label} rank {dist.get_rank()}: {type(e).__name__}: {e}\n"
                           f"{traceback.format_exc(limit=6)}") from e


def tp_pipeline(case: Case, groups, *, fully_shard: bool = False):
    """``(schedule, cfg, model, ref, stages, params, grad_sync)``: this rank's tensor-parallel (and, with
    ``fully_shard``, FSDP) stages of a fresh model, its :class:`RankParameters`, an identical un-sharded reference
    and the executor's gradient sync (None without FSDP)."""
    schedule = schedule_for(case)
    cfg = tp_config(case.model, schedule.num_stages)
    model, ref = build_model(cfg, seed=7), build_model(cfg, seed=7)
    grad_sync = []

    def prepare(mine) -> None:
        for stage in mine.values():
            parallelize_stage(stage, groups.mesh["tp"])
        if fully_shard:
            grad_sync.append(fully_shard_stages(mine.values(), groups.mesh["dp"]))
    stages, params = build_rank_stages(model, model.pipeline_parts(), schedule, groups.pp_rank, prepare=prepare)
    return schedule, cfg, model, ref, stages, params, (grad_sync or [None])[0]


def norm_failure(where: str, params, groups, ref) -> list[str]:
    """The whole model's gradient norm from this rank's (sharded) gradients vs. the reference's."""
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    got = global_grad_norm(params, groups)
    return [] if abs(got - want) <= 1e-6 * want else [f"{where}: gradient norm {got!r} != un-sharded {want!r}"]


def run_tp_case(tc: TpCase) -> list[str]:
    """Run one case on this rank; failure messages (empty when it passed or this rank sits it out)."""
    return run_in_layout(tc, tc.case, tc.tp, lambda groups: _run(tc, groups))


def _run(tc: TpCase, groups) -> list[str]:
    case = tc.case
    schedule, cfg, model, ref, stages, rank_params, _ = tp_pipeline(case, groups)
    params = rank_params.named
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # a tied weight under both names
    stash = ActivationStash()
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss, stash=stash)
    opt, ref_opt = torch.optim.SGD(list(params.values()), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    where = f"{tc} rank {groups.pp_rank}/{groups.dp_rank}/{groups.tp_rank}"
    failures: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(got, want, **TIGHT)
        except AssertionError as e:
            failures.append(f"{where} {what}: {str(e).splitlines()[0]}")

    for step in range(case.steps):
        tokens, targets = global_batch(case, cfg.vocab, step)
        result = ex.step(tokens, targets)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = lm_loss(ref(tokens), targets)
        ref_loss.backward()
        check(f"step {step} loss", torch.tensor(result.loss, dtype=torch.float64), ref_loss.detach().double())
        for name, p in params.items():
            if p.grad is None:
                failures.append(f"{where} step {step} grad {name}: no gradient")
                continue
            check(f"step {step} grad {name}", reference_layout(model, name, full_tensor(p.grad)),
                  ref_params[name].grad)
        if step == 0:
            failures += norm_failure(where, rank_params, groups, ref)
        if not stash.is_empty():
            failures.append(f"{where}: stash not empty after step {step}")
        opt.step()
        ref_opt.step()
    for name, p in params.items():
        check(f"parameter {name} after {case.steps} steps",
              reference_layout(model, name, full_tensor(p.detach())), ref_params[name].detach())
    return failures[:5]


def run_tp_cases(cases: list[TpCase]) -> list[str]:
    out: list[str] = []
    for c in cases:
        out.extend(run_tp_case(c))
    return out


__all__ = ["TpCase", "tp_config", "run_tp_case", "run_tp_cases", "run_in_layout", "tp_pipeline", "norm_failure"]
