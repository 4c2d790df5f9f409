"""BPipe against 1F1B in evenpipe's runtime, side by side (issue 4): step time, per-rank activation peaks, and
the largest micro-batch that fits a fixed per-rank activation budget.

Run: ``.venv/bin/python benchmarks/bench_bpipe.py`` (defaults: gpt-mini = GPT 8 layers hidden 512 at seq 32,
P=4 and P=8 local gloo processes, M=2P, micro-batch b0=4, 6 steps per run).

1. For each P, ``evenpipe train --schedule 1f1b`` and ``--schedule bpipe`` (same model, seed, data, P, M, b0)
   with ``--json-out``, alternated ``--repeat`` times: median step time of each run (the best run of each
   schedule is compared; the machine is shared), per-rank peak activation bytes (own plus hosted, as the
   runtime's activation stash measures them), hosted peak, bytes evicted per step, peak RSS (first run).
2. Fit: budget = 1F1B's rank-0 peak at b0. Per-micro-batch activation bytes are measured once per size b (one
   forward of every stage in this process, counted by the same ``ActivationStash`` with the executor's holds);
   a schedule's peak at size b is predicted as its measured peak at b0 scaled by the measured unit ratio
   ``u(b)/u(b0)`` (per rank: the larger unit of the rank and its BPipe partner). The largest b whose predicted
   peak fits the budget on every rank is reported; with ``--verify`` BPipe is then run at that b and its
   measured peak is checked against the budget.
3. ``--heap`` (default on): the same two schedules at b0 in worlds started here, each rank's real memory measured
   as in ``bench_torch_pipelining.py`` (glibc heap peak during a step above the heap before the runtime existed;
   ``gc.collect()`` before each step), to check that what the stash accounts is what the process uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipe_probe import HeapSampler, run_local_world

EVENPIPE = [sys.executable, "-m", "evenpipe"]


def _train(schedule: str, P: int, b: int, a: argparse.Namespace) -> dict[str, Any] | str:
    """One ``evenpipe train`` run; its JSON summary, or a one-line reason it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [*EVENPIPE, "train", "--model", a.model, "--seq-len", str(a.seq_len), "--schedule", schedule,
               "--stages", str(P), "--microbatches", str(2 * P), "--microbatch-size", str(b), "--steps",
               str(a.steps), "--random-tokens", "--seed", str(a.seed), "--timeout", str(a.peer_timeout),
               "--json-out", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_timeout, check=False)
        except subprocess.TimeoutExpired:
            return f"no result within {a.run_timeout:.0f} s"
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            hint = next((line for line in reversed(tail) if "Error" in line or "Failure" in line), tail[-1] if tail
                        else "")
            return f"exit {proc.returncode}: {hint[:300]}"
        with open(out) as f:
            return dict(json.load(f))


def unit_bytes(model: str, seq_len: int, P: int, b: int, seed: int) -> list[int]:
    """Measured activation bytes one micro-batch of size ``b`` leaves on each of the P stages (saved tensors
    plus the received input and kept output, as the executor holds them before it frees sent outputs)."""
    import torch

    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash

    torch.set_num_threads(1)
    cfg = model_config(model, seq_len=seq_len)
    stages = build_stage_modules(build_model(cfg, seed=seed).pipeline_parts(), num_stages=P, stages=range(P))
    tokens = torch.randint(0, cfg.vocab, (b, seq_len), generator=torch.Generator().manual_seed(seed))
    x: torch.Tensor = tokens
    out = []
    for s in range(P):
        stash = ActivationStash([stages[s]])
        if s > 0:
            x = x.detach().requires_grad_(True)
            stash.hold((s, 0), x)
        with stash.capture((s, 0)):
            y = stages[s](x)
            if s == P - 1:
                y = lm_loss(y, tokens)
        if s < P - 1:
            stash.hold((s, 0), y)
        out.append(stash.bytes_of((s, 0)))
        x = y
    return out


def _heap_worker(rank: int, world: int, schedule: str, b: int, a: argparse.Namespace) -> list[int]:
    """One rank of a heap-probe world: peak glibc heap above the pre-runtime base, per step (bytes)."""
    import gc

    import torch.distributed as dist

    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.data import TokenBatches
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.schedule import build_schedule

    cfg = model_config(a.model, seq_len=a.seq_len)
    sched = build_schedule(schedule, num_ranks=world, num_microbatches=2 * world)
    stages = build_stage_modules(build_model(cfg, seed=a.seed).pipeline_parts(), num_stages=world, stages=[rank])
    heap = HeapSampler(stages[rank])
    heap.set_base()
    groups = build_groups(world, 1, timeout_s=a.peer_timeout)
    assert groups is not None
    ex = PipelineExecutor(schedule=sched, stages=stages, groups=groups, loss_fn=lm_loss, stash=ActivationStash())
    data = TokenBatches(source="random", seq_len=cfg.seq_len, vocab=cfg.vocab, seed=a.seed)
    peaks = []
    for i in range(3):
        batch = data.batch(i, 2 * world * b)
        for p in stages[rank].parameters():
            p.grad = None
        gc.collect()  # leftovers of the previous step are not this step's memory
        dist.barrier()
        heap.start()
        ex.step(batch.tokens, batch.targets)
        peaks.append(heap.peak_above_base())
    return peaks


def heap_probe(P: int, b: int, a: argparse.Namespace) -> dict[str, list[int]]:
    """Per schedule, each rank's largest step heap peak (see ``pipe_probe.py``), from its own world."""
    out = {}
    for schedule in ("1f1b", "bpipe"):
        ranks = run_local_world(P, _heap_worker, schedule, b, a, timeout_s=a.run_timeout)
        out[schedule] = [max(r) if isinstance(r, list) else -1 for r in ranks]
    return out


