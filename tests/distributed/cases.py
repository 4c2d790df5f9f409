"""Correctness cases run inside one gloo world: pipeline step vs. a single-process reference on the same batch.

Every rank of the world builds the same tiny model from the same seed, computes the un-pipelined reference
(loss, every gradient, parameters after two SGD steps) itself, and compares with what its own stages got from
the pipeline. Ranks outside a case's ``pp x dp`` layout skip it (but still join group creation).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch

from evenpipe.models import build_model, lm_loss, model_config
from evenpipe.models.adapter import PipelineModel, reference_model
from evenpipe.models.recompute import set_selective_recompute
from evenpipe.runtime.comm import build_groups
from evenpipe.runtime.emulation import RankEmulation
from evenpipe.runtime.executor import PipelineExecutor
from evenpipe.runtime.stages import build_stage_modules
from evenpipe.runtime.stash import ActivationStash
from evenpipe.schedule.ir import Schedule
from evenpipe.training.config import Recompute, parse_recompute
from harness import failures_only, missing_runs, ran

MICROBATCH = 2
CASE_TIMEOUT_S = 30.0
SEQ = 16
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    family: str
    """Schedule family name."""
    pp: int
    microbatches: int
    dp: int = 1
    chunks: int = 1
    model: str = "gpt-tiny"
    """A reference preset, or ``hf:NAME`` for the Hugging Face fixture ``tests/fixtures/hf/NAME``."""
    recompute: bool | str = False
    """Full recomputation of every stage (True), or ``train --recompute``'s text: one mode or one per stage."""
    free_outputs: bool = True
    bpipe_budget: int | None = None
    steps: int = 2
    text: str | None = None
    """Hand-written schedule text instead of the generator."""
    adam: bool = False
    """AdamW instead of SGD (loss trajectories)."""
    bpipe: bool = False
    """Apply the BPipe transform to the family (``--bpipe``)."""
    documents: bool = False
    """Packed rows of several documents (attention kept inside each, padding ignored), boundaries carried by the
    stages' activations (``StageModule.packed_forward``)."""
    varlen: str | None = None
    """Documents of mixed lengths grouped by this micro-batching policy (pad, pack, balance), each micro-batch
    as long as its longest row (:func:`varlen_batch`); implies ``documents``."""
    offload: str | None = None
    """Host offload on these pipeline ranks, as ``train --offload`` takes them (``all``, ``0-1``)."""
    link_delay_ms: float = 0.0
    """Every link between pipeline ranks emulated this slow (``train --emulate-link-delay``) in every step."""

    @property
    def packed(self) -> bool:
        """Stages carry document boundaries in their activations."""
        return self.documents or self.varlen is not None

    def __str__(self) -> str:
        rec = f" R={self.recompute}" if isinstance(self.recompute, str) else " R" if self.recompute else ""
        extra = "".join([f" V={self.chunks}" if self.chunks > 1 else "", rec,
                         "" if self.free_outputs else " keep-outputs",
                         f" K={self.bpipe_budget}" if self.bpipe_budget else "",
                         f" steps={self.steps}" if self.steps != 2 else "", " adamw" if self.adam else "",
                         " +bpipe" if self.bpipe else "",
                         f" varlen-{self.varlen}" if self.varlen else " documents" if self.documents else "",
                         f" offload={self.offload}" if self.offload else "",
                         f" link+{self.link_delay_ms:g}ms" if self.link_delay_ms else ""])
        return f"{self.family} {self.model} P={self.pp} M={self.microbatches} DP={self.dp}{extra}"


def recompute_modes(case: Case, num_stages: int) -> tuple[Recompute, ...]:
    """The case's recomputation mode of each stage."""
    return parse_recompute(case.recompute, num_stages)


def recompute_selectively(case: Case, stages) -> None:
    """Switch on selective recomputation in this rank's stages that the case names."""
    modes = recompute_modes(case, case.pp * case.chunks)
    for s, stage in stages.items():
        if modes[s] is Recompute.SELECTIVE:
            assert set_selective_recompute(stage) == len(stage.blocks), f"stage {s}: not every block switched"


