"""evenpipe's 1F1B executor against torch.distributed.pipelining's Schedule1F1B, side by side (issue 3).

Run: ``.venv/bin/python benchmarks/bench_torch_pipelining.py`` (defaults: gpt-mini = GPT 8 layers hidden 512,
seq 128, micro-batch 4, M=8, P=2 and P=4 CPU processes over gloo, 2 warm-up + 5 timed steps).

Both runtimes get the same stage modules (``build_stage_modules`` over ``build_model(...).pipeline_parts()``,
same seed, balanced layout), the same global batches (``TokenBatches``, random tokens) and the same loss; each
(runtime, P) runs in its own fresh world of P processes, one after the other. Per step: barrier, grads set to
None, one pipeline step (forward and backward of every micro-batch; no optimizer), then the slowest rank's
wall time and the CPU seconds of all ranks; the table shows medians over timed steps. Memory, measured
identically for both with the probes of ``pipe_probe.py``: autograd-saved bytes (peak), heap peak during a step
above the heap before the runtime existed (saved tensors plus kept stage outputs, receive buffers, in-flight
messages and gradients) and peak RSS. Ratios are
torch / evenpipe: above 1 means evenpipe is faster or smaller.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipe_probe import (
    Captured,
    HeapSampler,
    SavedBytes,
    peak_rss_bytes,
    run_local_world,
)
from torch import nn


def _setup(rank: int, world: int, opts: dict[str, Any]) -> tuple[Any, Any, Any]:
    from evenpipe.models import build_model, model_config
    from evenpipe.runtime.data import TokenBatches
    from evenpipe.runtime.stages import build_stage_modules

    cfg = model_config(opts["model"], seq_len=opts["seq_len"])
    model = build_model(cfg, seed=opts["seed"])
    stage = build_stage_modules(model.pipeline_parts(), num_stages=world, stages=[rank])[rank]
    data = TokenBatches(source="random", seq_len=cfg.seq_len, vocab=cfg.vocab, seed=opts["seed"])
    return stage, data, cfg


def _worker(rank: int, world: int, runtime: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining

    import evenpipe.runtime.executor  # noqa: F401  (import both runtimes before the heap base line)
    from evenpipe.models import lm_loss

    stage, data, _cfg = _setup(rank, world, opts)
    m, b = opts["microbatches"], opts["microbatch_size"]
    saved = SavedBytes([stage])
    heap = HeapSampler(stage)
    heap.set_base()  # model built, runtime not yet: its persistent buffers count
    if runtime == "evenpipe":
        from evenpipe.runtime.comm import build_groups
        from evenpipe.runtime.executor import PipelineExecutor
        from evenpipe.schedule import build_schedule
        groups = build_groups(world, 1)
        assert groups is not None
        schedule = build_schedule("1f1b", num_ranks=world, num_microbatches=m)
        ex = PipelineExecutor(schedule=schedule, stages={rank: stage}, groups=groups, loss_fn=lm_loss,
                              stash=saved, free_outputs=True)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
            return ex.step(tokens, targets).loss
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        wrapped = Captured(stage, saved, tag=rank)
        pipe_stage = PipelineStage(wrapped, rank, world, torch.device("cpu"))
        loss_mod = Captured(_Loss(lm_loss), saved, tag=world + rank)
        sched = Schedule1F1B(pipe_stage, n_microbatches=m, loss_fn=loss_mod)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
            saved.reset_peaks()
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(tokens, return_outputs=False)
            elif rank == world - 1:
                sched.step(target=targets, losses=losses, return_outputs=False)
            else:
                sched.step(return_outputs=False)
            return float(torch.stack(losses).detach().mean()) if losses else None

    times, cpus, saved_peaks, heap_peaks, losses = [], [], [], [], []
    for i in range(opts["warmup"] + opts["steps"]):
        batch = data.batch(i, m * b)
        for p in stage.parameters():
            p.grad = None
        dist.barrier()
        heap.start()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(batch.tokens, batch.targets)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= opts["warmup"]:
            times.append(dt)
            cpus.append(dc)
            saved_peaks.append(saved.peak_own_bytes)
            heap_peaks.append(heap.peak_above_base())
        losses.append(loss)
    params = sum(t.numel() * t.element_size() for t in stage.parameters())
    return {"times": times, "cpus": cpus, "saved": max(saved_peaks), "heap": max(heap_peaks), "rss": peak_rss_bytes(),
            "losses": losses, "params": params}


class _Loss(nn.Module):
    """``loss_fn(output, target)`` as a module, so :class:`Captured` can wrap it."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, out: Any, target: Any) -> Any:
        return self.fn(out, target)


def _measure(runtime: str, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    ranks = run_local_world(world, _worker, runtime, opts, timeout_s=opts["timeout"])
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise SystemExit(f"{runtime} P={world} failed:\n" + "\n".join(errors))
    steps = len(ranks[0]["times"])
    slowest = [max(r["times"][i] for r in ranks) for i in range(steps)]
    last_losses = ranks[-1]["losses"]
    cpu = [sum(r["cpus"][i] for r in ranks) for i in range(steps)]
    return {"step_s": statistics.median(slowest), "cpu_s": statistics.median(cpu), "saved": [r["saved"] for r in ranks],
            "heap": [r["heap"] for r in ranks], "rss": [r["rss"] for r in ranks], "losses": last_losses,
            "params": [r["params"] for r in ranks]}


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _report(world: int, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    print(f"\nP={world}: median step time  evenpipe {ours['step_s']:.3f} s   torch {theirs['step_s']:.3f} s   "
          f"ratio torch/evenpipe {theirs['step_s'] / ours['step_s']:.2f}")
    print(f"  median CPU seconds per step, all ranks: evenpipe {ours['cpu_s']:.2f}   torch {theirs['cpu_s']:.2f}   "
          f"ratio {theirs['cpu_s'] / ours['cpu_s']:.2f}")
    print(f"  first-step loss  evenpipe {ours['losses'][0]:.6f}   torch {theirs['losses'][0]:.6f}")
    print("  rank | saved MiB  ours  torch  ratio | step heap MiB  ours  torch  ratio | peak RSS MiB  ours  torch"
          " | grads MiB")
    for r in range(world):
        s0, s1 = ours["saved"][r], theirs["saved"][r]
        h0, h1 = ours["heap"][r], theirs["heap"][r]
        print(f"  {r:4d} |        {_mib(s0)} {_mib(s1)} {s1 / s0:6.2f} |           {_mib(h0)} {_mib(h1)} "
              f"{h1 / max(h0, 1):6.2f} |        {_mib(ours['rss'][r])} {_mib(theirs['rss'][r])} |  {_mib(ours['params'][r])}")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages", default="2,4", help="comma-separated pipeline sizes P")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per world before its ranks are killed")
    a = p.parse_args()
    opts = {"model": a.model, "seq_len": a.seq_len, "microbatch_size": a.microbatch_size,
            "microbatches": a.microbatches, "warmup": a.warmup, "steps": a.steps, "seed": a.seed,
            "timeout": a.timeout}
    import torch
    print(f"torch {torch.__version__}; {a.model} seq {a.seq_len}, micro-batch {a.microbatch_size}, "
          f"M={a.microbatches}; {a.warmup} warm-up + {a.steps} timed steps; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for world in (int(x) for x in a.stages.split(",")):
        ours = _measure("evenpipe", world, opts)
        theirs = _measure("torch", world, opts)
        _report(world, ours, theirs)


if __name__ == "__main__":
    main()
