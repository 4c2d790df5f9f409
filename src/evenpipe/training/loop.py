"""The training loop of one rank: build this rank's stages and executor, run the steps, report on rank 0.

Every rank computes the same global batch (a pure function of the data seed and the step) and the executor takes
its replica's slice. After the pipeline step (which averages gradients over replicas) the whole model's gradient
norm is measured and clipped, then AdamW steps and the learning-rate schedule advances. Progress goes through the
``evenpipe.train`` logger (rank 0 only); per-step metrics go to the JSON-lines file / TensorBoard named in the
output options; the returned :class:`TrainSummary` is the same on every rank. A :class:`Watchdog` bounds every
wait (see :mod:`evenpipe.training.fault`).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import ParallelGroups, build_groups, collective, init_from_env
from evenpipe.runtime.data import MicroBatches
from evenpipe.runtime.mesh import MeshDim
from evenpipe.training.checkpoint import SaveJob, TrainState, load_checkpoint, newest_complete_checkpoint
from evenpipe.training.checkpoint_manifest import step_directories
from evenpipe.training.run_record import RUN_KEY, run_fingerprint
from evenpipe.training.checkpoint_state import checkpoint_target
from evenpipe.training.checkpoint_writer import CheckpointWriter
from evenpipe.training.config import Backend, DataSource, Recompute, RuntimeOptions, Sharding, TrainConfig
from evenpipe.training.fault import Watchdog, timeout_after_step
from evenpipe.training.metrics import MetricsSink, StepMetrics, format_progress
from evenpipe.training.optim import build_lr_scheduler, build_optimizer, clip_grad_global_norm
from evenpipe.training.params import RankParameters, build_rank_stages
from evenpipe.training.memory import CategoryPeaks, allocator_peak_bytes, state_bytes
from evenpipe.training.slow_ranks import SlowRankWatch
from evenpipe.training.summary import RankReport, TrainSummary, memory_table, summarise

__all__ = ["train"]

log = logging.getLogger("evenpipe.train")


@dataclass(slots=True, kw_only=True)
class _Job:
    """This rank's pieces of the job."""

    config: TrainConfig
    groups: ParallelGroups
    device: torch.device
    schedule: Any
    executor: Any
    stages: dict[int, torch.nn.Module]
    params: RankParameters
    optimizer: Any
    """AdamW (float32) or a master-weight AdamW (bfloat16); state sharded over replicas with --sharding
    optimizer."""
    scheduler: Any
    data: Any
    measured: bool
    """Whether an activation stash measures memory."""
    model: dict[str, Any]
    """What was trained: ``{"source", "class", "num_params"}``."""
    replaced: tuple[str, ...] = ()
    """Checkpoints of an earlier run, found at the start, that ``--overwrite-checkpoints`` deletes once this job's
    first save is complete."""
    writer: CheckpointWriter | None = None
    """Saves the checkpoints (in the background unless --checkpoint-sync), when there is a directory."""
    slow: SlowRankWatch | None = None
    """Emulated slowdowns, per-rank compute gathered on rank 0, a slow rank named (issue 35)."""
    forecast: Any = None
    """Documents with ``--predict``, on rank 0: each step's prediction
    (:class:`evenpipe.training.document_memory.DocumentForecast`)."""


@dataclass(slots=True)
class _Progress:
    """What the loop accumulates over the steps of this run."""

    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """Tokens trained each step: the rows' positions, or for documents the real ones (padding not counted)."""
    own: int = 0
    hosted: int = 0
    total: int = 0
    evicted: int = 0
    records: Any = None
    categories: CategoryPeaks = field(default_factory=CategoryPeaks)

    def add(self, result: Any, dt: float, norm: float) -> None:
        self.losses.append(result.loss)
        self.grad_norms.append(norm)
        self.times.append(dt)
        self.own = max(self.own, result.peak_own_bytes)
        self.hosted = max(self.hosted, result.peak_hosted_bytes)
        self.total = max(self.total, result.peak_activation_bytes)
        self.evicted = result.evicted_bytes
        self.records = result.records
        self.categories.add({"own_activations": result.peak_own_bytes,
                             "hosted_activations": result.peak_hosted_bytes,
                             "offloaded_activations": result.peak_offloaded_bytes,
                             "communication_buffers": result.peak_comm_bytes})


def _device(backend: Backend) -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}" if backend is Backend.NCCL else "cpu")