def schedule_for(case: Case) -> Schedule:
    if case.text is not None:
        return Schedule.from_text(case.text)
    from evenpipe.schedule import build_schedule
    recompute = case.recompute if isinstance(case.recompute, bool) else [
        s for s, r in enumerate(recompute_modes(case, case.pp * case.chunks)) if r is Recompute.FULL]
    from evenpipe.schedule.rank_set import parse_rank_set
    offload = parse_rank_set(case.offload, option="offload", num_ranks=case.pp) if case.offload else frozenset()
    return build_schedule(case.family, num_ranks=case.pp, num_microbatches=case.microbatches,
                          num_chunks=case.chunks, bpipe_budget=case.bpipe_budget, recompute=recompute,
                          bpipe=case.bpipe, offload_ranks=offload)


def tiny_config(name: str, num_stages: int):
    return model_config(name, num_layers=max(2, num_stages), hidden=32, num_heads=2, seq_len=SEQ,
                        **({"num_kv_heads": 1} if name.startswith("llama") else {}))


HF_FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
_HF_TMP: list[pathlib.Path] = []


def case_model(name: str, num_stages: int, *, seed: int = 7) -> PipelineModel:
    """The case's model: a tiny reference config, or a Hugging Face fixture deepened to ``num_stages`` layers."""
    if not name.startswith("hf:"):
        return reference_model(tiny_config(name, num_stages), seed=seed)
    from evenpipe.models.hf import hf_model
    raw = json.loads((HF_FIXTURES / name[3:] / "config.json").read_text())
    key = "n_layer" if "n_layer" in raw else "num_hidden_layers"
    raw[key] = max(raw[key], num_stages)
    if not _HF_TMP:
        _HF_TMP.append(pathlib.Path(tempfile.mkdtemp(prefix="evenpipe-hf-")))
    path = _HF_TMP[0] / f"{name[3:]}-{raw[key]}.json"
    path.write_text(json.dumps(raw))
    return hf_model(path, seed=seed, attention="eager")


def reference_loss(model: PipelineModel, tokens: torch.Tensor, targets: torch.Tensor,
                   num_chunks: int = 1) -> torch.Tensor:
    """The un-pipelined loss as the model itself computes it (Hugging Face: its forward with labels); packed
    documents (``tokens`` ``[n, 2, T]``): the mean over the ``num_chunks`` micro-batches of each one's mean."""
    if isinstance(tokens, list):  # micro-batches of their own lengths: each padded to SEQ, then as above
        tokens, targets = _padded_to_seq(tokens, targets)
    if tokens.dim() == 3:
        from evenpipe.models.documents import Documents
        return torch.stack([lm_loss(model.module(t[:, 0], Documents(t[:, 1])), y)
                            for t, y in zip(tokens.chunk(num_chunks), targets.chunk(num_chunks))]).mean()
    if model.class_name == "TransformerLM":
        return lm_loss(model.module(tokens), targets)
    return model.module(input_ids=tokens, labels=tokens, shift_labels=targets).loss


def tied_weights_check(case: Case, groups, stages, schedule: Schedule) -> list[str]:
    """Tied weights held by the first and the last pipeline rank are bitwise identical (nothing to compare
    when one rank holds both ends, as a V placement does)."""
    import torch.distributed as dist
    tied = [p for m in stages.values() for p in m.tied_params]
    if schedule.rank_of(0) == schedule.rank_of(schedule.num_stages - 1):
        return []
    if groups.embedding_group is None or not tied or groups.pp_rank not in (0, groups.pp - 1):
        return []
    out = []
    for w in {id(p): p for p in tied}.values():
        both = [torch.empty_like(w) for _ in range(2)]
        dist.all_gather(both, w.detach().contiguous(), group=groups.embedding_group)
        if not torch.equal(both[0], both[1]):
            out.append(f"{case} rank {groups.pp_rank}: tied weight differs between first and last stage "
                       f"(max diff {(both[0] - both[1]).abs().max().item():.3g})")
    return out


