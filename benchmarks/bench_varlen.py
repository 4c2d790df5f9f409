"""Micro-batching policies trained side by side on documents of varying length, measured (issue 34 points 4 and 6).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_varlen.py [--lengths FILE] [--repeats 5] [--json]

One gloo world of ``--stages`` processes (P=4) builds one pipeline per policy, each with its own copy of the same
model and its own documents stream (``evenpipe.runtime.document_batches.DocumentBatches``, exactly what
``train --documents --microbatching POLICY`` reads): documents of the shipped ShareGPT-shaped lengths
(``evenpipe/data/sharegpt_lengths.txt``; ``--lengths FILE`` replaces it, one length per line) with random tokens,
longer ones than a row split. Every micro-batch is as long as its longest row (rounded up to 8), so ``pad``
computes each document's length class, not the whole row, and attention runs once per document (a packed row
costs its documents' squared lengths, not the row's). Policies:

- ``pad``, ``pack``, ``balance``: as in ``train`` (``--microbatching``);
- ``balance+simulated``: ``balance``'s micro-batches (the same documents, the same grouping), each step's order
  chosen by simulating candidates (``train --microbatch-order simulated``,
  :class:`evenpipe.plan.order_choice.MicrobatchOrderer`): the ratio ``balance+simulated/balance`` is the chosen
  order's measured step against the planner's fixed order (issue 34, per-batch schedule choice); the JSON's
  ``order_choice`` says how many orders changed, the predicted gain and the choosing time;
- ``pad-fixed``: ``pad`` with every micro-batch a whole row (the runtime before micro-batches of their own length).

The policies run in turn, ``--steps`` optimizer steps each, the order rotated every round, for ``--repeats``
rounds, after one unmeasured step each. A step is timed from a barrier to the end of the optimizer step on every
rank, the slowest rank's time kept. A policy's figure in a round is its real tokens (padding not counted) over its
steps' time; the ratios balance/pad, balance/pack, balance+simulated/balance, pad/pad-fixed and balance/pad-fixed
are taken round by round, and their median, min and max over rounds reported. Wall-clock figures mean something
only on an otherwise idle host: the output carries the host's load average (1 minute) before and after.

Predicted tokens/s beside the measured (``--profile FILE``, an ``evenpipe profile`` of the same model at
``--seq-len`` on this host): each measured step's micro-batches as the runtime ran them (their computed tokens and
squared lengths, padding runs included, in running order: ``DocumentBatches.step_shapes``), simulated by
:func:`evenpipe.cost.estimate.estimate_with` on the stages the pipelines built (:func:`runtime_layout`), real
tokens over the predicted seconds. Without a profile the JSON's
``predicted_tokens_per_s`` is null. With a profile, ``--traced-steps`` more steps per policy run traced after the
rounds (not timed) and ``prediction_parts`` splits the prediction's error (:func:`decompose`): the measured
pipeline against its replay with the measured computes (what the message model misses) and the computes' predicted
over measured seconds (what the profile's fits miss).

    .venv/bin/python -m evenpipe profile --model gpt-tiny --seq-len 256,1024 --microbatch-sizes 1,2 --processes 4 \
        --out varlen_profile.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_varlen.py --profile varlen_profile.json

(Two or more sequence lengths: a profile of one length fits no squared-length term, so it cannot tell a packed row's
attention from a whole row's.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipe_probe import answers_or_exit  # noqa: E402

POLICIES = ("pad", "pack", "balance", "balance+simulated", "pad-fixed")
RATIOS = (("balance", "pad"), ("balance", "pack"), ("balance+simulated", "balance"), ("pad", "pad-fixed"),
          ("balance", "pad-fixed"))
LENGTH_MULTIPLE = 8


def write_documents(lengths: list[int], directory: pathlib.Path, *, vocab: int, seed: int) -> pathlib.Path:
    """``docs.bin`` (uint16 random tokens) and ``docs.idx`` (offsets) of documents of ``lengths``."""
    import numpy as np

    from evenpipe.dataset.documents import write_offsets
    rng = np.random.default_rng(seed)
    path = directory / "docs.bin"
    rng.integers(0, vocab, sum(lengths), dtype=np.uint16).tofile(path)
    write_offsets(directory / "docs.idx", np.concatenate([[0], np.cumsum(lengths)]))
    return path


def predicted_tokens_per_s(steps: list[dict[str, Any]], opts: dict[str, Any]) -> float | None:
    """The simulator's real tokens/s for ``steps`` (each measured step's real tokens and its micro-batches' shapes
    as the runtime ran them, in running order) on the profile's source; None without a profile."""
    if opts["profile"] is None:
        return None
    import dataclasses

    from evenpipe.cost import ParallelConfig, ScheduleFamily
    from evenpipe.cost.estimate import estimate_with
    from evenpipe.cost.profile import load_profile
    from evenpipe.cost.profile_fit import ProfileModel
    from evenpipe.cost.profiled_source import ProfiledSource
    source = ProfiledSource(ProfileModel(load_profile(opts["profile"], model=opts["model"])))
    b, m = opts["microbatch_size"], opts["microbatches"]
    cfg = ParallelConfig(pp=opts["stages"], chunks=opts["chunks"] or 1, microbatch_size=b, global_batch=b * m,
                         schedule=ScheduleFamily.parse(opts["schedule"]), layout=runtime_layout(opts))
    seconds = sum(estimate_with(source, dataclasses.replace(cfg, microbatch_shapes=tuple(s["shapes"]))).step_time_s
                  for s in steps)
    return sum(s["real"] for s in steps) / seconds


