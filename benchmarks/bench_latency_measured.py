"""Latency-aware against 1F1B, ZB-H1 (and interleaved where the model has the blocks) with every link emulated
slow, measured on this machine (issue 35 point 4).

    .venv/bin/python benchmarks/bench_latency_measured.py                       # P=4 gpt-tiny, a forward per message
    .venv/bin/python benchmarks/bench_latency_measured.py --latency 0.25 --repeats 5
    .venv/bin/python benchmarks/bench_latency_measured.py --quick               # a short check that it runs
    .venv/bin/python benchmarks/bench_latency_measured.py --stages 2 --latency 1 --json-out DIR/latency.json

1. A stage's forward ``F`` is measured first: the median forward of a 1f1b run without delays (``train
   --trace-json``), with its fused backward ``B``, and a zb-h1 run's ``I`` and ``W``: latency-aware always splits
   the backward, which on a CPU costs more than the fused ``B`` (gpt-tiny, b=8: I+W about 1.2 B), so its gain
   is also given against each baseline alone (``gain_vs``; zb-h1 splits too).
2. Every pair of pipeline ranks gets ``--emulate-link-delay`` of ``--latency`` x ``F`` (each message lands that
   long after it is sent; the sender goes on, see :mod:`evenpipe.runtime.emulation`).
3. Each round runs every schedule once, in an order that rotates from round to round (``train --json-out``: the
   median over its steps of the slowest rank's step); latency-aware is ordered for the same latency
   (``--plan-link-latency``) with the placement (one stage per rank, or the V where the model has 2P blocks) whose
   simulated step is shorter.

Without ``--microbatches``, M is the one of P, 2P, 4P and 8P whose simulated gain (F = I = W) is largest at this P
and latency: at P=4 and one forward M=4 (16%); at P=2 M=16 (19%; M=4 would give 6%, below the issue's 10%).

Printed: each round's steps, the ratio latency-aware / best baseline of the round, and its median and spread over
rounds, beside the simulator's ratio for the same P, M and latency (F = I = W), and a note for each target the run
cannot show. ``--json-out`` writes all of it with P, the host's cores and its load average before and after. Timing
needs a quiet host with a core per process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_latency  # noqa: E402
from bench_uneven import _load, _run, core_note, host_state  # noqa: E402  (load; a command run, its tail on failure)

GAIN_TARGET = 0.10
"""The issue's measured gain (its simulated one is 15%)."""


