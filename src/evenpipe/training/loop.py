"""The training loop of one rank: build this rank's stages and executor, run the steps, report on rank 0.

Every rank computes the same global batch (a pure function of the data seed and the step) and the executor takes
its replica's slice. Progress goes through the ``evenpipe.train`` logger (rank 0 only); per-step metrics go to the
JSON-lines file / TensorBoard named in the output options; the returned :class:`TrainSummary` is the same on every
rank.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from evenpipe.runtime.comm import ParallelGroups, build_groups, init_from_env
from evenpipe.training.config import Backend, TrainConfig
from evenpipe.training.metrics import MetricsSink, StepMetrics, format_progress
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
    optimizer: torch.optim.Optimizer
    data: Any
    measured: bool
    """Whether an activation stash measures memory."""
    model: dict[str, Any]
    """What was trained: ``{"source", "class", "num_params"}``."""


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
    from evenpipe.runtime.precision import MasterWeightOptimizer, TrainDtype
    from evenpipe.runtime.stages import build_stage_modules

    rt, sched = config.runtime, config.schedule
    init_from_env(rt.backend.value, timeout_s=rt.timeout_s)
    groups = build_groups(sched.num_ranks, rt.dp, timeout_s=rt.timeout_s)
    assert groups is not None
    device = _device(rt.backend)
    schedule = sched.build()
    built = config.model.build(device)
    stages = build_stage_modules(built.parts, num_stages=schedule.num_stages,
                                 stages=schedule.stages_of(groups.pp_rank),
                                 layout=list(sched.layout) if sched.layout else None)
    stash = _stash()
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=built.loss,
                          free_outputs=sched.free_outputs, stash=stash, device=device)
    params = list({id(p): p for s in stages.values() for p in s.parameters()}.values())
    opt: Any = (torch.optim.AdamW(params, lr=config.optimizer.lr) if config.model.dtype is TrainDtype.FLOAT32
                else MasterWeightOptimizer(torch.optim.AdamW, params, lr=config.optimizer.lr))
    return _Job(config=config, groups=groups, device=device, schedule=schedule, executor=ex, optimizer=opt,
                data=config.token_batches(built.spec.vocab), measured=stash is not None, model=built.describe())


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class _Peaks:
    """Running maxima of the executor's per-step memory figures."""

    def __init__(self) -> None:
        self.own = self.hosted = self.total = self.evicted = 0

    def add(self, result: Any) -> None:
        self.own = max(self.own, result.peak_own_bytes)
        self.hosted = max(self.hosted, result.peak_hosted_bytes)
        self.total = max(self.total, result.peak_activation_bytes)
        self.evicted = result.evicted_bytes


def train(config: TrainConfig) -> TrainSummary:
    """Run the whole job on this rank (torch.distributed from torchrun's environment); the job summary."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    job = _build(config)
    me, steps = dist.get_rank(), config.runtime.steps
    tokens_per_step = config.data.global_batch * config.seq_len
    out = config.output
    sink = MetricsSink(jsonl_path=out.metrics, tensorboard_dir=out.tensorboard) if me == 0 else None
    losses: list[float] = []
    times: list[float] = []
    peaks = _Peaks()
    records = None
    try:
        for step in range(steps):
            batch = job.data.batch(step, config.data.global_batch)
            job.executor.trace = bool(out.trace or out.trace_json or out.predict) and step == steps - 1
            t0 = time.perf_counter()
            result = job.executor.step(batch.tokens, batch.targets)
            job.optimizer.step()
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            dt = time.perf_counter() - t0
            losses.append(result.loss)
            times.append(dt)
            peaks.add(result)
            records = result.records
            if sink is not None:
                m = StepMetrics(step=step + 1, loss=result.loss, lr=job.optimizer.param_groups[0]["lr"],
                                step_time_s=dt, tokens_per_s=tokens_per_step / dt,
                                peak_activation_bytes=result.peak_activation_bytes,
                                memory_bytes=_memory_bytes(job.device))
                sink.write(m)
                log.info(format_progress(m, steps))
    finally:
        if sink is not None:
            sink.close()
    report = RankReport(pp_rank=job.groups.pp_rank, dp_rank=job.groups.dp_rank, peak_own_bytes=peaks.own,
                        peak_hosted_bytes=peaks.hosted, peak_activation_bytes=peaks.total,
                        evicted_bytes_per_step=peaks.evicted,
                        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                        step_times_s=tuple(times))
    summary = _gather_summary(job, report, records if job.groups.dp_rank == 0 else None, losses, tokens_per_step)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _gather_summary(job: _Job, report: RankReport, records: Any, losses: list[float],
                    tokens_per_step: int) -> TrainSummary:
    """Gather every rank's report on rank 0, write the outputs there, and share the summary with all ranks."""
    me = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size() if me == 0 else []
    dist.gather_object((report, records), gathered if me == 0 else None, dst=0)
    shared: list[Any] = [None]
    if me == 0:
        summary = summarise([r for r, _ in gathered], losses, num_ranks=job.config.schedule.num_ranks,
                            first_step=0, tokens_per_step=tokens_per_step)
        log.info("\n" + memory_table(summary, measured=job.measured))
        prediction = _prediction(job, [r for r, _ in gathered])
        _write_outputs(job, summary, [rec for _, rec in gathered if rec is not None], prediction)
        shared = [summary]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _prediction(job: _Job, reports: list[RankReport]) -> dict[str, Any] | None:
    """With ``--predict``: log the profile's prediction against this run's measurement; its dict form."""
    out, cfg = job.config.output, job.config
    if not out.predict:
        return None
    from evenpipe.runtime.predict import prediction_table, report_prediction
    run = report_prediction(out.predict, model_name=cfg.model.name, model_config=cfg.model.resolve(),
                            schedule=job.schedule, microbatch_size=cfg.data.global_batch // (
                                cfg.schedule.num_microbatches * cfg.runtime.dp),
                            layout=cfg.schedule.layout, reports=reports)
    log.info("\n" + prediction_table(run))
    return run.to_dict()


def _write_outputs(job: _Job, summary: TrainSummary, recorders: list[Any],
                   prediction: dict[str, Any] | None = None) -> None:
    out = job.config.output
    if out.json_out:
        extra = {"prediction": prediction} if prediction is not None else {}
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
