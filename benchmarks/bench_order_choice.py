"""What choosing each step's micro-batch order costs and gains (issue 34 point 5), pure Python, predicted.

    .venv/bin/python benchmarks/bench_order_choice.py [--stages 8] [--microbatches 32] [--batches 20]
        [--evaluations 4] [--lengths FILE] [--json]

Global batches of the shipped document lengths (or ``--lengths FILE``) are planned with ``pack`` and ``balance``
into ``--microbatches`` micro-batches of 4 rows of 1024 tokens; a micro-batch's time is ``len + len**2 / (12 h)``
per document in units of one token's linear work (h = 768, a small GPT: attention is a visible share), spread evenly
over the stages, the backward twice the forward. For each batch and family the chooser
(:func:`evenpipe.plan.order_choice.choose_order`, at most ``--evaluations`` simulations) is timed in process CPU
seconds and its predicted step compared with the plan's own order. Reports the median and largest cost per choice
and the mean predicted gain; the issue asks under 10 ms per step at P=8 with 32 micro-batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from evenpipe.plan.lengths import read_lengths, shipped_lengths
from evenpipe.plan.microbatch import MicrobatchBudget, MicrobatchCost, plan_microbatches
from evenpipe.plan.order_choice import choose_order
from evenpipe.schedule import build_schedule
from evenpipe.sim.costs import StageCosts

FAMILIES = ("1f1b", "interleaved", "zb-h1")


def batches(lengths: list[int], budget: MicrobatchBudget, count: int, per_batch: int) -> list[list[int]]:
    """Consecutive documents, ``per_batch`` micro-batches' worth of tokens each (at most 90% full)."""
    out, cur, used, cap = [], [], 0, int(0.9 * budget.tokens * per_batch)
    for n in lengths:
        n = min(n, budget.row_len)
        if used + n > cap:
            out.append(cur)
            if len(out) == count:
                break
            cur, used = [], 0
        cur.append(n)
        used += n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--evaluations", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    lengths = read_lengths(a.lengths) if a.lengths else shipped_lengths()
    budget = MicrobatchBudget(row_len=1024, rows=4)
    cost = MicrobatchCost(per_token=1.0, per_square=1.0 / (12 * a.hidden))
    rows_out = []
    for family in FAMILIES:
        sched = build_schedule(family, num_ranks=a.stages, num_microbatches=a.microbatches)
        S = sched.num_stages
        for policy in ("pack", "balance"):
            ms, gains = [], []
            for docs in batches(lengths, budget, a.batches, a.microbatches):
                plan = plan_microbatches(docs, policy=policy, budget=budget, cost=cost,
                                         num_microbatches=a.microbatches)
                rows = [[StageCosts(forward=m.time / S, backward_input=2 * m.time / S, backward_weight=0.0,
                                    activation_bytes=m.bytes / S) for _ in range(S)] for m in plan.replicas[0]]
                choice = choose_order(sched, rows, max_evaluations=a.evaluations)
                ms.append(1e3 * choice.seconds)
                gains.append(choice.gain)
            rows_out.append({"family": family, "policy": policy, "batches": len(ms),
                             "choice_ms_median": statistics.median(ms), "choice_ms_max": max(ms),
                             "mean_gain": statistics.fmean(gains), "max_gain": max(gains)})
    if a.json:
        print(json.dumps({"stages": a.stages, "microbatches": a.microbatches, "evaluations": a.evaluations,
                          "rows": rows_out}, indent=1))
        return 0
    print(f"P={a.stages} M={a.microbatches}, at most {a.evaluations} simulations per choice")
    print(f"{'family':12s} {'policy':8s} {'batches':>7s} {'ms median':>9s} {'ms max':>7s} {'gain mean':>9s} "
          f"{'gain max':>8s}")
    for r in rows_out:
        print(f"{r['family']:12s} {r['policy']:8s} {r['batches']:7d} {r['choice_ms_median']:9.2f} "
              f"{r['choice_ms_max']:7.2f} {100 * r['mean_gain']:8.2f}% {100 * r['max_gain']:7.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
