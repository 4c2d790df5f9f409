"""evenpipe's executor against torch.distributed.pipelining, side by side, on every schedule both have (issues 3, 12).

Run: ``.venv/bin/python benchmarks/bench_torch_pipelining.py`` (defaults: gpt-mini = GPT 8 layers hidden 512,
seq 128, micro-batch 4, M=8, P=2 and P=4 CPU processes over gloo, 2 warm-up + 5 timed steps, every schedule
pair; ``--schedules 1f1b --stages 2,4`` for the headline row, ``--repeats N`` for more alternating runs).

Pairs (ours -> torch's): gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved (V=2) ->
ScheduleInterleaved1F1B, looped-bfs (V=2) -> ScheduleLoopedBFS, zb-h1 -> ScheduleInterleavedZeroBubble with one
stage per rank (its ZB1P), zb-v -> ScheduleZBVZeroBubble and dualpipev -> ScheduleDualPipeV (both V-shaped,
two stages per rank). Both runtimes get the same stage modules (``build_stage_modules`` over
``build_model(...).pipeline_parts()``, same seed, balanced layout, the same stage on the same rank), the same
global batches (``TokenBatches``, random tokens) and the same loss; each (runtime, schedule, P) runs in its own
fresh world of P processes, and the runs alternate (ours, torch's, ours, ...) ``--repeats`` times so slow drift
of the machine hits both. Per step: barrier, grads set to None, one pipeline step (forward and backward of every
micro-batch; no optimizer), then the slowest rank's wall time and the CPU seconds of all ranks; a run's figure is
the median over its timed steps, the table shows the median over runs with the spread (min-max over runs).
Memory, measured identically for both with the probes of ``pipe_probe.py``: autograd-saved bytes (peak), heap
peak during a step above the heap before the runtime existed (saved tensors plus kept stage outputs, receive
buffers, in-flight messages and gradients) and peak RSS. Ratios are torch / evenpipe: above 1 means evenpipe is
faster or smaller. The 1-minute load average is printed before every run.

``--paired`` measures time only, and more robustly where the machine's speed drifts within seconds (a shared
host): one world per row runs both runtimes on the same stage modules, and every batch is stepped by both, in an
order that alternates step by step; each step pair gives one ratio, and the row shows their median, quartiles and
range. (Memory needs a world per runtime: both runtimes' buffers live in a paired world.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_probe import host_line
from pipe_probe import (
    Captured,
    HeapSampler,
    SavedBytes,
    peak_rss_bytes,
    run_local_world,
)
from torch import nn


@dataclass(frozen=True)
class Pair:
    """One schedule both runtimes have."""

    ours: str
    """evenpipe family name."""
    chunks: int
    """Stages per rank V."""
    torch_class: str
    """The class in ``torch.distributed.pipelining``."""


PAIRS = {p.ours: p for p in (
    Pair("gpipe", 1, "ScheduleGPipe"), Pair("1f1b", 1, "Schedule1F1B"),
    Pair("interleaved", 2, "ScheduleInterleaved1F1B"), Pair("looped-bfs", 2, "ScheduleLoopedBFS"),
    Pair("zb-h1", 1, "ScheduleInterleavedZeroBubble"), Pair("zb-v", 2, "ScheduleZBVZeroBubble"),
    Pair("dualpipev", 2, "ScheduleDualPipeV"))}
SINGLE_STAGE = {"ScheduleGPipe", "Schedule1F1B"}
"""torch classes that take one stage, not a list."""


def _schedule(pair: Pair, world: int, m: int) -> Any:
    from evenpipe.schedule import build_schedule
    return build_schedule(pair.ours, num_ranks=world, num_microbatches=m,
                          num_chunks=pair.chunks if pair.ours in ("interleaved", "looped-bfs") else None)


def _setup(rank: int, world: int, pair: Pair, opts: dict[str, Any]) -> tuple[Any, dict[int, Any], Any, Any]:
    from evenpipe.models import build_model, model_config
    from evenpipe.runtime.data import TokenBatches
    from evenpipe.runtime.stages import build_stage_modules

    cfg = model_config(opts["model"], seq_len=opts["seq_len"])
    model = build_model(cfg, seed=opts["seed"])
    schedule = _schedule(pair, world, opts["microbatches"])
    mine = list(schedule.stages_of(rank))
    stages = build_stage_modules(model.pipeline_parts(), num_stages=schedule.num_stages, stages=mine)
    data = TokenBatches(source="random", seq_len=cfg.seq_len, vocab=cfg.vocab, seed=opts["seed"])
    return schedule, {s: stages[s] for s in mine}, data, cfg


def _worker(rank: int, world: int, runtime: str, pair_name: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.pipelining  # noqa: F401

    import evenpipe.runtime.executor  # noqa: F401  (import both runtimes before the heap base line)

    pair = PAIRS[pair_name]
    schedule, stages, data, _cfg = _setup(rank, world, pair, opts)
    modules = nn.ModuleList(stages.values())
    m, b = opts["microbatches"], opts["microbatch_size"]
    saved = SavedBytes(list(stages.values()))
    heap = HeapSampler(modules)
    heap.set_base()  # model built, runtime not yet: its persistent buffers count
    first, last = 0 in stages, schedule.num_stages - 1 in stages
    runtimes = ("evenpipe", "torch") if runtime == "both" else (runtime,)
    steps = {name: _make_step(name, rank, pair, schedule, stages, saved, m, first, last) for name in runtimes}
    out: dict[str, dict[str, Any]] = {name: {"times": [], "cpus": [], "saved": [], "heap": [], "losses": []}
                                      for name in runtimes}
    for i in range(opts["warmup"] + opts["steps"]):
        batch = data.batch(i, m * b)
        # paired: both runtimes take every batch, in an order that alternates step by step, so that the machine's
        # drift between two neighbouring steps hits both alike
        for name in (runtimes if i % 2 == 0 else runtimes[::-1]):
            for p in modules.parameters():
                p.grad = None
            dist.barrier()
            heap.start()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = steps[name](batch.tokens, batch.targets)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            rec = out[name]
            if i >= opts["warmup"]:
                rec["times"].append(dt)
                rec["cpus"].append(dc)
                rec["saved"].append(saved.peak_own_bytes)
                rec["heap"].append(heap.peak_above_base())
            rec["losses"].append(loss)
    params = sum(t.numel() * t.element_size() for t in modules.parameters())
    return {name: {"times": rec["times"], "cpus": rec["cpus"], "saved": max(rec["saved"]), "heap": max(rec["heap"]),
                   "rss": peak_rss_bytes(), "losses": rec["losses"], "params": params, "holds_last": last}
            for name, rec in out.items()}


def _make_step(runtime: str, rank: int, pair: Pair, schedule: Any, stages: dict[int, Any], saved: Any, m: int,
               first: bool, last: bool) -> Any:
    """One pipeline step (forward and backward of every micro-batch, no optimizer) of ``runtime`` on ``stages``;
    returns the step's mean loss on the last stage's rank, else None."""
    import torch

    from evenpipe.models import lm_loss
    if runtime == "evenpipe":
        from evenpipe.runtime.comm import build_groups
        from evenpipe.runtime.executor import PipelineExecutor
        groups = build_groups(schedule.num_ranks, 1)
        assert groups is not None
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss, stash=saved,
                              free_outputs=True)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
            return ex.step(tokens, targets).loss
        return step
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    pipe_stages = [PipelineStage(Captured(mod, saved, tag=s), s, schedule.num_stages, torch.device("cpu"))
                   for s, mod in stages.items()]
    loss_mod = Captured(_Loss(lm_loss), saved, tag=schedule.num_stages + rank)
    cls = getattr(pipelining, pair.torch_class)
    sched = cls(pipe_stages[0] if pair.torch_class in SINGLE_STAGE else pipe_stages, n_microbatches=m,
                loss_fn=loss_mod)

    def torch_step(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        saved.reset_peaks()
        losses: list[torch.Tensor] = []
        args = (tokens,) if first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if last else {}
        sched.step(*args, return_outputs=False, **kwargs)
        return float(torch.stack(losses).detach().mean()) if losses else None
    return torch_step


class _Loss(nn.Module):
    """``loss_fn(output, target)`` as a module, so :class:`Captured` can wrap it."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, out: Any, target: Any) -> Any:
        return self.fn(out, target)


