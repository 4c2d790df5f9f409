"""Receives posted one transfer run early against receives posted in place, alternating steps in one world.

Over gloo, a send whose matching receive is not posted yet waits for the receiver to post it; the sender's
communication thread then writes the message while the sender's core is busy with its next compute, and a
receiver that posted the receive just before the compute that needs it waits for that thread to be scheduled
(two bare processes: 2-4 ms for 256 KiB, against 0.01 ms when the receive was posted early). Posted early
(``PipelineExecutor(early_receives=True)``), the receiver's own thread reads the message during the receiver's
compute instead. This benchmark runs the same executor both ways, step by step in turn, traces every step and
prints, per mode, the median step, the waits the receivers saw, and the delivery time of each message a receiver
waited for (its arrival after both ends had posted it), with the late/early ratio of the step side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_early_receives.py --steps 30
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_early_receives.py --model gpt-mini --schedule gpipe
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compute_in_step import _build  # noqa: E402
from pipe_probe import answers_or_exit  # noqa: E402

MODES = ("early", "late")


def _worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.runtime.trace import measured_trace
    from evenpipe.schedule import build_schedule

    torch.set_num_threads(1)
    built = _build(opts)
    m, b = opts["microbatches"], opts["microbatch_size"]
    schedule = build_schedule(opts["schedule"], num_ranks=world, num_microbatches=m, num_chunks=opts["chunks"])
    stages = build_stage_modules(built.parts, num_stages=schedule.num_stages, stages=schedule.stages_of(rank))
    groups = build_groups(world, 1)
    assert groups is not None
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=built.loss,
                          stash=ActivationStash(list(stages.values())), trace=True)
    cfg = built.spec
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (m * b, cfg.seq_len + 1), generator=gen)
    out: dict[str, dict[str, list[float]]] = {mode: {"step": [], "waits": [], "delivery": []} for mode in MODES}
    for i in range(2 * (opts["steps"] + 1)):
        mode = MODES[i % 2]
        ex.early_receives = mode == "early"
        dist.barrier()
        res = ex.step(tokens[:, :-1], tokens[:, 1:])
        recs: list[Any] = [None] * world
        dist.all_gather_object(recs, res.records, group=groups.pp_group)
        if i < 2:  # the first step of each mode learns shapes
            continue
        trace = measured_trace(schedule, recs)
        waited = [t for t in trace.transfers if t.exposed_s > 0 and t.dst == rank]
        out[mode]["step"].append(res.step_time_s)
        out[mode]["waits"].append(sum(t.exposed_s for t in waited))
        out[mode]["delivery"].extend(t.end - t.start for t in waited)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama (benchmarks/data) or a reference preset")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="traced steps per mode, alternating")
    args = ap.parse_args()
    opts = {"model": args.model, "schedule": args.schedule, "chunks": args.chunks, "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size, "steps": args.steps}
    ranks = answers_or_exit(args.stages, _worker, opts)
    print(f"{args.model}, {args.schedule} P={args.stages} M={args.microbatches} b={args.microbatch_size}, "
          f"{args.steps} steps per mode, alternating (medians; delivery: per waited-for message)")
    print(f"{'rank':>4s} {'mode':>5s} {'step ms':>8s} {'waits ms/step':>13s} {'waited msgs':>11s} "
          f"{'delivery median ms':>18s} {'mean ms':>8s} {'p90 ms':>7s}")
    for r, res in enumerate(ranks):
        for mode in MODES:
            d = sorted(res[mode]["delivery"])
            p90 = d[int(0.9 * (len(d) - 1))] if d else 0.0
            print(f"{r:4d} {mode:>5s} {statistics.median(res[mode]['step']) * 1e3:8.1f} "
                  f"{statistics.median(res[mode]['waits']) * 1e3:13.1f} {len(d) / args.steps:11.1f} "
                  f"{(statistics.median(d) if d else 0.0) * 1e3:18.2f} {(statistics.mean(d) if d else 0.0) * 1e3:8.2f} "
                  f"{p90 * 1e3:7.2f}")
    pairs = [max(r["late"]["step"][i] for r in ranks) / max(r["early"]["step"][i] for r in ranks)
             for i in range(args.steps)]
    low, mid, high = statistics.quantiles(pairs, n=4)
    print(f"step late / early, paired by iteration: median {mid:.3f} [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
