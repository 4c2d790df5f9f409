"""Micro-batching policies side by side on a document-length distribution (issue 34): predicted by the simulator.

    .venv/bin/python benchmarks/bench_microbatching.py [--lengths FILE] [--model llama2-7b] [--gpu h100-80gb]
        [--setup TP,PP,DP ...] [--rows 4] [--replica-tokens 65536] [--json]

Documents (the shipped ShareGPT-shaped lengths, or ``--lengths FILE``, one length per line, clipped to the row
length ``--row-len``, default the model's 2048) are cut in file order into global batches of about
``--replica-tokens`` real tokens per data-parallel replica. Each batch is planned with ``pad``, ``pack`` and
``balance`` (micro-batches of ``--rows`` rows) and each plan is predicted by
:func:`evenpipe.plan.varlen_predict.predict_throughput`: every micro-batch priced by the analytic cost source at
its own tokens and squared document lengths, the schedule simulated with each micro-batch's durations and bytes,
plus the data-parallel reduction and the optimizer (the estimate of ``evenpipe estimate``). Tokens per second count
real tokens only; the ratios are ``balance/pad`` and ``balance/pack``. Default setups: P=4 on 4 GPUs
(``1,4,1``) and 32 GPUs (``1,4,8``), 1F1B, distributed optimizer. This measures nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from evenpipe.cost import ParallelConfig, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.errors import ConfigError
from evenpipe.plan.lengths import read_lengths, shipped_lengths, shipped_lengths_path
from evenpipe.plan.microbatch import Policy
from evenpipe.plan.varlen_predict import predict_throughput


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


def parse_setup(text: str) -> tuple[int, int, int]:
    """``TP,PP,DP`` -> three positive integers (ConfigError, one line, else)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--setup {text!r}: expected TP,PP,DP, three positive integers (e.g. 1,4,8)")
    tp, pp, dp = (int(p) for p in parts)
    return tp, pp, dp


def run_setup(lengths: list[int], setup: tuple[int, int, int], args: argparse.Namespace) -> dict:
    tp, pp, dp = setup
    model = dataclasses.replace(model_preset(args.model), seq_len=args.row_len)
    source = AnalyticSource(model, hardware_preset(args.gpu))
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, microbatch_size=args.rows, global_batch=args.rows * dp,
                         schedule=ScheduleFamily.parse(args.schedule), distributed_optimizer=True)
    batches = global_batches([min(n, args.row_len) for n in lengths], args.replica_tokens * dp)
    result = predict_throughput(batches, source=source, cfg=cfg)
    rows = {p.value: {"tokens_per_s": t.tokens_per_s, "mean_step_s": t.step_s / len(t.batches),
                      "mean_imbalance": t.mean("imbalance"),
                      "padding": 1.0 - sum(b.real_tokens for b in t.batches) / sum(b.computed_tokens
                                                                                 for b in t.batches),
                      "microbatches_per_replica": t.mean("num_microbatches"),
                      "peak_memory_gib": max(b.peak_memory_gib for b in t.batches), "fits": t.fits}
            for p, t in result.items()}
    tps = {p.value: t.tokens_per_s for p, t in result.items()}
    return {"setup": {"tp": tp, "pp": pp, "dp": dp, "gpus": tp * pp * dp}, "batches": len(batches),
            "policies": rows, "balance/pad": tps[Policy.BALANCE.value] / tps[Policy.PAD.value],
            "balance/pack": tps[Policy.BALANCE.value] / tps[Policy.PACK.value]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=None, metavar="FILE", help="one document length per line (default: shipped)")
    ap.add_argument("--model", default="llama2-7b", help="model preset (default llama2-7b)")
    ap.add_argument("--gpu", default="h100-80gb", help="GPU preset (default h100-80gb)")
    ap.add_argument("--setup", action="append", default=None, metavar="TP,PP,DP",
                    help="parallelism, repeatable (default: 1,4,1 and 1,4,8)")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule (default 1f1b)")
    ap.add_argument("--row-len", type=int, default=2048, help="tokens per row (default 2048; longer are clipped)")
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch (default 4)")
    ap.add_argument("--replica-tokens", type=int, default=65536,
                    help="real tokens per global batch per data-parallel replica (default 65536)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    try:
        lengths = read_lengths(args.lengths) if args.lengths else shipped_lengths()
        setups = [parse_setup(s) for s in (args.setup or ["1,4,1", "1,4,8"])]
        results = [run_setup(lengths, s, args) for s in setups]
    except ConfigError as exc:
        sys.exit(f"bench_microbatching: {exc}")
    head = {"lengths": args.lengths or str(shipped_lengths_path().name), "documents": len(lengths),
            "model": args.model, "gpu": args.gpu, "rows": args.rows, "row_len": args.row_len}
    if args.json:
        print(json.dumps({**head, "setups": results}, indent=2))
        return
    print(f"{head['documents']} documents from {head['lengths']}, {args.model} on {args.gpu}, {args.schedule}, "
          f"micro-batches of {args.rows} x {args.row_len} tokens (predicted by the simulator)")
    for res in results:
        s = res["setup"]
        print(f"\ntp={s['tp']} pp={s['pp']} dp={s['dp']} ({s['gpus']} GPUs), {res['batches']} global batches")
        print(f"{'policy':8s} {'tokens/s':>10s} {'step s':>8s} {'max/mean':>9s} {'padding':>8s} {'mbs/rep':>8s} "
              f"{'peak GiB':>9s}")
        for name, row in res["policies"].items():
            print(f"{name:8s} {row['tokens_per_s']:10.0f} {row['mean_step_s']:8.3f} {row['mean_imbalance']:9.3f} "
                  f"{row['padding']:8.1%} {row['microbatches_per_replica']:8.1f} {row['peak_memory_gib']:9.1f}"
                  f"{'' if row['fits'] else '  (does not fit)'}")
        print(f"balance/pad {res['balance/pad']:.2f}x   balance/pack {res['balance/pack']:.3f}x (predicted)")


if __name__ == "__main__":
    main()