def _stash() -> Any:
    try:
        from evenpipe.runtime.stash import ActivationStash
    except ImportError:
        return None
    return ActivationStash()


def _build(config: TrainConfig) -> _Job:
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import StageModule

    rt, sched = config.runtime, config.schedule
    init_from_env(rt.backend.value, timeout_s=rt.group_timeout_s)
    groups = build_groups(sched.num_ranks, rt.dp, tp=rt.tp, timeout_s=rt.group_timeout_s)
    assert groups is not None
    device = _device(rt.backend)
    schedule = sched.build()
    built = config.model.build(device)
    grad_sync = None

    def prepare(mine: dict[int, torch.nn.Module]) -> None:
        nonlocal grad_sync
        grad_sync = _parallelize(mine, groups, rt)
    stages, params = build_rank_stages(built.module, built.parts, schedule, groups.pp_rank,
                                       layout=list(sched.layout) if sched.layout else None, prepare=prepare)
    for stage in stages.values():  # documents: boundaries travel with the activations
        if isinstance(stage, StageModule):
            stage.packed = config.data.source is DataSource.DOCUMENTS
    _recompute_selectively(stages, sched.stages_recomputing(Recompute.SELECTIVE))
    stash = _stash()
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=built.loss,
                          free_outputs=sched.free_outputs, stash=stash, device=device, grad_sync=grad_sync)
    opt = _optimizer(params, groups, config)
    return _Job(config=config, groups=groups, device=device, schedule=schedule, executor=ex, stages=stages,
                params=params, optimizer=opt, scheduler=None, data=config.token_batches(built.spec.vocab),
                measured=stash is not None, model=built.describe())


def _recompute_selectively(stages: dict[int, Any], selective: frozenset[int]) -> None:
    """Switch on selective recomputation in this rank's ``selective`` stages (ConfigError when a stage's
    blocks have no attention core it can recompute)."""
    from evenpipe.models.recompute import set_selective_recompute
    for s, stage in stages.items():
        if s in selective and not set_selective_recompute(stage) and len(getattr(stage, "blocks", ())):
            layer = stage.blocks[0]
            raise ConfigError(f"--recompute selective: stage {s}'s {type(getattr(layer, 'layer', layer)).__name__} "
                              "blocks have no attention core evenpipe can recompute (use full or none)")


def _parallelize(stages: dict[int, Any], groups: ParallelGroups, rt: RuntimeOptions) -> Any:
    """Tensor parallelism, then FSDP (in place); the gradient sync that replaces the all-reduce, or None."""
    if rt.tp > 1:
        from evenpipe.runtime.tensor_parallel import parallelize_stage
        for stage in stages.values():
            parallelize_stage(stage, groups.mesh[MeshDim.TP.value], sequence_parallel=rt.sequence_parallel)
    if rt.sharding is Sharding.FULL and rt.dp > 1:
        from evenpipe.runtime.sharding import fully_shard_stages
        return fully_shard_stages(stages.values(), groups.mesh[MeshDim.DP.value])
    return None


