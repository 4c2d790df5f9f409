"""Planner speed: ``evenpipe plan --model gpt3-175b --gpu a100-80gb --gpus 1024 --global-batch 1536``.

Each repeat runs in a fresh process (cold caches, imports excluded) and times the whole search; the script prints
the wall and CPU time and the number of configurations left after each pruning step.
Run: ``.venv/bin/python benchmarks/bench_plan.py [--explain] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _once(args: argparse.Namespace) -> dict[str, object]:
    from evenpipe.cost import hardware_preset, model_preset
    from evenpipe.plan import Searcher, SearchSpace, explain_bpipe

    model, hw = model_preset(args.model), hardware_preset(args.gpu)
    searcher = Searcher(model, hw)
    t0, c0 = time.perf_counter(), time.process_time()
    result = searcher.search(num_gpus=args.gpus, global_batch=args.global_batch, space=SearchSpace(),
                             top_k=args.top)
    verdict = None
    if args.explain:
        verdict = explain_bpipe(searcher, num_gpus=args.gpus, global_batch=args.global_batch).verdict.value
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    best = result.best
    return {"wall_s": wall, "cpu_s": cpu, "stats": result.stats.to_dict(), "verdict": verdict,
            "best": f"{best.config.describe()}  step {best.step_time_s:.3f} s  MFU {100 * best.mfu:.1f}%"}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--explain", action="store_true", help="also time --explain bpipe")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(_once(args)))
        return
    load_before = os.getloadavg()[0]
    child = [sys.executable, __file__, "--once", "--model", args.model, "--gpu", args.gpu, "--gpus", str(args.gpus),
             "--global-batch", str(args.global_batch), "--top", str(args.top)] + (["--explain"] if args.explain else [])
    runs = [json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            for _ in range(args.repeat)]
    s = runs[0]["stats"]
    print(f"plan {args.model} on {args.gpus} x {args.gpu}, global batch {args.global_batch}, top {args.top}"
          + (" + explain bpipe" if args.explain else ""))
    print(f"  enumerated                          {s['enumerated']:5d}")
    print(f"  invalid (check_config, generator)   {s['invalid']:5d}")
    print(f"  over memory                         {s['over_memory']:5d}")
    print(f"  skipped by the step-time bound      {s['bounded']:5d}")
    print(f"  dominated (lighter recompute fits)  {s['dominated']:5d}")
    print(f"  simulated (estimate)                {s['estimated']:5d}")
    walls = [r["wall_s"] for r in runs]
    cpus = [r["cpu_s"] for r in runs]
    print(f"  wall: {', '.join(f'{w:.2f}' for w in walls)} s (best {min(walls):.2f}); CPU: "
          f"{', '.join(f'{c:.2f}' for c in cpus)} s; 1-min load average at start {load_before:.1f}")
    print(f"  best: {runs[0]['best']}" + (f"; BPipe {runs[0]['verdict']}" if args.explain else ""))


if __name__ == "__main__":
    main()