def packed_batch(n: int, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of 1 to several random documents each, some rows ending in padding: ``[n, 2, SEQ]`` tokens and
    document ids, ``[n, SEQ]`` targets (-100 on padding)."""
    from evenpipe.runtime.document_batches import pack_rows
    g = torch.Generator().manual_seed(2000 + step)
    rows = []
    for _ in range(n):
        docs: list = []
        used = 0
        while used < SEQ and not (docs and float(torch.rand(1, generator=g)) < 0.2):
            k = int(torch.randint(1, SEQ - used + 1, (1,), generator=g))  # positions; k + 1 tokens
            docs.append(torch.randint(0, vocab, (k + 1,), generator=g).numpy())
            used += k
        rows.append(docs)
    batch = pack_rows(rows, SEQ)
    return batch.tokens, batch.targets


VARLEN_MULTIPLE = 4
"""Micro-batch lengths of the variable-length cases are multiples of this (4, 8, 12 or 16 positions)."""


def varlen_batch(case: Case, vocab: int, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Documents of 2 to SEQ + 1 tokens (most short, some a whole row) grouped by ``case.varlen`` into the
    step's ``dp x M`` micro-batches of :data:`MICROBATCH` rows, each micro-batch as long as its longest row
    rounded up to :data:`VARLEN_MULTIPLE` (:func:`evenpipe.runtime.document_batches.planned_microbatches`)."""
    from evenpipe.plan.microbatch import MicrobatchBudget, MicrobatchCost, first_fit_prefix, plan_microbatches
    from evenpipe.runtime.document_batches import planned_microbatches
    g = torch.Generator().manual_seed(3000 + step)
    lengths = [int(min(SEQ + 1, 2 + torch.empty(1).exponential_(1 / 6, generator=g))) for _ in range(200)]
    count = case.dp * case.microbatches
    budget = MicrobatchBudget(row_len=SEQ, rows=MICROBATCH)
    if case.varlen == "pad":
        take = count * MICROBATCH
    else:  # odd steps take a third of what fits: part-filled rows, so lengths vary (new ones appear mid-run)
        take = first_fit_prefix((n - 1 for n in lengths), budget, count)
        take = max(count, take // 3) if step % 2 else take
    docs = [torch.randint(0, vocab, (n,), generator=g).numpy() for n in lengths[:take]]
    plan = plan_microbatches([n - 1 for n in lengths[:take]], policy=case.varlen or "pack", budget=budget,
                             cost=MicrobatchCost(per_token=1.0, per_square=1.0 / SEQ), num_replicas=case.dp,
                             num_microbatches=case.microbatches)
    batch = planned_microbatches(plan, docs, rows=MICROBATCH, seq_len=SEQ, multiple=VARLEN_MULTIPLE)
    return batch.tokens, batch.targets


def _padded_to_seq(tokens: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batches of their own lengths as one ``[n, 2, SEQ]`` batch: each row's tail a padding run of its own
    (a document id after the row's last), ignored targets."""
    out_t, out_y = [], []
    for t, y in zip(tokens, targets):
        extra = SEQ - t.shape[-1]
        ids = torch.cat([t[:, 1], (t[:, 1, -1:] + 1).expand(-1, extra)], dim=1)
        out_t.append(torch.stack([torch.nn.functional.pad(t[:, 0], (0, extra)), ids], dim=1))
        out_y.append(torch.nn.functional.pad(y, (0, extra), value=-100))
    return torch.cat(out_t), torch.cat(out_y)


def global_batch(case: Case, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = MICROBATCH * case.microbatches * case.dp
    if case.varlen:
        return varlen_batch(case, vocab, step)  # type: ignore[return-value]
    if case.documents:
        return packed_batch(n, vocab, step)
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def run_case(case: Case, *, stash_factory=None) -> list[str]:
    """Run one case on this rank; returns failure messages (empty if it passed or this rank sits it out)."""
    import torch.distributed as dist
    groups = build_groups(case.pp, case.dp, timeout_s=CASE_TIMEOUT_S)
    if groups is None:
        return []
    try:
        return _run(case, groups, stash_factory) + [ran(f"{case} rank {groups.pp_rank}/{groups.dp_rank}")]
    except Exception as e:  # fatal: the other ranks of the case are now out of step, so stop this process
        raise RuntimeError(f"{case} rank {dist.get_rank()}: {type(e).__name__}: {e}\n"
                           f"{traceback.format_exc(limit=4)}") from e


def _run(case: Case, groups, stash_factory) -> list[str]:
    schedule = schedule_for(case)
    built, ref_built = case_model(case.model, schedule.num_stages), case_model(case.model, schedule.num_stages)
    ref = ref_built.module
    names = {id(p): n for n, p in built.module.named_parameters()}
    ref_params = dict(ref.named_parameters())
    mine = schedule.stages_of(groups.pp_rank)
    stages = build_stage_modules(built.parts, num_stages=schedule.num_stages, stages=mine)
    for stage in stages.values():
        stage.packed = case.packed
    recompute_selectively(case, stages)
    stash = (stash_factory or ActivationStash)()
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=built.loss,
                          free_outputs=case.free_outputs, stash=stash)
    if case.link_delay_ms:
        ex.emulation = RankEmulation(1.0, {q: case.link_delay_ms / 1e3 for q in range(case.pp) if q != groups.pp_rank})
    params = list({id(p): p for s in stages.values() for p in s.parameters()}.values())
    if case.adam:
        opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    else:
        opt, ref_opt = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    failures: list[str] = []
    for step in range(case.steps):
        tokens, targets = global_batch(case, built.spec.vocab, step)
        result = ex.step(tokens, targets)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = reference_loss(ref_built, tokens, targets, case.microbatches * case.dp)
        ref_loss.backward()
        try:
            torch.testing.assert_close(torch.tensor(result.loss, dtype=torch.float64), ref_loss.detach().double(), **TIGHT)
        except AssertionError as e:
            failures.append(f"{case} rank {groups.pp_rank}/{groups.dp_rank} step {step} loss: {e}")
        for p in params if not (case.adam and step > 0) else []:  # AdamW amplifies last-bit differences
            r = ref_params[names[id(p)]]
            try:
                assert p.grad is not None, "no gradient"
                torch.testing.assert_close(p.grad, r.grad, **TIGHT)
            except AssertionError as e:
                failures.append(f"{case} rank {groups.pp_rank}/{groups.dp_rank} step {step} grad "
                                f"{names[id(p)]}: {str(e).splitlines()[0]}")
        if not stash.is_empty():
            failures.append(f"{case} rank {groups.pp_rank}: stash not empty after step {step}")
        opt.step()
        ref_opt.step()
    for p in params if not case.adam else []:  # AdamW trajectories: the per-step losses are the check
        try:
            torch.testing.assert_close(p.detach(), ref_params[names[id(p)]].detach(), **TIGHT)
        except AssertionError as e:
            failures.append(f"{case} rank {groups.pp_rank}: parameter {names[id(p)]} after "
                            f"{case.steps} steps: {str(e).splitlines()[0]}")
    failures += tied_weights_check(case, groups, stages, schedule)
    return failures[:5]


def free_outputs_check() -> list[str]:
    """1F1B P=2 M=4: freeing sent outputs lowers the measured peak and changes no gradient (bitwise)."""
    import torch.distributed as dist
    groups = build_groups(2, 1, timeout_s=CASE_TIMEOUT_S)
    if groups is None:
        return []
    got = {}
    for free in (True, False):
        case = Case(family="1f1b", pp=2, microbatches=4, free_outputs=free)
        schedule = schedule_for(case)
        cfg = tiny_config(case.model, 2)
        model = build_model(cfg, seed=7)
        stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=schedule.stages_of(groups.pp_rank))
        stash = ActivationStash()
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss,
                              free_outputs=free, stash=stash)
        tokens, targets = global_batch(case, cfg.vocab, 0)
        res = ex.step(tokens, targets)
        got[free] = (res.peak_activation_bytes, [p.grad.clone() for s in stages.values() for p in s.parameters()])
    out = []
    rank = dist.get_rank()
    if groups.pp_rank == 0 and not got[True][0] < got[False][0]:
        out.append(f"free-outputs rank 0: peak {got[True][0]} B with freeing, {got[False][0]} B without")
    if not all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1])):
        out.append(f"free-outputs rank {rank}: gradients differ when outputs are freed")
    return out + [ran(f"free-outputs rank {rank}")]


