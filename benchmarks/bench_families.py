"""The schedule families side by side at unit costs (issue 9): step time, bubble (one step, and steps repeated
back to back with nothing synchronising the ranks), largest per-rank activation peak.

    .venv/bin/python benchmarks/bench_families.py [--stages 4,8] [--times 1,1,1]

Pure simulation (free links); ``--times F,B,W`` are the forward, input-gradient and weight-gradient times of a
whole rank's layers (B is the full backward of the families that do not split it, B + W in all). Peaks are in
activation units of a whole rank's layers; M = 4P.
"""

from __future__ import annotations

import argparse

from evenpipe.schedule import build_schedule
from evenpipe.schedule.build import plan_durations_for
from evenpipe.sim import SimCosts, simulate

ROWS = (("1f1b", None, False), ("zb-h1", None, False), ("zb-h2", None, False), ("zb-v", None, False),
        ("v-half", None, False), ("v-min", None, False), ("dualpipev", None, False), ("interleaved", 2, False),
        ("interleaved", 2, True), ("bpipe", None, False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="4,8", help="pipeline sizes P (default 4,8)")
    ap.add_argument("--times", default="1,1,1", help="F,B,W (default 1,1,1)")
    args = ap.parse_args()
    f, b, w = (float(x) for x in args.times.split(","))
    print(f"{'schedule':24s} {'P':>2s} {'M':>3s} {'step':>7s} {'bubble':>7s} {'repeated':>8s} {'peak':>6s}")
    for p in (int(x) for x in args.stages.split(",")):
        for family, chunks, bpipe in ROWS:
            sched = build_schedule(family, num_ranks=p, num_microbatches=4 * p, num_chunks=chunks, bpipe=bpipe,
                                   plan_durations=plan_durations_for(f, b, w))
            trace = simulate(sched, SimCosts.uniform(num_stages=sched.num_stages, num_chunks=sched.num_chunks,
                                                     forward=f, backward=b, weight=w))
            name = f"{family}{f' V={chunks}' if chunks else ''}{' --bpipe' if bpipe else ''}"
            print(f"{name:24s} {p:2d} {4 * p:3d} {trace.step_time:7.1f} {trace.bubble_fraction:7.1%} "
                  f"{trace.repeated_bubble_fraction:8.1%} {max(trace.peak_activations):6.2f}")


if __name__ == "__main__":
    main()
