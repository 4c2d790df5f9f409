"""Micro-batching policies side by side on a document-length distribution (issue 34): predicted only, pure Python.

    .venv/bin/python benchmarks/bench_microbatching.py [--lengths FILE] [--stages 4] [--hidden 4096] [--json]

Documents (the shipped ShareGPT-shaped lengths, or ``--lengths FILE``, one length per line) are cut into global
batches of about ``--batch-tokens`` real tokens in file order; each batch is planned with ``pad``, ``pack`` and
``balance`` (rows of ``--row-len`` tokens, ``--rows`` per micro-batch). A micro-batch's time is
``len + len**2 / (12 h)`` per document in units of one token's linear work: per token and layer a decoder does
about ``24 h**2`` FLOPs in its matrices and ``4 h * len`` in attention, halved by the causal mask (Narayanan et
al. 2021, eq. 2), so ``c / a = 2 h / (24 h**2)``. The step of a ``P``-stage pipeline is predicted as in
DynaPipe's simulation (``scripts/simulation/compare_batching_methods.py``): ``(sum of micro-batch times + (P - 1)
* slowest) / P`` per stage. Tokens per second count real tokens only; the ratios are ``balance/pad`` and
``balance/pack``. This measures nothing: the runtime does not yet carry per-micro-batch shapes.
"""

from __future__ import annotations

import argparse
import json
import sys

from evenpipe.plan.lengths import read_lengths, shipped_lengths, shipped_lengths_path
from evenpipe.plan.microbatch import MicrobatchBudget, MicrobatchCost, MicrobatchPlan, Policy, plan_microbatches


def global_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive documents, a batch closed before it would pass ``batch_tokens`` real tokens."""
    out: list[list[int]] = [[]]
    used = 0
    for n in lengths:
        if out[-1] and used + n > batch_tokens:
            out.append([])
            used = 0
        out[-1].append(n)
        used += n
    return out


def predicted_step(plan: MicrobatchPlan, stages: int) -> float:
    """DynaPipe's estimate per stage: every micro-batch once, the slowest again for each of the ``P - 1`` fill
    and drain slots; the slowest replica sets the step."""
    return max((sum(m.time for m in rep) + (stages - 1) * max((m.time for m in rep), default=0.0)) / stages
               for rep in plan.replicas)


def run(lengths: list[int], args: argparse.Namespace) -> dict:
    budget = MicrobatchBudget(row_len=args.row_len, rows=args.rows)
    cost = MicrobatchCost(per_token=1.0, per_square=1.0 / (12 * args.hidden))
    lengths = [min(n, args.row_len) for n in lengths]
    rows = {}
    for policy in Policy:
        step = tokens = imbalance = padding = 0.0
        count = 0
        batches = global_batches(lengths, args.batch_tokens)
        for batch in batches:
            plan = plan_microbatches(batch, policy=policy, budget=budget, cost=cost, num_replicas=args.replicas)
            step += predicted_step(plan, args.stages)
            tokens += sum(batch)
            imbalance += plan.imbalance
            padding += plan.padding_fraction
            count += len(plan.microbatches)
        rows[policy.value] = {"tokens_per_unit_time": tokens / step, "mean_imbalance": imbalance / len(batches),
                              "mean_padding": padding / len(batches), "microbatches_per_batch": count / len(batches)}
    tps = {k: v["tokens_per_unit_time"] for k, v in rows.items()}
    return {"policies": rows, "balance/pad": tps["balance"] / tps["pad"], "balance/pack": tps["balance"] / tps["pack"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=None, metavar="FILE", help="one document length per line (default: shipped)")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages P (default 4)")
    ap.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (default 1)")
    ap.add_argument("--hidden", type=int, default=4096, help="model width h: attention's share (default 4096)")
    ap.add_argument("--row-len", type=int, default=2048, help="tokens per row (default 2048; longer are clipped)")
    ap.add_argument("--rows", type=int, default=1, help="rows per micro-batch (default 1)")
    ap.add_argument("--batch-tokens", type=int, default=65536, help="real tokens per global batch (default 65536)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    try:
        lengths = read_lengths(args.lengths) if args.lengths else shipped_lengths()
    except ValueError as exc:
        sys.exit(f"bench_microbatching: {exc}")
    result = {"lengths": args.lengths or str(shipped_lengths_path().name), "documents": len(lengths),
              "stages": args.stages, "hidden": args.hidden, **run(lengths, args)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['documents']} documents from {result['lengths']}, P={args.stages}, h={args.hidden}")
    print(f"{'policy':8s} {'tokens/unit':>12s} {'max/mean':>9s} {'padding':>8s} {'mbs/batch':>10s}")
    for name, row in result["policies"].items():
        print(f"{name:8s} {row['tokens_per_unit_time']:12.4f} {row['mean_imbalance']:9.3f} "
              f"{row['mean_padding']:8.1%} {row['microbatches_per_batch']:10.1f}")
    print(f"balance/pad {result['balance/pad']:.2f}x   balance/pack {result['balance/pack']:.3f}x (predicted)")


if __name__ == "__main__":
    main()
