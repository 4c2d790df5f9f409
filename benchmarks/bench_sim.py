"""Simulator speed: the event engine (the reference) against the dataflow evaluation, side by side in one run.

Run: ``.venv/bin/python benchmarks/bench_sim.py`` (``--repeat N``, ``--quick`` for the first row only).
Per row, calls alternate between the two so both see the same machine; best of N, wall and CPU seconds.
``events`` is :func:`evenpipe.sim.engine.simulate_events`; ``first`` is :func:`evenpipe.sim.simulate` on a
schedule it has not seen (the shape is compiled, then evaluated); ``again`` is a later call on the same
schedule object with other costs (the compiled shape is reused, as in planner and cost sweeps). Every result is
checked equal to the reference's; the last column names the evaluator that answered ``first``
(:mod:`evenpipe.sim.dispatch`). Building the schedule is timed separately.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Callable

from evenpipe.schedule import build_schedule
from evenpipe.sim import Link, SimCosts, simulate
from evenpipe.sim import fast
from evenpipe.sim.engine import simulate_events

CASES = [  # (family, P, M, V, link)
    ("1f1b", 64, 1024, 1, Link()),
    ("1f1b", 64, 1024, 1, Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)),
    ("bpipe", 64, 1024, 1, Link()),
    ("interleaved", 16, 256, 4, Link()),
    ("zb-h1", 32, 512, 1, Link()),
]


def _timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="only the 1F1B P=64 M=1024 row")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; best of {args.repeat}; CPU seconds "
          f"(wall in brackets)")
    print(f"{'schedule':<12} {'P':>3} {'M':>5} {'V':>2} {'link':<6} {'actions':>8} {'build':>6} "
          f"{'events':>14} {'first':>14} {'again':>14} {'x first':>7} {'x again':>7} {'us/act again':>12} evaluator")
    for family, p, m, v, link in CASES[:1] if args.quick else CASES:
        build_wall, _, _ = _timed(lambda: build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v))
        costs = SimCosts.uniform(num_stages=p * v, num_chunks=v, output_bytes=1e6, link=link)
        other = dataclasses.replace(costs, stages=tuple(dataclasses.replace(st, forward=st.forward * 1.5)
                                                        for st in costs.stages))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v)  # unseen object
            fast._cache.clear()
            runs = {"events": lambda: simulate_events(sched, costs), "first": lambda: simulate(sched, costs),
                    "again": lambda: simulate(sched, other)}
            results = {}
            for name, fn in runs.items():
                wall, cpu, results[name] = _timed(fn)
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], wall), min(old[1], cpu))
            assert results["first"] == results["events"], "dataflow trace differs from the event engine's"
            assert results["again"] == simulate_events(sched, other), "dataflow trace differs (other costs)"
        actions = sum(len(a) for a in sched.actions)
        kind = "free" if link.bandwidth_bytes_per_s == float("inf") and link.latency_s == 0 else "1GB/s"
        cell = {k: f"{c:.3f} ({w:.3f})" for k, (w, c) in best.items()}
        print(f"{family:<12} {p:>3} {m:>5} {v:>2} {kind:<6} {actions:>8} {build_wall:>6.2f} {cell['events']:>14} "
              f"{cell['first']:>14} {cell['again']:>14} {best['events'][1] / best['first'][1]:>7.2f} "
              f"{best['events'][1] / best['again'][1]:>7.2f} {best['again'][1] / actions * 1e6:>12.2f} "
              f"{getattr(results['first'], 'evaluator', '?')}")


if __name__ == "__main__":
    main()