def _optimizer(params: RankParameters, groups: ParallelGroups, config: TrainConfig) -> Any:
    """AdamW (a master-weight AdamW for bfloat16), its state sharded over replicas under ``--sharding
    optimizer``."""
    from evenpipe.runtime.precision import MasterWeightOptimizer, TrainDtype

    def make(ps: RankParameters) -> Any:
        if config.model.dtype is TrainDtype.FLOAT32:
            return build_optimizer(ps, config.optimizer)
        return MasterWeightOptimizer(torch.optim.AdamW, list(ps.named.values()), lr=config.optimizer.lr)
    if config.runtime.sharding is Sharding.OPTIMIZER and groups.dp > 1:
        from evenpipe.runtime.sharding import ShardedOptimizer
        return ShardedOptimizer(params, make_optimizer=make, dp_group=groups.dp_group, dp_ranks=groups.dp_ranks,
                                dp_rank=groups.dp_rank)
    return make(params)


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the wrappers (state sharding, master weights) whose learning rate is set."""
    while hasattr(optimizer, "inner"):
        optimizer = optimizer.inner
    return optimizer


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _train_step(job: _Job, step: int) -> tuple[Any, float, float, int]:
    """One optimizer step: pipeline, whole-model norm and clipping, AdamW, schedule; (result, lr, norm, tokens
    trained: padding not counted for documents)."""
    batch = job.data.batch(step, job.config.data.global_batch)
    result = job.executor.step(batch.tokens, batch.targets)
    tokens = batch.real_tokens() if isinstance(batch, MicroBatches) else job.config.data.global_batch * \
        job.config.seq_len
    norm = clip_grad_global_norm(job.params, job.groups, job.config.optimizer.clip_grad_norm)
    lr = float(job.optimizer.param_groups[0]["lr"])
    job.optimizer.step()
    job.scheduler.step()
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    return result, lr, norm, tokens


def _order_metrics(data: Any, step: int) -> dict[str, float]:
    """``--microbatch-order simulated``: the step's predicted gain of the chosen orders over the planner's (mean over
    replicas, the planner's cost units) and the milliseconds choosing took (summed), for the metrics line."""
    last = getattr(data, "choices", {}).get(step)
    if not last:
        return {}
    return {"order_predicted_gain": sum(c.gain for c in last) / len(last),
            "order_choice_ms": 1e3 * sum(c.seconds for c in last)}


def _forecast(config: TrainConfig, data: Any) -> Any:
    """Documents with ``--predict`` (tensor parallelism 1, one recomputation mode): the per-step predictor."""
    planned = config.parallel_config()
    documents = config.data.source is DataSource.DOCUMENTS
    if not documents or not config.output.predict or planned is None or planned.tp != 1:
        return None
    from evenpipe.training.document_memory import DocumentForecast
    return DocumentForecast(data, config.output.predict, planned, dtype=config.model.dtype.value,
                            sharding=config.runtime.sharding.value)


def train(config: TrainConfig, *, watchdog: Watchdog | None = None) -> TrainSummary:
    """Run the whole job on this rank (torch.distributed from torchrun's environment); the job summary.

    ``watchdog`` (started by the worker) bounds every wait; without one the loop runs unwatched."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    watch = watchdog or Watchdog(rank=0, timeout_s=config.runtime.initial_timeout_s, status_dir=None)
    job = _build(config)
    if config.data.source is DataSource.DOCUMENTS and dist.get_rank() == 0:
        docs = job.data.report()
        log.info(f"documents: {docs['documents']} from {config.data.path} ({docs['skipped']} skipped, fewer than 2 "
                 f"tokens; {docs['cut']} cut into pieces)")
    job.slow = SlowRankWatch(config=config, schedule=job.schedule, pp_rank=job.groups.pp_rank, device=job.device)
    if dist.get_rank() == 0:
        job.forecast = _forecast(config, job.data)
    watch.rank = dist.get_rank()
    state = _resume(job, watch)
    if config.checkpoint.directory:
        job.writer = CheckpointWriter(asynchronous=not config.checkpoint.synchronous)
    steps = config.runtime.steps
    job.scheduler = build_lr_scheduler(_innermost(job.optimizer), config.optimizer,
                                       total_steps=steps, start_step=state.step)
    out = config.output
    sink = MetricsSink(jsonl_path=out.metrics, tensorboard_dir=out.tensorboard,
                       append=state.step > 0) if dist.get_rank() == 0 else None
    progress = _Progress()
    with collective("the start-up barrier"):  # every rank built: the first step's waits measure peers, not skew
        dist.barrier()
    try:
        for step in range(state.step, steps):
            metrics = _watched_step(job, watch, step, progress)
            state = TrainState(step=step + 1, samples=state.samples + config.data.global_batch)
            extra = {}
            if config.data.eval_due(step + 1, steps):
                extra["eval_loss"] = _evaluate(job, watch)
                progress.eval_losses.append((step + 1, extra["eval_loss"]))
            extra.update(_order_metrics(job.data, step))
            if job.forecast is not None:
                extra.update(job.forecast.metrics(step))
            if sink is not None:
                sink.write(metrics, **extra)
                if "eval_loss" in extra:
                    log.info(f"step {step + 1:4d}/{steps}  held-out loss {extra['eval_loss']:.4f}")
                if (step + 1) % out.log_every_for(steps) == 0 or step + 1 == steps:
                    log.info(format_progress(metrics, steps))
            if config.checkpoint.due(step + 1, steps):
                _save(job, watch, state)
        if job.writer is not None:
            watch.progress("finishing the last checkpoint", watched=False)
            job.writer.close()
    finally:
        if sink is not None:
            sink.close()
    watch.progress("gathering the summary", watched=False)
    summary = _gather_summary(job, _report(job, progress), progress, first_step=steps - len(progress.losses))
    with collective("the closing barrier"):
        dist.barrier()
    dist.destroy_process_group()
    return summary


def _watched_step(job: _Job, watch: Watchdog, step: int, progress: _Progress) -> StepMetrics:
    """Step ``step`` (0-based) under the watchdog, which tightens its timeout afterwards (without --timeout)."""
    config = job.config
    watch.step = step + 1
    watch.progress("running the pipeline", watched=True)
    out = config.output
    job.executor.trace = bool(out.trace or out.trace_json or out.predict) and step == config.runtime.steps - 1
    if job.slow is not None:
        job.slow.before_step(job.executor, step)
    t0 = time.perf_counter()
    result, lr, norm, tokens = _train_step(job, step)
    dt = time.perf_counter() - t0
    progress.tokens.append(tokens)
    if job.slow is not None:
        job.slow.after_step(result.compute_s)
    progress.add(result, dt, norm)
    progress.categories.add(state_bytes(job.params.named.values(), job.optimizer)
                            | {"gathered_states": getattr(job.executor.grad_sync, "gathered_bytes", 0)})
    watch.finished_step(step + 1)
    if config.runtime.timeout_s is None:
        watch.timeout_s = timeout_after_step(max(progress.times))
    return StepMetrics(step=step + 1, loss=result.loss, lr=lr, grad_norm=norm, step_time_s=dt,
                       tokens_per_s=tokens / dt,
                       peak_activation_bytes=result.peak_activation_bytes, memory_bytes=_memory_bytes(job.device))


def _evaluate(job: _Job, watch: Watchdog) -> float:
    """Mean loss over the held-out batches (dropout off). The executor has no forward-only mode yet, so each
    batch runs a full step whose gradients are then dropped; parameters and optimizer state are untouched."""
    watch.progress("evaluating", watched=False)
    modules = list(job.stages.values())
    for m in modules:
        m.eval()
    data = job.config.data
    losses = [job.executor.step(b.tokens, b.targets).loss
              for b in (job.data.eval_batch(j, data.global_batch) for j in range(data.eval_batches))]
    for m in modules:
        m.train()
    for p in job.params.named.values():
        p.grad = None
    watch.progress()
    return sum(losses) / len(losses)


def _resume(job: _Job, watch: Watchdog) -> TrainState:
    """The newest complete checkpoint's state when resuming (parameters and optimizer loaded), else step 0."""
    ck = job.config.checkpoint
    if ck.directory and ck.overwrite and dist.get_rank() == 0:
        job.replaced = tuple(step_directories(ck.directory))
    if not (ck.resume and ck.directory):
        return TrainState(step=0, samples=0)
    watch.progress("finding the newest complete checkpoint", watched=False)
    path = newest_complete_checkpoint(ck.directory)
    if path is None:
        if dist.get_rank() == 0:
            log.info(f"no complete checkpoint in {ck.directory}; starting at step 0")
        return TrainState(step=0, samples=0)
    watch.progress("loading a checkpoint", watched=False)
    state = load_checkpoint(path, target=checkpoint_target(job.params, job.optimizer, job.stages.values()))
    if dist.get_rank() == 0:
        log.info(f"resuming from {path} (step {state.step})")
    return state


def _save(job: _Job, watch: Watchdog, state: TrainState) -> None:
    ck, rt = job.config.checkpoint, job.config.runtime
    assert ck.directory is not None and job.writer is not None
    watch.progress("saving a checkpoint", watched=False)
    world = {"world": dist.get_world_size(), "pp": job.config.schedule.num_ranks, "dp": rt.dp, "tp": rt.tp,
             "schedule": job.config.schedule.family.value, "sharding": rt.sharding.value,
             "dtype": job.config.model.dtype.value, RUN_KEY: run_fingerprint(job.config)}
    save = SaveJob(directory=ck.directory, step=state.step, keep=ck.keep, world=world, replaced=job.replaced)
    job.writer.save(save, checkpoint_target(job.params, job.optimizer, job.stages.values()), state)
    job.replaced = ()
    watch.progress()


def _report(job: _Job, p: _Progress) -> RankReport:
    return RankReport(pp_rank=job.groups.pp_rank, dp_rank=job.groups.dp_rank, tp_rank=job.groups.tp_rank,
                      peak_bytes_by_category=dict(p.categories.peaks),
                      allocator_peak_bytes=allocator_peak_bytes(job.device), peak_own_bytes=p.own,
                      peak_hosted_bytes=p.hosted, peak_activation_bytes=p.total, evicted_bytes_per_step=p.evicted,
                      peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      step_times_s=tuple(p.times))


def _gather_summary(job: _Job, report: RankReport, progress: _Progress, *, first_step: int) -> TrainSummary:
    """Gather every rank's report on rank 0, write the outputs there, and share the summary with all ranks."""
    me = dist.get_rank()
    traced = job.groups.dp_rank == 0 and job.groups.tp_rank == 0  # one recorder per pipeline rank
    records = progress.records if traced else None
    gathered: list[Any] = [None] * dist.get_world_size() if me == 0 else []
    with collective("the summary gather", 0):
        dist.gather_object((report, records), gathered if me == 0 else None, dst=0)
    shared: list[Any] = [None]
    if me == 0:
        summary = summarise([r for r, _ in gathered], progress.losses, progress.grad_norms,
                            eval_losses=progress.eval_losses, num_ranks=job.config.schedule.num_ranks,
                            first_step=first_step,
                            tokens_per_step=job.config.data.global_batch * job.config.seq_len,
                            tokens_by_step=progress.tokens if job.config.data.source is DataSource.DOCUMENTS
                            else None)
        log.info("\n" + memory_table(summary, measured=job.measured))
        prediction = _prediction(job, [r for r, _ in gathered], summary.peak_bytes_by_category,
                                 steps=range(first_step, job.config.runtime.steps))
        _write_outputs(job, summary, [rec for _, rec in gathered if rec is not None], prediction)
        shared = [summary]
    with collective("the summary broadcast", 0):
        dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _prediction(job: _Job, reports: list[RankReport], measured: Any = (),
                steps: range = range(0)) -> dict[str, Any] | None:
    """With ``--predict``: log the profile's prediction against this run's measurement; its dict form. With
    documents, the memory predicted is that of the micro-batches each step of ``steps`` ran."""
    out, cfg = job.config.output, job.config
    if not out.predict:
        return None
    from evenpipe.plan.predict import category_prediction, category_table, prediction_table, report_prediction
    from evenpipe.runtime.stages import stage_block_counts
    model_config = cfg.model.resolve()
    run = report_prediction(out.predict, model_name=cfg.model.name, model_config=model_config,
                            schedule=job.schedule, microbatch_size=cfg.data.global_batch // (
                                cfg.schedule.num_microbatches * cfg.runtime.dp),
                            layout=stage_block_counts(model_config, job.schedule.num_stages, cfg.schedule.layout),
                            reports=reports, dtype=cfg.model.dtype.value)
    log.info("\n" + prediction_table(run))
    planned = cfg.parallel_config()
    predicted: tuple[dict[str, int], ...] | None
    if job.forecast is not None:
        predicted = job.forecast.peaks(steps)
    else:
        predicted = None if planned is None else category_prediction(
            out.predict, planned, dtype=cfg.model.dtype.value, sharding=cfg.runtime.sharding.value)
    log.info("\n" + category_table(predicted, measured))
    return {**run.to_dict(), "peak_bytes_by_category": list(predicted) if predicted is not None else None}


def _write_outputs(job: _Job, summary: TrainSummary, recorders: list[Any],
                   prediction: dict[str, Any] | None = None) -> None:
    out = job.config.output
    if out.json_out:
        extra: dict[str, Any] = {"prediction": prediction} if prediction is not None else {}
        if job.writer is not None:
            extra["checkpoints"] = job.writer.report()
        if job.slow is not None and (slow := job.slow.report()) is not None:
            extra["slow_ranks"] = slow
        if job.config.data.source is DataSource.DOCUMENTS:
            extra["documents"] = job.data.report()
        with open(out.json_out, "w") as f:
            json.dump({**summary.to_dict(), "model": job.model, "config": job.config.to_dict(), **extra}, f,
                      indent=2)
    if out.trace or out.trace_json:
        from evenpipe.runtime.trace import measured_trace, write_chrome_trace
        trace = measured_trace(job.schedule, recorders)
        if out.trace:
            write_chrome_trace(trace, out.trace)
        if out.trace_json:
            with open(out.trace_json, "w") as f:
                f.write(trace.to_json())
