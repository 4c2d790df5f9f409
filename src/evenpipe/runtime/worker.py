"""One ``evenpipe train`` worker process: build the model's stages, run the executor, report on rank 0.

Started by torchrun (``python -m evenpipe.runtime.worker`` reads the checked options from ``EVENPIPE_TRAIN_ARGS``)
or called directly by ``evenpipe train`` when already under torchrun. Printing happens only on global rank 0.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from evenpipe.runtime.comm import build_groups, init_from_env
from evenpipe.runtime.launch import ARGS_ENV

__all__ = ["train", "RankReport", "batches"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """What one rank measured over the whole run (gathered on rank 0)."""

    pp_rank: int
    """Pipeline rank."""
    dp_rank: int
    """Replica."""
    peak_own_bytes: int
    """Peak own activation bytes over all steps."""
    peak_hosted_bytes: int
    """Peak hosted (BPipe partner) activation bytes over all steps."""
    peak_activation_bytes: int
    """Peak of own plus hosted bytes over all steps."""
    evicted_bytes_per_step: int
    """Bytes sent away by EVICT per step (from the last step)."""
    peak_rss_bytes: int
    """Peak resident set size of the process."""
    step_times_s: tuple[float, ...]
    """Wall-clock seconds of every step (pipeline step plus optimizer)."""


def batches(options: Mapping[str, Any], vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic global batches ``(tokens, targets)`` of ``global_batch x seq_len``, identical on all ranks:
    random windows of the corpus (the shipped one unless ``--corpus``) or, with ``--random-tokens``, random ids."""
    from evenpipe.runtime.data import TokenBatches, TokenSource
    source = TokenSource.RANDOM if options["random_tokens"] else TokenSource.CORPUS
    data = TokenBatches(source=source, seq_len=options["seq_len"], vocab=vocab, seed=options["seed"],
                        path=options.get("corpus"))
    step = 0
    while True:
        b = data.batch(step, options["global_batch"])
        yield b.tokens, b.targets
        step += 1


def _stash() -> Any:
    try:
        from evenpipe.runtime.stash import ActivationStash
    except ImportError:
        return None
    return ActivationStash()


def train(options: Mapping[str, Any]) -> int:
    """Run the whole training job on this rank; returns the exit code."""
    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.schedule import build_schedule

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    init_from_env(options["backend"], timeout_s=options["timeout"])
    pp, dp = options["stages"], options["dp"]
    groups = build_groups(pp, dp, timeout_s=options["timeout"])
    assert groups is not None
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if options["backend"] == "nccl" else "cpu")
    schedule = build_schedule(options["schedule"], num_ranks=pp, num_microbatches=options["microbatches"],
                              num_chunks=options["chunks"], bpipe_budget=options["bpipe_budget"],
                              recompute=options["recompute"])
    cfg = model_config(options["model"], seq_len=options["seq_len"])
    model = build_model(cfg, seed=options["seed"], device=device)
    mine = schedule.stages_of(groups.pp_rank)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=schedule.num_stages, stages=mine,
                                 layout=options["layout"])
    stash = _stash()
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss,
                          free_outputs=options["free_outputs"], stash=stash, device=device)
    params = [p for s in stages.values() for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=options["lr"])
    me = dist.get_rank()
    tokens_per_step = options["global_batch"] * options["seq_len"]
    losses: list[float] = []
    times: list[float] = []
    peaks = [0, 0, 0]
    evicted = 0
    records = None
    data = batches(options, cfg.vocab)
    for step in range(options["steps"]):
        tokens, targets = next(data)
        ex.trace = bool(options["trace"]) and step == options["steps"] - 1
        t0 = time.perf_counter()
        result = ex.step(tokens, targets)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(result.loss)
        times.append(dt)
        peaks = [max(peaks[0], result.peak_own_bytes), max(peaks[1], result.peak_hosted_bytes),
                 max(peaks[2], result.peak_activation_bytes)]
        evicted = result.evicted_bytes
        records = result.records
        every = max(1, options["steps"] // 50)  # long runs: about 50 progress lines
        if me == 0 and ((step + 1) % every == 0 or step + 1 == options["steps"]):
            done = (step + 1) / options["steps"]
            bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
            print(f"step {step + 1:4d}/{options['steps']} [{bar}]  loss {result.loss:.4f}  "
                  f"{tokens_per_step / dt:10.0f} tokens/s", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    report = RankReport(pp_rank=groups.pp_rank, dp_rank=groups.dp_rank, peak_own_bytes=peaks[0],
                        peak_hosted_bytes=peaks[1], peak_activation_bytes=peaks[2], evicted_bytes_per_step=evicted,
                        peak_rss_bytes=rss, step_times_s=tuple(times))
    gathered: list[Any] = [None] * dist.get_world_size() if me == 0 else []
    dist.gather_object((report, records if groups.dp_rank == 0 else None), gathered if me == 0 else None, dst=0)
    if me == 0:
        reports = [r for r, _ in gathered]
        _print_summary(reports, options, stash is not None)
        summary = _summary(reports, losses, options)
        if options["json_out"]:
            with open(options["json_out"], "w") as f:
                json.dump(summary, f, indent=2)
        if options["trace"]:
            _write_trace(schedule, [rec for _, rec in gathered if rec is not None], options["trace"])
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _summary(reports: list[RankReport], losses: list[float], options: Mapping[str, Any]) -> dict[str, Any]:
    pp = options["stages"]
    step_times = [max(r.step_times_s[i] for r in reports) for i in range(len(losses))]
    median = statistics.median(step_times)

    def per_rank(field: str) -> list[int]:
        return [max(getattr(r, field) for r in reports if r.pp_rank == k) for k in range(pp)]
    return {
        "losses": losses,
        "step_time_s": median,
        "tokens_per_s": options["global_batch"] * options["seq_len"] / median,
        "peak_activation_bytes": per_rank("peak_activation_bytes"),
        "peak_own_bytes": per_rank("peak_own_bytes"),
        "peak_hosted_bytes": per_rank("peak_hosted_bytes"),
        "evicted_bytes_per_step": per_rank("evicted_bytes_per_step"),
        "peak_rss_bytes": per_rank("peak_rss_bytes"),
        "options": dict(options),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def _print_summary(reports: list[RankReport], options: Mapping[str, Any], measured: bool) -> None:
    print(f"\nper-rank memory (MiB; activation peaks {'from the stash' if measured else 'not measured'}, "
          "max over data-parallel replicas):")
    print(" rank   peak own  peak hosted  peak total  evicted/step   peak RSS")
    for k in range(options["stages"]):
        rs = [r for r in reports if r.pp_rank == k]
        print(f"{k:5d} {_mib(max(r.peak_own_bytes for r in rs))}    {_mib(max(r.peak_hosted_bytes for r in rs))}"
              f"   {_mib(max(r.peak_activation_bytes for r in rs))}     {_mib(max(r.evicted_bytes_per_step for r in rs))}"
              f"  {_mib(max(r.peak_rss_bytes for r in rs))}")
    sys.stdout.flush()


def _write_trace(schedule: Any, recorders: list[Any], path: str) -> None:
    from evenpipe.runtime.trace import measured_trace, write_chrome_trace
    write_chrome_trace(measured_trace(schedule, recorders), path)


def main() -> int:
    options = json.loads(os.environ[ARGS_ENV])
    return train(options)


if __name__ == "__main__":
    sys.exit(main())
