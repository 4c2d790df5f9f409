"""How fast a pipeline rank computes while k of N processes compute at once on this host (P > cores).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_core_sharing.py [--processes 4] [--model gpt-tiny]

``evenpipe profile --processes N`` times every layer with all N processes computing in step, which on a host of
fewer cores than ranks is the slowest case; a pipeline's ranks compute fewer at once most of a step (bench_varlen
reports 2.4-2.9 of 4 on this repo's 2-core host), so its computes run faster than profiled. This probe measures
the curve between: N gloo processes; for k = 1 .. N, ranks below k run two blocks' forward and backward (the
model's blocks, at ``--seq-len``) while the others wait in a receive, as a pipeline rank waits for its input;
``--repeats`` rounds. It prints each k's mean seconds, its ratio to k = 1 and the ratio processor sharing
predicts, ``max(1, k / cores)``: where they agree, the cores are shared evenly and the waiting ranks take none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipe_probe import answers_or_exit  # noqa: E402


def _worker(rank: int, world: int, opts: dict[str, Any]) -> dict[int, list[float]]:
    import torch
    import torch.distributed as dist

    from evenpipe.models import model_config
    from evenpipe.models.adapter import reference_model
    torch.set_num_threads(1)
    cfg = model_config(opts["model"], seq_len=opts["seq_len"])
    blocks = list(reference_model(cfg, seed=0).parts.blocks)[:2]
    x = torch.randn(1, opts["seq_len"], cfg.hidden, requires_grad=True)

    def compute() -> float:
        t0 = time.perf_counter()
        h = x
        for block in blocks:
            h = block(h)
        h.sum().backward()
        return time.perf_counter() - t0

    for _ in range(3):
        compute()
    times: dict[int, list[float]] = {k: [] for k in range(1, world + 1)}
    for _ in range(opts["repeats"]):
        for k in range(1, world + 1):
            dist.barrier()
            if rank < k:
                times[k].append(compute())
            if rank == 0:  # the waiting ranks' input arrives once the computing ones are done
                for dst in range(k, world):
                    dist.send(torch.zeros(16), dst)
            elif rank >= k:
                dist.recv(torch.zeros(16), 0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--processes", type=int, default=4, help="N, the pipeline ranks sharing the host (default 4)")
    ap.add_argument("--model", default="gpt-tiny", help="a reference model preset (default gpt-tiny)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default 1024)")
    ap.add_argument("--repeats", type=int, default=8, help="rounds over k = 1 .. N (default 8)")
    args = ap.parse_args()
    if args.processes < 1 or args.repeats < 1 or args.seq_len < 1:
        print(f"probe_core_sharing: --processes, --repeats and --seq-len must be >= 1 (got {args.processes}, "
              f"{args.repeats}, {args.seq_len})", file=sys.stderr)
        sys.exit(2)
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    opts = {"model": args.model, "seq_len": args.seq_len, "repeats": args.repeats}
    ranks = answers_or_exit(args.processes, _worker, opts)
    mean = {k: statistics.fmean(t for r in ranks for t in r[k]) for k in range(1, args.processes + 1)}
    print(f"{args.processes} processes on {cores} cores, {args.model} two blocks at {args.seq_len} tokens, "
          f"{args.repeats} rounds; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'k computing':>12s} {'mean':>9s} {'vs k=1':>7s} {'sharing':>8s}")
    for k, seconds in mean.items():
        print(f"{k:12d} {1e3 * seconds:7.1f} ms {seconds / mean[1]:6.2f}x {max(1.0, k / cores):7.2f}x")


if __name__ == "__main__":
    main()