def offload_schedule(family: str, pp: int, microbatches: int, ranks: set[int] | None = None) -> Schedule:
    """``family`` with every micro-batch's activations offloaded to host memory after its forward."""
    from evenpipe.schedule import ScheduleFamily, add_offload, compute_order, derive_communication, validate
    compute = compute_order(ScheduleFamily.parse(family), num_ranks=pp, num_microbatches=microbatches)
    full = derive_communication(add_offload(compute, ranks=ranks))
    validate(full)
    return full


def offload_check() -> list[str]:
    """1F1B P=2 M=4 with OFFLOAD/RELOAD on rank 0: the saved activations really leave the stash (rank 0's
    measured peak drops to one micro-batch's) and come back with gradients equal (bitwise) to the plain run's."""
    groups = build_groups(2, 1, timeout_s=CASE_TIMEOUT_S)
    if groups is None:
        return []
    case = Case(family="1f1b", pp=2, microbatches=4)
    got = {}
    for offload in (True, False):
        schedule = offload_schedule("1f1b", 2, 4, ranks={0}) if offload else schedule_for(case)
        cfg = tiny_config(case.model, 2)
        model = build_model(cfg, seed=7)
        stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=schedule.stages_of(groups.pp_rank))
        stash = ActivationStash()
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss, stash=stash)
        tokens, targets = global_batch(case, cfg.vocab, 0)
        res = ex.step(tokens, targets)
        got[offload] = (res.peak_own_bytes, [p.grad.clone() for s in stages.values() for p in s.parameters()],
                        stash.is_empty())
    out = []
    rank = groups.pp_rank
    if rank == 0 and not got[True][0] * 1.5 < got[False][0]:
        out.append(f"offload rank 0: peak {got[True][0]} B with offload, {got[False][0]} B without (expected "
                   "about half: one micro-batch's activations instead of two)")
    if not all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1])):
        out.append(f"offload rank {rank}: gradients differ when activations are offloaded")
    if not got[True][2]:
        out.append(f"offload rank {rank}: stash not empty after the step")
    return out + [ran(f"offload rank {rank}")]


