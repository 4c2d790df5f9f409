"""Simulator speed: how long one simulated step takes for large schedules (wall and CPU seconds, best of N).

Run: ``.venv/bin/python benchmarks/bench_sim.py`` (``--repeat N``, ``--quick`` for the first row only).
Building the schedule is timed separately; only :func:`evenpipe.sim.simulate` counts as simulation.
"""

from __future__ import annotations

import argparse
import os
import time

from evenpipe.schedule import build_schedule
from evenpipe.sim import Link, SimCosts, simulate

CASES = [  # (family, P, M, V, link)
    ("1f1b", 64, 1024, 1, Link()),
    ("1f1b", 64, 1024, 1, Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)),
    ("bpipe", 64, 1024, 1, Link()),
    ("interleaved", 16, 256, 4, Link()),
    ("zb-h1", 32, 512, 1, Link()),
]


def _best(fn: "object", repeat: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()  # type: ignore[operator]
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="only the 1F1B P=64 M=1024 row")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; best of {args.repeat}")
    print(f"{'schedule':<12} {'P':>3} {'M':>5} {'V':>2} {'link':<6} {'actions':>8} {'build s':>8} "
          f"{'sim wall s':>10} {'sim cpu s':>9} {'us/action':>9}")
    for family, p, m, v, link in CASES[:1] if args.quick else CASES:
        t0 = time.perf_counter()
        sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v)
        build = time.perf_counter() - t0
        costs = SimCosts.uniform(num_stages=sched.num_stages, num_chunks=v, output_bytes=1e6, link=link)
        wall, cpu = _best(lambda: simulate(sched, costs), args.repeat)
        actions = sum(len(a) for a in sched.actions)
        kind = "free" if link.bandwidth_bytes_per_s == float("inf") and link.latency_s == 0 else "1GB/s"
        print(f"{family:<12} {p:>3} {m:>5} {v:>2} {kind:<6} {actions:>8} {build:>8.2f} {wall:>10.3f} {cpu:>9.3f} "
              f"{wall / actions * 1e6:>9.2f}")


if __name__ == "__main__":
    main()