def _measure(runtime: str, pair: str, world: int, opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per runtime (``runtime``, or both with ``"both"``): median slowest-rank step, CPU seconds, memory, losses."""
    ranks = run_local_world(world, _worker, runtime, pair, opts, timeout_s=opts["timeout"])
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise SystemExit(f"{runtime} {pair} P={world} failed:\n" + "\n".join(errors))
    return {name: _summarise([r[name] for r in ranks]) for name in ranks[0]}


def _summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = len(ranks[0]["times"])
    slowest = [max(r["times"][i] for r in ranks) for i in range(steps)]
    last_losses = next(r["losses"] for r in ranks if r["holds_last"])
    cpu = [sum(r["cpus"][i] for r in ranks) for i in range(steps)]
    return {"step_s": statistics.median(slowest), "cpu_s": statistics.median(cpu), "slowest": slowest,
            "saved": [r["saved"] for r in ranks],
            "heap": [r["heap"] for r in ranks], "rss": [r["rss"] for r in ranks], "losses": last_losses,
            "params": [r["params"] for r in ranks]}


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _spread(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in runs]
    return statistics.median(vals), min(vals), max(vals)


def _report(pair: Pair, world: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    (o, olo, ohi), (t, tlo, thi) = _spread(ours, "step_s"), _spread(theirs, "step_s")
    (oc, _, _), (tc, _, _) = _spread(ours, "cpu_s"), _spread(theirs, "cpu_s")
    beyond = olo > thi  # ours slower than torch's in every run, beyond the spread
    print(f"\n{pair.ours} vs {pair.torch_class}, P={world}, V={pair.chunks}, {len(ours)} run(s) each: median step "
          f"evenpipe {o:.3f} s [{olo:.3f}-{ohi:.3f}]   torch {t:.3f} s [{tlo:.3f}-{thi:.3f}]   "
          f"ratio torch/evenpipe {t / o:.2f}{'   (slower beyond the spread)' if beyond else ''}")
    print(f"  median CPU seconds per step, all ranks: evenpipe {oc:.2f}   torch {tc:.2f}   ratio {tc / oc:.2f}")
    print(f"  first-step loss  evenpipe {ours[0]['losses'][0]:.6f}   torch {theirs[0]['losses'][0]:.6f}")
    print("  rank | saved MiB  ours  torch  ratio | step heap MiB  ours  torch  ratio | peak RSS MiB  ours  torch"
          " | params MiB")
    a, c = ours[0], theirs[0]
    for r in range(world):
        s0, s1 = a["saved"][r], c["saved"][r]
        h0, h1 = a["heap"][r], c["heap"][r]
        print(f"  {r:4d} |        {_mib(s0)} {_mib(s1)} {s1 / max(s0, 1):6.2f} |           {_mib(h0)} {_mib(h1)} "
              f"{h1 / max(h0, 1):6.2f} |        {_mib(a['rss'][r])} {_mib(c['rss'][r])} |  {_mib(a['params'][r])}")
    sys.stdout.flush()
    return {"schedule": pair.ours, "P": world, "ratio": t / o, "beyond": beyond}


def _report_paired(pair: Pair, world: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    """Paired runs: the ratio of each step pair (same batch, neighbouring in time), its median and spread."""
    ratios = [t / o for a, c in zip(ours, theirs) for o, t in zip(a["slowest"], c["slowest"])]
    cpu = statistics.median(c["cpu_s"] for c in theirs) / statistics.median(a["cpu_s"] for a in ours)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    o = statistics.median(s for a in ours for s in a["slowest"])
    t = statistics.median(s for c in theirs for s in c["slowest"])
    beyond = q[2] < 1.0  # torch faster in three quarters of the step pairs or more
    print(f"\n{pair.ours} vs {pair.torch_class}, P={world}, V={pair.chunks}, paired, {len(ratios)} step pairs: "
          f"median step evenpipe {o:.3f} s   torch {t:.3f} s   ratio torch/evenpipe per pair: median "
          f"{statistics.median(ratios):.3f} [quartiles {q[0]:.3f}-{q[2]:.3f}, range {min(ratios):.3f}-"
          f"{max(ratios):.3f}]{'   (slower beyond the spread)' if beyond else ''}")
    print(f"  median CPU seconds per step, all ranks: ratio torch/evenpipe {cpu:.2f}")
    print(f"  first-step loss  evenpipe {ours[0]['losses'][0]:.6f}   torch {theirs[0]['losses'][0]:.6f}")
    sys.stdout.flush()
    return {"schedule": pair.ours, "P": world, "ratio": statistics.median(ratios), "beyond": beyond}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages", default="2,4", help="comma-separated pipeline sizes P")
    p.add_argument("--schedules", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs of each runtime per row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per world before its ranks are killed")
    p.add_argument("--paired", action="store_true",
                   help="both runtimes in one world on the same modules, alternating step by step (time only: "
                        "memory needs a world per runtime); ratio = median over step pairs")
    a = p.parse_args()
    names = [x for x in a.schedules.split(",") if x]
    bad = [x for x in names if x not in PAIRS]
    if bad:
        p.error(f"--schedules {','.join(bad)}: not a schedule both runtimes have ({', '.join(PAIRS)})")
    opts = {"model": a.model, "seq_len": a.seq_len, "microbatch_size": a.microbatch_size,
            "microbatches": a.microbatches, "warmup": a.warmup, "steps": a.steps, "seed": a.seed,
            "timeout": a.timeout}
    import torch
    print(f"torch {torch.__version__}; {a.model} seq {a.seq_len}, micro-batch {a.microbatch_size}, "
          f"M={a.microbatches}; {a.warmup} warm-up + {a.steps} timed steps; {a.repeats} alternating run(s); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(host_line(), flush=True)
    rows = []
    for name in names:
        for world in (int(x) for x in a.stages.split(",")):
            ours, theirs = [], []
            if a.paired:
                for rep in range(a.repeats):
                    print(f"  [{name} P={world} paired run {rep + 1}: load {os.getloadavg()[0]:.2f}]", flush=True)
                    both = _measure("both", name, world, opts)
                    ours.append(both["evenpipe"])
                    theirs.append(both["torch"])
                rows.append(_report_paired(PAIRS[name], world, ours, theirs))
                continue
            for rep in range(a.repeats):
                order = ("evenpipe", "torch") if rep % 2 == 0 else ("torch", "evenpipe")
                for runtime in order:
                    print(f"  [{name} P={world} run {rep + 1} {runtime}: load {os.getloadavg()[0]:.2f}]", flush=True)
                    (ours if runtime == "evenpipe" else theirs).append(_measure(runtime, name, world, opts)[runtime])
            rows.append(_report(PAIRS[name], world, ours, theirs))
    print("\nsummary (torch/evenpipe median step-time ratio; > 1: evenpipe faster):")
    for r in rows:
        print(f"  {r['schedule']:12s} P={r['P']}  {r['ratio']:.2f}{'  slower beyond the spread' if r['beyond'] else ''}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print(host_line(), flush=True)


if __name__ == "__main__":
    main()