def measured_trace_check() -> list[str]:
    """BPipe P=4 M=8 with tracing: the measured trace has every action, and EVICT/RETURN transfers with bytes."""
    import torch.distributed as dist

    from evenpipe.runtime.trace import measured_trace
    from evenpipe.schedule.ir import ActionKind
    groups = build_groups(4, 1, timeout_s=CASE_TIMEOUT_S)
    if groups is None:
        return []
    case = Case(family="bpipe", pp=4, microbatches=8)
    schedule = schedule_for(case)
    cfg = tiny_config(case.model, 4)
    model = build_model(cfg, seed=7)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=4, stages=schedule.stages_of(groups.pp_rank))
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss,
                          stash=ActivationStash(), trace=True)
    tokens, targets = global_batch(case, cfg.vocab, 0)
    ex.step(tokens, targets)
    params = [p for m in stages.values() for p in m.parameters()]
    for p in params:
        p.grad = None
    res = ex.step(tokens, targets)  # second step: BPipe sizes known, receives posted in place
    recs: list = [None] * 4
    dist.all_gather_object(recs, res.records, group=groups.pp_group)
    trace = measured_trace(schedule, recs)
    out = _early_receive_check(ex, tokens, targets, res.loss, params)
    if trace.source != "measured" or [len(a) for a in trace.actions] != [len(a) for a in schedule.actions]:
        out.append(f"measured trace: source {trace.source}, actions {[len(a) for a in trace.actions]}")
    moved = {k: sum(t.num_bytes for t in trace.transfers if t.kind is k) for k in (ActionKind.EVICT,
                                                                                   ActionKind.RETURN)}
    if not moved[ActionKind.EVICT] > 0 or moved[ActionKind.EVICT] != moved[ActionKind.RETURN]:
        out.append(f"measured trace: evicted {moved[ActionKind.EVICT]} B, returned {moved[ActionKind.RETURN]} B")
    if groups.pp_rank == 0 and res.evicted_bytes <= 0:
        out.append("measured trace: rank 0 evicted nothing")
    from evenpipe.sim import Trace
    if Trace.from_json(trace.to_json()) != trace:
        out.append("measured trace: JSON round trip changed it")
    sends = sum(1 for acts in schedule.actions for a in acts if a.kind.is_send)
    if len(trace.transfers) != sends:
        out.append(f"measured trace: {len(trace.transfers)} transfers for {sends} sending actions")
    bad = [t for t in trace.transfers if not (0 <= t.start <= t.end <= trace.step_time and t.exposed_s >= 0)]
    if bad:
        out.append(f"measured trace: transfer times out of order, e.g. {bad[0]}")
    recv_kinds = {rv.action.kind for rec in recs for rv in rec.recvs if rv.arrived >= rv.posted >= 0}
    if recv_kinds != {ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.ACCEPT, ActionKind.LOAD}:
        out.append(f"measured trace: receives stamped only for {sorted(k.name for k in recv_kinds)}")
    late = [rec for acts in trace.actions for rec in acts if rec.end < rec.start]
    if late:
        out.append(f"measured trace: transfer action ends before it starts: {late[0]}")
    out += _causality_problems(trace)
    return out + [ran(f"measured trace rank {groups.pp_rank}")]