def runtime_layout(opts: dict[str, Any]) -> tuple[int, ...]:
    """Blocks per stage as the benchmark's pipelines build them (the runtime's default split, balanced by
    parameters: gpt-tiny at 1024 positions puts 1 and 3 blocks on two stages, its position table outweighing a
    block), so that the prediction prices the stages that ran."""
    from evenpipe.models import model_config
    from evenpipe.runtime.stages import stage_block_counts
    from evenpipe.schedule import build_schedule
    schedule = build_schedule(opts["schedule"], num_ranks=opts["stages"], num_microbatches=opts["microbatches"],
                              num_chunks=opts["chunks"])
    return stage_block_counts(model_config(opts["model"], seq_len=opts["seq_len"]), schedule.num_stages, None)


def decompose(traced: list[dict[str, Any]], opts: dict[str, Any]) -> dict[str, float] | None:
    """Where the prediction misses, from traced steps (each: its shapes and every rank's records): per step the
    measured pipeline (first action to last, optimizer excluded), its replay (the schedule simulated with every
    compute taking its measured time and the profile's links, :func:`evenpipe.sim.replay.replay`) and the
    prediction (the profile's computes and links); and the computes summed over ranks, predicted and measured.
    ``replay/measured`` is what the message model misses, ``compute predicted/measured`` what the compute fits do;
    means over the traced steps. ``measured_concurrency`` (:func:`concurrency`) beside the profile's processes:
    on a CPU host of fewer cores than ranks the profile times every compute with all its processes computing at
    once, so computes that overlap fewer others run faster than profiled. None without a profile or traced
    steps."""
    if opts["profile"] is None or not traced:
        return None
    from evenpipe.cost.profile import load_profile
    from evenpipe.cost.profile_fit import ProfileModel
    from evenpipe.runtime.trace import measured_trace
    from evenpipe.schedule import build_schedule
    from evenpipe.sim.dispatch import simulate
    from evenpipe.sim.replay import replay
    model = ProfileModel(load_profile(opts["profile"], model=opts["model"]))
    schedule = build_schedule(opts["schedule"], num_ranks=opts["stages"], num_microbatches=opts["microbatches"],
                              num_chunks=opts["chunks"])

    def computes(trace: Any) -> float:
        return sum(r.end - r.start for acts in trace.actions for r in acts if not r.action.kind.is_transfer)

    def by_rank_kind(trace: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in trace.compute_records():
            key = f"rank{r.rank} {r.action.kind.name}"
            out[key] = out.get(key, 0.0) + (r.end - r.start) / len(traced)
        return out
    split: dict[str, list[float]] = {}
    layout = runtime_layout(opts)
    parts = {"measured_pipeline_s": 0.0, "replay_pipeline_s": 0.0, "predicted_pipeline_s": 0.0,
             "measured_compute_s": 0.0, "predicted_compute_s": 0.0, "measured_concurrency": 0.0,
             "predicted_concurrency": 0.0}
    for step in traced:
        costs = model.sim_costs(schedule, microbatch_size=opts["microbatch_size"], shapes=step["shapes"],
                                layout=layout)
        measured = measured_trace(schedule, step["records"])
        predicted = simulate(schedule, costs)
        for key, value in (("measured_pipeline_s", measured.step_time),
                           ("replay_pipeline_s", replay(measured, costs).step_time),
                           ("predicted_pipeline_s", predicted.step_time),
                           ("measured_compute_s", computes(measured)), ("predicted_compute_s", computes(predicted)),
                           ("measured_concurrency", concurrency(measured)),
                           ("predicted_concurrency", concurrency(predicted))):
            parts[key] += value / len(traced)
        for which, trace in ((0, measured), (1, predicted)):
            for key, value in by_rank_kind(trace).items():
                split.setdefault(key, [0.0, 0.0])[which] += value
    return {**parts, "compute_s_by_rank_and_kind (measured, predicted)": split,
            "replay/measured": parts["replay_pipeline_s"] / parts["measured_pipeline_s"],
            "compute predicted/measured": parts["predicted_compute_s"] / parts["measured_compute_s"],
            "profile_processes": model.profile.machine.num_processes}


def concurrency(trace: Any) -> float:
    """How many ranks compute at once, as a compute sees it: over every compute of ``trace``, the time-weighted
    number of computes running during it (itself included); 1.0 when computes never overlap."""
    spans = [(r.start, r.end) for acts in trace.actions for r in acts
             if not r.action.kind.is_transfer and r.end > r.start]
    busy = sum(e - s for s, e in spans)
    shared = sum(max(0.0, min(e, e2) - max(s, s2)) for s, e in spans for s2, e2 in spans)
    return shared / busy if busy > 0 else 1.0


def _pipeline(policy: str, rank: int, world: int, groups: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """One policy's executor, optimizer and documents (each policy its own copy of the same model)."""
    import torch

    from evenpipe.models import model_config
    from evenpipe.models.adapter import reference_model
    from evenpipe.plan.order_choice import MicrobatchOrderer
    from evenpipe.runtime.document_batches import DocumentBatches
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.schedule import build_schedule

    cfg = model_config(opts["model"], seq_len=opts["seq_len"])
    built = reference_model(cfg, seed=0)
    schedule = build_schedule(opts["schedule"], num_ranks=world, num_microbatches=opts["microbatches"],
                              num_chunks=opts["chunks"])
    stages = build_stage_modules(built.parts, num_stages=schedule.num_stages, stages=schedule.stages_of(rank))
    for s in stages.values():
        s.packed = True
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=built.loss,
                          stash=ActivationStash())
    params = list({id(p): p for s in stages.values() for p in s.parameters()}.values())
    base = policy.removesuffix("-fixed").removesuffix("+simulated")
    orderer = MicrobatchOrderer(schedule) if policy.endswith("+simulated") else None
    data = DocumentBatches(path=opts["path"], seq_len=opts["seq_len"], vocab=cfg.vocab, seed=1, policy=base,
                           num_replicas=1, num_microbatches=opts["microbatches"],
                           rows_per_microbatch=opts["microbatch_size"], split_long=True, orderer=orderer,
                           length_multiple=opts["seq_len"] if policy.endswith("-fixed") else LENGTH_MULTIPLE)
    return {"ex": ex, "opt": torch.optim.AdamW(params, lr=1e-4), "data": data, "step": 0}


def _timed_step(p: dict[str, Any], opts: dict[str, Any]) -> tuple[float, int, int]:
    """One optimizer step: (slowest rank's seconds, real tokens, computed positions); its micro-batches' shapes
    as run (one replica, running order) are kept in ``p["shapes"]``."""
    import torch
    import torch.distributed as dist
    data = p["data"]
    batch = data.batch(p["step"], opts["microbatches"] * opts["microbatch_size"])
    p["shapes"] = data.step_shapes(p["step"])[0]
    p["step"] += 1
    dist.barrier()
    t0 = time.perf_counter()
    p["records"] = p["ex"].step(batch.tokens, batch.targets).records
    p["opt"].step()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), batch.real_tokens(), batch.computed_tokens