def _largest_fit(peaks: list[int], units: dict[int, list[int]], b0: int, budget: int) -> int:
    """Largest b whose predicted per-rank peaks (measured at b0, scaled by unit ratios) all fit ``budget``."""
    P = len(peaks)
    best = 0
    for b in sorted(units):
        scale = [max(units[b][r], units[b][P - 1 - r]) / max(units[b0][r], units[b0][P - 1 - r]) for r in range(P)]
        if all(peaks[r] * scale[r] <= budget for r in range(P)):
            best = b
    return best


def _mib(n: float) -> str:
    return f"{n / 2**20:7.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--stages", default="4,8", help="comma-separated pipeline sizes P (M = 2P)")
    p.add_argument("--microbatch-size", type=int, default=4, help="b0: the size that sets the budget")
    p.add_argument("--max-microbatch", type=int, default=12, help="largest size the fit search considers")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeat", type=int, default=2, help="runs per schedule (alternating); best median is compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="run BPipe at the size found and check its measured peak")
    p.add_argument("--heap", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure each rank's real step heap (glibc) for both schedules at b0")
    p.add_argument("--peer-timeout", type=float, default=60.0, help="evenpipe train --timeout")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is abandoned")
    a = p.parse_args()
    b0 = a.microbatch_size
    print(f"{a.model} seq {a.seq_len}, M=2P, micro-batch b0={b0}, {a.steps} steps per run; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for P in (int(x) for x in a.stages.split(",")):
        tries: dict[str, list[dict[str, Any] | str]] = {"1f1b": [], "bpipe": []}
        for _ in range(a.repeat):  # alternate the two, so load drifts hit both alike
            for s, got in tries.items():
                got.append(_train(s, P, b0, a))
        print(f"\nP={P} M={2 * P} b0={b0}")
        failed = [f"  {s}: FAILED ({r})" for s, rs in tries.items() for r in rs if isinstance(r, str)]
        if failed:
            print("\n".join(failed))
            continue
        done = {s: [r for r in rs if isinstance(r, dict)] for s, rs in tries.items()}
        runs = {s: rs[0] for s, rs in done.items()}
        plain, bp = runs["1f1b"], runs["bpipe"]
        times: dict[str, list[float]] = {s: [float(r["step_time_s"]) for r in rs] for s, rs in done.items()}
        t0, t1 = min(times["1f1b"]), min(times["bpipe"])
        print(f"  median step time per run: 1f1b {' '.join(f'{t:.3f}' for t in times['1f1b'])} s, bpipe "
              f"{' '.join(f'{t:.3f}' for t in times['bpipe'])} s; best: bpipe/1f1b {t1 / t0:.2f}")
        print("  rank | peak act MiB 1f1b  bpipe (hosted)  bpipe/1f1b | evicted MiB/step | peak RSS MiB 1f1b bpipe")
        for r in range(P):
            a0, a1 = plain["peak_activation_bytes"][r], bp["peak_activation_bytes"][r]
            print(f"  {r:4d} |        {_mib(a0)} {_mib(a1)} ({_mib(bp['peak_hosted_bytes'][r])})    {a1 / a0:5.2f} |"
                  f"          {_mib(bp['evicted_bytes_per_step'][r])} |     {_mib(plain['peak_rss_bytes'][r])} "
                  f"{_mib(bp['peak_rss_bytes'][r])}")
        m0, m1 = max(plain["peak_activation_bytes"]), max(bp["peak_activation_bytes"])
        print(f"  largest rank peak: 1f1b {_mib(m0)} MiB, bpipe {_mib(m1)} MiB ({m1 / m0:.2f}x)")
        units = {b: unit_bytes(a.model, a.seq_len, P, b, a.seed) for b in range(1, a.max_microbatch + 1)}
        budget = plain["peak_activation_bytes"][0]
        fit = {s: _largest_fit(runs[s]["peak_activation_bytes"], units, b0, budget) for s in runs}
        lin = max(abs(units[b][r] / units[b0][r] - b / b0) for b in units for r in range(P))
        print(f"  unit bytes per stage at b=1: {units[1]} (linear in b within {lin:.1%})")
        print(f"  budget = 1F1B rank-0 peak at b0 = {_mib(budget)} MiB; largest micro-batch that fits: "
              f"1f1b b={fit['1f1b']}, bpipe b={fit['bpipe']} ({fit['bpipe'] / max(fit['1f1b'], 1):.2f}x)")
        if a.verify and fit["bpipe"] > b0:
            check = _train("bpipe", P, fit["bpipe"], a)
            if isinstance(check, str):
                print(f"  verify bpipe at b={fit['bpipe']}: FAILED ({check})")
            else:
                top = max(check["peak_activation_bytes"])
                print(f"  verify bpipe at b={fit['bpipe']}: measured largest rank peak {_mib(top)} MiB "
                      f"{'<=' if top <= budget else '>'} budget {_mib(budget)} MiB")
        if a.heap:
            heap = heap_probe(P, b0, a)
            print("  real memory, step heap above the pre-runtime base (MiB; saved tensors, kept outputs, message "
                  "buffers, gradients):")
            for r in range(P):
                h0, h1 = heap["1f1b"][r], heap["bpipe"][r]
                print(f"  {r:4d} | 1f1b {_mib(h0)}  bpipe {_mib(h1)}  bpipe/1f1b {h1 / max(h0, 1):5.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
