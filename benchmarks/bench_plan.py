"""Planner speed: ``evenpipe plan --model gpt3-175b --gpu a100-80gb --gpus 1024 --global-batch 1536``.

Prints the wall time of the whole search (best of ``--repeat`` runs, each with a fresh cache) and the number of
candidates left after each pruning step. Run: ``.venv/bin/python benchmarks/bench_plan.py``.
"""

from __future__ import annotations

import argparse
import time

from evenpipe.cost import hardware_preset, model_preset
from evenpipe.plan.explain import explain_bpipe
from evenpipe.plan.search import Searcher, SearchSpace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--explain", action="store_true", help="also time --explain bpipe")
    args = parser.parse_args()
    model, hw = model_preset(args.model), hardware_preset(args.gpu)
    times = []
    for _ in range(args.repeat):
        searcher = Searcher(model, hw)
        t0 = time.perf_counter()
        result = searcher.search(num_gpus=args.gpus, global_batch=args.global_batch, space=SearchSpace(),
                                 top_k=args.top)
        if args.explain:
            explain_bpipe(searcher, result)
        times.append(time.perf_counter() - t0)
    s = result.stats
    print(f"plan {args.model} on {args.gpus} x {args.gpu}, global batch {args.global_batch}, top {args.top}"
          + (" + explain bpipe" if args.explain else ""))
    print(f"  enumerated             {s.num_enumerated:6d}")
    print(f"  invalid (check_config) {s.num_invalid:6d}  -> {s.num_enumerated - s.num_invalid} valid")
    print(f"  over memory            {s.num_over_memory:6d}  -> {s.num_fitting} fit")
    print(f"  skipped by bound       {s.num_bounded:6d}  -> {s.num_estimated} simulated")
    print(f"  time: best {min(times):.2f} s of {len(times)} (all: {', '.join(f'{t:.2f}' for t in times)})")
    best = result.best
    print(f"  best: {best.config.describe()}  step {best.step_time_s:.3f} s  MFU {100 * best.mfu:.1f}%")


if __name__ == "__main__":
    main()