def _worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.document_batches import order_report
    torch.set_num_threads(1)
    groups = build_groups(world, 1)
    assert groups is not None
    pipes = {name: _pipeline(name, rank, world, groups, opts) for name in opts["policies"]}
    for p in pipes.values():  # warm-up: shape handshakes, allocator
        _timed_step(p, opts)
    rounds: list[dict[str, dict[str, Any]]] = []
    names = list(opts["policies"])
    for r in range(opts["repeats"]):
        order = names[r % len(names):] + names[:r % len(names)]
        row: dict[str, dict[str, Any]] = {}
        for name in order:
            steps, shapes = [], []
            for _ in range(opts["steps"]):
                steps.append(_timed_step(pipes[name], opts))
                shapes.append({"real": steps[-1][1], "shapes": pipes[name]["shapes"]})
            seconds, real, computed = (sum(x[i] for x in steps) for i in range(3))
            row[name] = {"seconds": seconds, "real_tokens": real, "computed_tokens": computed, "steps": shapes}
        rounds.append(row)
    orders = {name: order_report([c for step in sorted(p["data"].choices) for c in p["data"].choices[step]])
              for name, p in pipes.items() if p["data"].choices}
    traced: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for name in names if opts["profile"] is not None else ():
        pipes[name]["ex"].trace = True
        for _ in range(opts["traced_steps"]):
            _timed_step(pipes[name], opts)
            records: list[Any] = [None] * world
            dist.all_gather_object(records, pipes[name]["records"])
            traced[name].append({"shapes": pipes[name]["shapes"], "records": records})
    return {"rounds": rounds, "orders": orders, "traced": traced}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, dict[str, Any]]], opts: dict[str, Any],
              traced: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Per policy its measured real tokens/s (median over rounds, with min and max) and padding share; the ratios
    round by round."""
    policies = {}
    for name in opts["policies"]:
        tps = [r[name]["real_tokens"] / r[name]["seconds"] for r in rounds]
        real = sum(r[name]["real_tokens"] for r in rounds)
        computed = sum(r[name]["computed_tokens"] for r in rounds)
        steps = [step for r in rounds for step in r[name]["steps"]]
        policies[name] = {"real_tokens_per_s": _spread(tps), "padding": 1 - real / computed,
                          "predicted_tokens_per_s": predicted_tokens_per_s(steps, opts),
                          "prediction_parts": decompose((traced or {}).get(name, []), opts)}
    ratios = {}
    for a, b in RATIOS:
        if a in opts["policies"] and b in opts["policies"]:
            ratios[f"{a}/{b}"] = _spread([(r[a]["real_tokens"] / r[a]["seconds"]) / (r[b]["real_tokens"] /
                                                                                        r[b]["seconds"])
                                          for r in rounds])
    return {"policies": policies, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lengths", default=None, metavar="FILE", help="one document length per line (default: shipped)")
    ap.add_argument("--stages", type=int, default=4, help="pipeline ranks P (default 4)")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--model", default="gpt-tiny", help="a reference model preset (default gpt-tiny)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="evenpipe profile of the model at --seq-len on this host: predicted tokens/s beside")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per row (longer documents are split)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per policy per round (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--traced-steps", type=int, default=2,
                    help="with --profile: steps per policy traced after the rounds, not timed, to split the "
                         "prediction's error into computes and messages (default 2)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    policies = args.policies.split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad or args.repeats < 1 or args.steps < 1 or args.traced_steps < 0:
        print(f"bench_varlen: policies must be among {', '.join(POLICIES)} (got {args.policies!r}); "
              "--repeats and --steps >= 1, --traced-steps >= 0", file=sys.stderr)
        sys.exit(2)
    from evenpipe.errors import ConfigError
    from evenpipe.plan.lengths import read_lengths, shipped_lengths, shipped_lengths_path
    try:
        lengths = read_lengths(args.lengths) if args.lengths else shipped_lengths()
    except ConfigError as exc:
        print(f"bench_varlen: {exc}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="evenpipe-varlen-") as tmp:
        path = write_documents(lengths, pathlib.Path(tmp), vocab=256, seed=0)
        opts = {"path": str(path), "policies": policies, "model": args.model, "profile": args.profile,
                "stages": args.stages, "seq_len": args.seq_len, "schedule": args.schedule,
                "chunks": args.chunks, "microbatches": args.microbatches, "microbatch_size": args.microbatch_size,
                "steps": args.steps, "repeats": args.repeats, "traced_steps": args.traced_steps}
        load_before = os.getloadavg()[0]
        ranks = answers_or_exit(args.stages, _worker, opts)
        load_after = os.getloadavg()[0]
    result = {"lengths": args.lengths or shipped_lengths_path().name, "documents": len(lengths),
              **{k: v for k, v in opts.items() if k != "path"},
              "load_average_1min": [load_before, load_after], **summarize(ranks[0]["rounds"], opts, ranks[0]["traced"]),
              "order_choice": ranks[0]["orders"]}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['documents']} documents from {result['lengths']}; {args.model}, {args.schedule} P={args.stages} M={args.microbatches} b={args.microbatch_size}, rows of "
          f"{args.seq_len}; {args.repeats} rounds of {args.steps} steps a policy; load {load_before:.1f} -> "
          f"{load_after:.1f}")
    print(f"{'policy':18s} {'real tokens/s (median, min-max)':>32s} {'padding':>8s} {'predicted':>10s}")
    for name, row in result["policies"].items():
        t = row["real_tokens_per_s"]
        pred = row["predicted_tokens_per_s"]
        print(f"{name:18s} {t['median']:14.0f} ({t['min']:.0f}-{t['max']:.0f}) {row['padding']:8.1%} "
              f"{'-' if pred is None else f'{pred:.0f}':>10s}")
    for name, r in result["ratios"].items():
        print(f"{name:26s} {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f})")
    for name, row in result["policies"].items():
        if (d := row["prediction_parts"]) is not None:
            print(f"{name}: pipeline measured {1e3 * d['measured_pipeline_s']:.0f} ms, replayed with its measured "
                  f"computes {1e3 * d['replay_pipeline_s']:.0f}, predicted {1e3 * d['predicted_pipeline_s']:.0f}; "
                  f"computes predicted/measured {d['compute predicted/measured']:.3f}, ranks computing at once "
                  f"{d['measured_concurrency']:.2f} measured, {d['predicted_concurrency']:.2f} predicted (profiled "
                  f"with {d['profile_processes']})")
    for name, o in result["order_choice"].items():
        print(f"{name}: {o['changed']} of {o['choices']} orders changed, predicted gain {o['predicted_gain_mean']:.1%} "
              f"mean ({o['predicted_gain_max']:.1%} max), choosing {o['choice_ms_median']:.1f} ms median "
              f"({o['choice_ms_max']:.1f} max)")


if __name__ == "__main__":
    main()
