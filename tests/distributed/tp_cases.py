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

from cases import TIGHT, Case, case_model, global_batch, recompute_selectively, reference_loss, schedule_for
from harness import ran
from evenpipe.models import model_config
from evenpipe.models.adapter import PipelineModel, reference_model
from evenpipe.runtime.comm import build_groups
from evenpipe.runtime.executor import PipelineExecutor
from evenpipe.runtime.sharding import fully_shard_stages
from evenpipe.runtime.stash import ActivationStash
from evenpipe.runtime.tensor_parallel import full_tensor, parallelize_stage, reference_layout
from evenpipe.training.optim import global_grad_norm
from evenpipe.schedule.ir import Schedule
from evenpipe.training.params import RankParameters, build_rank_stages

CASE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TpCase:
    case: Case
    """Schedule, pipeline ranks, replicas, model."""
    tp: int = 2
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (norms and boundaries sharded over the sequence)."""

    def __str__(self) -> str:
        return f"{self.case} TP={self.tp}" + (" SP" if self.sequence_parallel else "")


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


@dataclass(slots=True, kw_only=True)
class TpPipeline:
    """This rank's tensor-parallel (maybe FSDP) pipeline of a fresh model and an identical un-sharded reference."""

    schedule: Schedule
    model: PipelineModel
    ref: PipelineModel
    stages: dict
    params: RankParameters
    grad_sync: object
    """The executor's gradient sync (None without FSDP)."""

    @property
    def vocab(self) -> int:
        return self.model.spec.vocab

    def ref_loss(self, tokens: torch.Tensor, targets: torch.Tensor, num_chunks: int = 1) -> torch.Tensor:
        return reference_loss(self.ref, tokens, targets, num_chunks)

    def ref_params(self) -> dict:
        """The reference's parameters by name (a tied weight under both names)."""
        return dict(self.ref.module.named_parameters(remove_duplicate=False))

    def executor(self, groups, stash) -> PipelineExecutor:
        return PipelineExecutor(schedule=self.schedule, stages=self.stages, groups=groups, loss_fn=self.model.loss,
                                stash=stash, grad_sync=self.grad_sync)


def _model(name: str, num_stages: int) -> PipelineModel:
    """A Hugging Face fixture (``hf:NAME``), or a reference model with heads that split two ways."""
    if name.startswith("hf:"):
        return case_model(name, num_stages, seed=7)
    return reference_model(tp_config(name, num_stages), seed=7)


def tp_pipeline(case: Case, groups, *, fully_shard: bool = False, sequence_parallel: bool = False) -> TpPipeline:
    """This rank's stages of the case's model, tensor parallel over the mesh's ``tp`` dimension (and the
    sequence with ``sequence_parallel``) and, with ``fully_shard``, FSDP over ``dp``."""
    schedule = schedule_for(case)
    model, ref = _model(case.model, schedule.num_stages), _model(case.model, schedule.num_stages)
    grad_sync = []

    def prepare(mine) -> None:
        for stage in mine.values():
            parallelize_stage(stage, groups.mesh["tp"], sequence_parallel=sequence_parallel)
        if fully_shard:
            grad_sync.append(fully_shard_stages(mine.values(), groups.mesh["dp"]))
    stages, params = build_rank_stages(model.module, model.parts, schedule, groups.pp_rank, prepare=prepare)
    for stage in stages.values():
        stage.packed = case.packed
    recompute_selectively(case, stages)
    return TpPipeline(schedule=schedule, model=model, ref=ref, stages=stages, params=params,
                      grad_sync=(grad_sync or [None])[0])


def norm_failure(where: str, pipe: TpPipeline, groups) -> list[str]:
    """The whole model's gradient norm from this rank's (sharded) gradients vs. the reference's."""
    want = float(torch.nn.utils.clip_grad_norm_(pipe.ref.module.parameters(), float("inf")))
    got = global_grad_norm(pipe.params, groups)
    return [] if abs(got - want) <= 1e-6 * want else [f"{where}: gradient norm {got!r} != un-sharded {want!r}"]


def grad_failures(where: str, pipe: TpPipeline, **tol) -> list[str]:
    """Every parameter's full gradient (gathered over tensor parallelism and FSDP, in the reference layout) vs.
    the reference's, after a step of both."""
    module, ref_params = pipe.model.module, pipe.ref_params()
    failures = []
    for name, p in pipe.params.named.items():
        if p.grad is None:
            failures.append(f"{where} grad {name}: no gradient")
            continue
        try:
            torch.testing.assert_close(reference_layout(module, name, full_tensor(p.grad)), ref_params[name].grad,
                                       **tol)
        except AssertionError as e:
            failures.append(f"{where} grad {name}: {str(e).splitlines()[0]}")
    return failures


def run_tp_case(tc: TpCase) -> list[str]:
    """Run one case on this rank; failure messages (empty when it passed or this rank sits it out)."""
    return run_in_layout(tc, tc.case, tc.tp, lambda groups: _run(tc, groups))


def _run(tc: TpCase, groups) -> list[str]:
    case = tc.case
    pipe = tp_pipeline(case, groups, sequence_parallel=tc.sequence_parallel)
    params, ref_params, module = pipe.params.named, pipe.ref_params(), pipe.model.module
    stash = ActivationStash()
    ex = pipe.executor(groups, stash)
    opt = torch.optim.SGD(list(params.values()), lr=0.5)
    ref_opt = torch.optim.SGD(pipe.ref.module.parameters(), lr=0.5)
    where = f"{tc} rank {groups.pp_rank}/{groups.dp_rank}/{groups.tp_rank}"
    failures: list[str] = []
    from torch.distributed.tensor import DTensor
    split = [n for n, p in params.items() if isinstance(p, DTensor)]
    if tc.tp > 1 and not split:
        failures.append(f"{where}: no parameter is split over tensor parallelism")

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(got, want, **TIGHT)
        except AssertionError as e:
            failures.append(f"{where} {what}: {str(e).splitlines()[0]}")

    for step in range(case.steps):
        tokens, targets = global_batch(case, pipe.vocab, step)
        result = ex.step(tokens, targets)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = pipe.ref_loss(tokens, targets, case.microbatches * case.dp)
        ref_loss.backward()
        check(f"step {step} loss", torch.tensor(result.loss, dtype=torch.float64), ref_loss.detach().double())
        failures += grad_failures(f"{where} step {step}", pipe, **TIGHT)
        if step == 0:
            failures += norm_failure(where, pipe, groups)
        if not stash.is_empty():
            failures.append(f"{where}: stash not empty after step {step}")
        opt.step()
        ref_opt.step()
    for name, p in params.items():
        check(f"parameter {name} after {case.steps} steps",
              reference_layout(module, name, full_tensor(p.detach())), ref_params[name].detach())
    return failures[:5]


def run_tp_cases(cases: list[TpCase]) -> list[str]:
    out: list[str] = []
    for c in cases:
        out.extend(run_tp_case(c))
    return out


__all__ = ["TpCase", "tp_config", "run_tp_case", "run_tp_cases", "run_in_layout", "tp_pipeline", "TpPipeline", "norm_failure",
           "grad_failures"]