def _early_receive_check(ex: Any, tokens: Any, targets: Any, loss: float, params: list) -> list[str]:
    """The same step again with ``early_receives``: the same loss and gradients, every receive posted early."""
    import torch
    import torch.distributed as dist

    from evenpipe.runtime.trace import measured_trace
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    ex.early_receives = True
    try:
        res = ex.step(tokens, targets)
    finally:
        ex.early_receives = False
    out = []
    if res.loss != loss:
        out.append(f"early receives: loss {res.loss} against {loss} posted in place")
    if any((g is None) != (p.grad is None) or (g is not None and not torch.equal(g, p.grad))
           for g, p in zip(grads, params)):
        out.append("early receives: gradients differ from the step with receives posted in place")
    recs: list = [None] * ex.groups.pp
    dist.all_gather_object(recs, res.records, group=ex.groups.pp_group)
    return out + _early_receive_problems(measured_trace(ex.schedule, recs))


def _early_receive_problems(trace: Any) -> list[str]:
    """With ``early_receives`` every pipeline receive is posted with the transfer run before its own: a receive
    whose run has an earlier run on its rank is posted before the compute just before its own run starts."""
    from evenpipe.schedule.ir import ActionKind
    out = []
    for acts in trace.actions:
        runs, last_compute = 0, None
        for i, rec in enumerate(acts):
            if not rec.kind.is_transfer:
                last_compute = rec
                continue
            runs += i == 0 or not acts[i - 1].kind.is_transfer
            if rec.kind in (ActionKind.RECV_F, ActionKind.RECV_B) and runs > 1 and last_compute is not None \
                    and rec.start > last_compute.start:
                out.append(f"measured trace: {rec.action} on rank {rec.rank} posted at {rec.start * 1e3:.3f} ms, "
                           f"after {last_compute.action} started at {last_compute.start * 1e3:.3f} ms")
    return out[:3]


def _causality_problems(trace: Any) -> list[str]:
    """A compute whose input comes from another rank starts, in the measured trace, no earlier than the compute
    that produced that input ended (all ranks share one clock): the wait for the message is idle time, not part
    of the compute. Stamping a receive only when its whole batch completed (gloo completes a send only once it
    is waited, a compute later) broke this on the first backward of every rank but the last."""
    from evenpipe.schedule.ir import ActionKind
    produced = {(rec.kind, rec.action.stage, rec.action.microbatch): rec.end
                for acts in trace.actions for rec in acts}
    layout = trace.schedule.stage_to_rank
    forward, backward = (ActionKind.FORWARD,), (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
    out = []
    for acts in trace.actions:
        for rec in acts:
            s, mb = rec.action.stage, rec.action.microbatch
            if rec.kind in forward and s > 0 and layout[s - 1] != rec.rank:
                feeds = [produced.get((k, s - 1, mb)) for k in forward]
            elif rec.kind in backward and s + 1 < len(layout) and layout[s + 1] != rec.rank:
                feeds = [produced.get((k, s + 1, mb)) for k in backward]
            else:
                continue
            end = max(e for e in feeds if e is not None)
            if rec.start < end:
                out.append(f"measured trace: {rec.action} on rank {rec.rank} starts at {rec.start * 1e3:.3f} ms, "
                           f"before its input was produced at {end * 1e3:.3f} ms")
    return out[:3]


def case_problems(lines: list[str], case: Case) -> list[str]:
    """Failures of ``case`` (and fatal ones), or a failure when not all its ``pp x dp`` ranks proved they ran it."""
    fatal = [f for f in lines if " raised " in f or "reported nothing" in f]
    return (fatal + [f for f in failures_only(lines) if f.startswith(f"{case} rank")]
            + missing_runs(lines, str(case), case.pp * case.dp))


def check_problems(lines: list[str], label: str, expected: int) -> list[str]:
    """Failures of a named check (lines starting with ``label``), or its missing proofs."""
    fatal = [f for f in lines if " raised " in f or "reported nothing" in f]
    return fatal + [f for f in failures_only(lines) if f.startswith(label)] + missing_runs(lines, label, expected)


def run_cases(cases: list[Case], **kw) -> list[str]:
    out: list[str] = []
    for c in cases:
        out.extend(run_case(c, **kw))
    return out


__all__ = ["Case", "case_problems", "check_problems", "run_case", "run_cases", "schedule_for", "replace"]