def _train(args: argparse.Namespace, out: pathlib.Path, *extra: str) -> dict:
    """One ``evenpipe train`` run; its --json-out summary."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "evenpipe", "train", "--model", args.model, "--stages", str(args.stages),
          "--microbatches", str(args.microbatches), "--microbatch-size", str(args.microbatch_size),
          "--random-tokens", "--json-out", str(out), *extra])
    return json.loads(out.read_text())


def compute_ms(args: argparse.Namespace, out: pathlib.Path) -> dict[str, float]:
    """Median milliseconds of a stage's F and fused B (a 1f1b run) and of its I and W (a zb-h1 run), no delays."""
    from evenpipe.sim.trace import Trace
    medians: dict[str, float] = {}
    for family in ("1f1b", "zb-h1"):
        trace_path = out / f"{family}_trace.json"
        _train(args, out / f"{family}_free.json", "--schedule", family, "--steps", str(max(3, args.steps // 2)),
               "--trace-json", str(trace_path))
        by_kind: dict[str, list[float]] = {}
        for r in Trace.from_json(trace_path.read_text()).compute_records():
            by_kind.setdefault(r.kind.value, []).append(r.duration * 1e3)
        medians.update({k: statistics.median(v) for k, v in by_kind.items() if k not in medians})
    return medians


def split_note(ms: dict[str, float], gains: dict[str, float]) -> list[str]:
    """A note when the split backward (I then W) costs more than the fused B here: latency-aware always splits."""
    if not {"B", "I", "W"} <= set(ms):
        return []
    extra = (ms["I"] + ms["W"]) / ms["B"] - 1
    if extra < 0.05:
        return []
    vs = ", ".join(f"{n} {g:+.1%}" for n, g in gains.items())
    return [f"the split backward costs {extra:.0%} more than the fused B on this host (I+W {ms['I'] + ms['W']:.2f} "
            f"ms, B {ms['B']:.2f} ms): latency-aware always splits, 1f1b and interleaved do not; its median gain "
            f"against each baseline: {vs} (zb-h1 splits too)"]


def schedules(args: argparse.Namespace, blocks: int) -> dict[str, list[str]]:
    """Each schedule's ``train`` options; latency-aware with its simulated better placement."""
    P, M = args.stages, args.microbatches
    runs = {"1f1b": ["--schedule", "1f1b"], "zb-h1": ["--schedule", "zb-h1"]}
    chunks = [1]
    if blocks >= 2 * P:
        runs["interleaved"] = ["--schedule", "interleaved", "--chunks", "2"]
        chunks.append(2)
    base, ours = bench_latency.compare(P, M, args.latency)
    best_v = min(chunks, key=lambda v: ours[v - 1][0])
    runs["latency-aware"] = ["--schedule", "latency-aware", "--chunks", str(best_v),
                             "--plan-link-latency", str(args.latency)]
    return runs


def best_microbatches(P: int, latency: float, blocks: int) -> tuple[int, dict[int, float]]:
    """The M among P, 2P, 4P, 8P with the largest simulated gain of latency-aware over the best baseline, and the
    gain of each (the V placement and interleaved only where the model has 2P blocks)."""
    gains = {}
    for M in (P, 2 * P, 4 * P, 8 * P):
        base, ours = bench_latency.compare(P, M, latency)
        v = 2 if blocks >= 2 * P else 1
        steps = [t for (t, _), name in zip(base, ("1f1b", "interleaved", "zb-h1")) if v == 2 or name != "interleaved"]
        gains[M] = 1 - min(t for t, _ in ours[:v]) / min(steps)
    return max(gains, key=lambda m: (gains[m], -m)), gains


def simulated_ratio(args: argparse.Namespace, names: list[str]) -> float:
    """The simulator's latency-aware step over the best measured baseline's, at F = I = W."""
    base, ours = bench_latency.compare(args.stages, args.microbatches, args.latency)
    steps = dict(zip(("1f1b", "interleaved", "zb-h1"), (t for t, _ in base)))
    best = min(steps[n] for n in names if n != "latency-aware")
    chunks = 2 if "interleaved" in names else 1
    return min(t for t, _ in ours[:chunks]) / best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step M (default: of P, 2P, 4P, 8P the one simulated best, see above)")
    p.add_argument("--microbatch-size", type=int, default=8,
                   help="sequences per micro-batch (default 8: a gpt-tiny stage's forward then takes milliseconds)")
    p.add_argument("--latency", type=float, default=1.0, help="each message's delay in forwards of a stage (>= 0.25)")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every schedule")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_latency_measured_out"))
    p.add_argument("--json-out", type=pathlib.Path, default=None, help="write the result as JSON to this file")
    p.add_argument("--quick", action="store_true", help="a short check that it runs (numbers noisy)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    from evenpipe.cost.specs import MODEL_PRESETS
    if args.model not in MODEL_PRESETS or args.stages < 2 or args.latency < 0:
        print(f"--model {args.model!r} must be a preset and --stages {args.stages} >= 2, --latency {args.latency} "
              ">= 0", file=sys.stderr)
        return 2
    blocks = MODEL_PRESETS[args.model].num_layers
    chosen, gains = best_microbatches(args.stages, args.latency, blocks)
    args.microbatches = args.microbatches or chosen
    host0, load0, t0 = host_state(), _load(), time.perf_counter()
    ms = compute_ms(args, args.out)
    f = ms["F"] / 1e3
    delay_ms = args.latency * f * 1e3
    links = [x for a in range(args.stages) for b in range(a + 1, args.stages)
             for x in ("--emulate-link-delay", f"{a}-{b}:{delay_ms:.4f}")]
    runs = schedules(args, blocks)
    names = list(runs)
    print(f"{args.model} P={args.stages} M={args.microbatches}: every link {delay_ms:.2f} ms ({args.latency:g} "
          f"forward); a stage's " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()) + f" ms; load {load0}")
    ratios: list[float] = []
    rounds: list[dict[str, float]] = []
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        steps = {n: _train(args, args.out / f"r{rep}_{n}.json", "--steps", str(args.steps), *runs[n],
                           *links)["step_time_s"] for n in order}
        best = min(v for n, v in steps.items() if n != "latency-aware")
        ratios.append(steps["latency-aware"] / best)
        print(f"round {rep}: " + "  ".join(f"{n} {steps[n] * 1e3:7.1f} ms" for n in names)
              + f"  ratio {ratios[-1]:.3f}", flush=True)
        rounds.append(steps)
    med, sim = statistics.median(ratios), simulated_ratio(args, names)
    gain_vs = {n: 1 - statistics.median(r["latency-aware"] / r[n] for r in rounds) for n in names
               if n != "latency-aware"}
    seconds = time.perf_counter() - t0
    print(f"latency-aware / best baseline: median {med:.3f} (gain {1 - med:+.1%}), spread {min(ratios):.3f}-"
          f"{max(ratios):.3f} over {len(ratios)} rounds; simulated {sim:.3f}; "
          f"load {load0} -> {_load()}, {seconds:.0f} s")
    notes = core_note(args.stages, host0["cores"]) + split_note(ms, gain_vs)
    if 1 - sim < GAIN_TARGET:
        notes.append(f"the simulator's gain at P={args.stages} M={args.microbatches} latency {args.latency:g} is "
                     f"{1 - sim:.1%}, below the issue's measured {GAIN_TARGET:.0%}: the target cannot be shown here "
                     f"(simulated gain by M: {', '.join(f'{m}: {g:.1%}' for m, g in gains.items())})")
    for note in notes:
        print(f"note: {note}")
    if args.json_out:
        result = {"model": args.model, "stages": args.stages, "microbatches": args.microbatches,
                  "microbatch_size": args.microbatch_size, "latency_forwards": args.latency, "forward_s": f,
                  "compute_ms": ms, "gain_vs": gain_vs,
                  "link_delay_ms": delay_ms, "steps": args.steps, "repeats": args.repeats, "rounds_step_s": rounds,
                  "ratios": ratios, "median_ratio": med, "gain": 1 - med, "simulated_ratio": sim,
                  "simulated_gain_by_microbatches": {str(m): g for m, g in gains.items()},
                  "host_before": host0, "host_after": host_state(), "seconds": seconds, "notes": notes}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
