"""``evenpipe simulate``: build a schedule, simulate one step, print a summary (or JSON) and write pictures."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from typing import TYPE_CHECKING, Any

from evenpipe.commands.model_args import (add_gpus_per_node_argument, add_model_arguments, any_model_given,
                                          hardware_from_arg, model_from_args, parse_layout, with_gpus_per_node)
from evenpipe.errors import ConfigError
from evenpipe.report.tables import exposed_table, summary_table
from evenpipe.schedule import ScheduleFamily, build_schedule
from evenpipe.schedule.build import plan_durations_for
from evenpipe.schedule.family import Ordering
from evenpipe.sim import Link, SimCosts, Trace, simulate
from evenpipe.sim.costs import StageCosts

if TYPE_CHECKING:
    from evenpipe.cost.cluster import Cluster
    from evenpipe.cost.shape import MicrobatchShape
    from evenpipe.schedule import LinkPlan

__all__ = ["add_arguments", "run", "trace_from_args", "summary_json", "UNIT_COSTS_NOTE"]

UNIT_COSTS_NOTE = ("unit costs: times in the unit of --forward-time (not seconds), sizes in the unit of "
                   "--activation-bytes (not bytes); --profile, or --model with --gpu, gives seconds and bytes")
"""The line under the tables of a schedule simulated without a profile or a model."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(f.value for f in ScheduleFamily)
    parser.add_argument("--schedule", required=True, metavar="NAME", help=f"schedule family: {names}")
    parser.add_argument("--stages", type=int, required=True, metavar="P", help="pipeline ranks P")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="micro-batches per step M")
    parser.add_argument("--chunks", type=int, default=None, metavar="V",
                        help="stages per rank for interleaved / looped-bfs (default 2); latency-aware takes 1 or 2 (a "
                        "V; default 1); the other families fix it (1, or 2 for the V-shaped zb-v, v-half, v-min, "
                        "dualpipev)")
    times = parser.add_argument_group("durations per micro-batch of one rank's layers (unit costs: any one time "
                                      "unit, seconds only if you give seconds)")
    times.add_argument("--forward-time", type=float, default=1.0, metavar="F", help="forward (default 1)")
    times.add_argument("--backward-time", type=float, default=2.0, metavar="B",
                       help="input-gradient backward (default 2)")
    times.add_argument("--weight-time", type=float, default=0.0, metavar="W",
                       help="weight-gradient backward (default 0); a full backward takes B+W")
    link = parser.add_argument_group("links and sizes (default: free links; sizes in any one unit, bytes only if "
                                     "you give bytes)")
    link.add_argument("--link-latency", type=float, default=0.0, metavar="S", help="time per message (unit of --forward-time)")
    link.add_argument("--link-bandwidth", type=float, default=math.inf, metavar="BW",
                      help="size units (of --activation-bytes) per time unit, every rank-to-rank link "
                      "(default: infinite)")
    link.add_argument("--activation-bytes", type=float, default=1.0, metavar="N",
                      help="activation bytes one micro-batch saves on one rank (default 1); BPipe moves these")
    link.add_argument("--output-bytes", type=float, default=0.0, metavar="N",
                      help="bytes of the activation / gradient message between stages (default 0)")
    link.add_argument("--checkpoint-bytes", type=float, default=None, metavar="N",
                      help="with --recompute: bytes kept per micro-batch (the stage input; default --output-bytes)")
    parser.add_argument("--bpipe", action="store_true",
                        help="apply the BPipe transform (pairs from the schedule's memory profile; --schedule bpipe is "
                        "1f1b with it)")
    parser.add_argument("--bpipe-budget", type=int, default=None, metavar="K",
                        help="BPipe: activation units of one stage a rank may hold (default: the lowest balanced "
                        "peak the pairing allows; ceil((P+1)/2) for 1F1B)")
    parser.add_argument("--recompute", action="store_true", help="recompute activations before each backward")
    parser.add_argument("--lengths", default=None, metavar="FILE",
                        help="unequal micro-batches: one line per micro-batch (M lines), its documents' lengths in "
                        "tokens separated by spaces or commas; with --model/--gpu or --profile each micro-batch is "
                        "priced at its tokens and squared lengths (documents attend to themselves), with unit "
                        "costs it takes the durations and sizes above times its tokens over the mean micro-batch's")
    parser.add_argument("--cluster", default=None, metavar="FILE",
                        help="cluster description (docs/cluster.md): each rank's device and speed scale its "
                        "computes, link classes set every rank pair's latency and bandwidth")
    parser.add_argument("--activation-cap", type=float, default=None, metavar="UNITS",
                        help="latency-aware: activation units (a rank's layers for one micro-batch) a rank may "
                        "hold (default P, 1F1B's peak); the schedule is ordered for the links' latency and "
                        "bandwidth and these durations")
    prof = parser.add_argument_group("measured costs (instead of the durations and sizes above)")
    prof.add_argument("--profile", default=None, metavar="PROFILE",
                      help="profile JSON from `evenpipe profile`: per-stage costs, link and optimizer step measured")
    prof.add_argument("--microbatch-size", type=int, default=None, metavar="B",
                      help="with --profile: sequences per micro-batch (default the smallest profiled); with "
                      "--model: default 1")
    prof.add_argument("--layout", default=None, metavar="N,N,..",
                      help="with --profile or --model: blocks per stage (default: as even as possible; with "
                      "--model one layer fewer on the end stages when the layers do not divide)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    add_model_arguments(parser)
    costed = parser.add_argument_group("costs from the model (with --model, --hf-config or --arch; replace the "
                                       "durations and sizes above)")
    costed.add_argument("--gpu", metavar="PRESET", help="GPU preset (a100-80gb, h100-80gb, ...) or FILE.json")
    add_gpus_per_node_argument(costed)
    costed.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1; divides --gpus-per-node)")
    parser.add_argument("--out", metavar="DIR", help="write timeline.png, memory.png, trace.json, schedule.txt")


def trace_from_args(args: argparse.Namespace) -> Trace:
    """Build and simulate the schedule the arguments describe (``ConfigError`` for bad values)."""
    family = ScheduleFamily.parse(args.schedule)
    chunks = family.traits.chunks.chunks(args.chunks) if args.chunks is None else args.chunks
    for name in ("forward_time", "backward_time", "weight_time", "link_latency", "activation_bytes",
                 "output_bytes", "checkpoint_bytes"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not args.link_bandwidth > 0:
        raise ConfigError(f"--link-bandwidth must be > 0 (inf for free links), got {args.link_bandwidth}")
    profiled = bool(getattr(args, "profile", None))
    cluster = _cluster(args, profiled)
    lengths = _microbatch_lengths(args)
    if lengths is not None and cluster is not None:
        raise ConfigError("--lengths does not combine with --cluster yet; allowed: --lengths with unit costs, "
                          "--model/--gpu or --profile")
    cap = getattr(args, "activation_cap", None)
    costs, plan = None, None
    if family.traits.ordering is Ordering.LATENCY_AWARE and not profiled:
        build_schedule(family, num_ranks=args.stages, num_microbatches=1, num_chunks=chunks)  # sizes checked first
        layout = family.traits.stage_to_rank(args.stages, chunks)
        costs = _costs(args, family, chunks, layout, cluster, lengths)
        plan = link_plan_for(costs, layout, cap=cap)
    elif cap is not None:
        warnings.warn(f"--activation-cap has no effect on schedule {family.value!r} (only latency-aware "
                      "takes it, and not with --profile)", stacklevel=2)
    weights = None
    if lengths is not None and (args.bpipe or family is ScheduleFamily.BPIPE) and not profiled:
        if costs is None:  # BPipe plans its evictions by each micro-batch's bytes
            costs = _costs(args, family, chunks, family.traits.stage_to_rank(args.stages, chunks), cluster, lengths)
        weights = _bpipe_weights(costs)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        sched = build_schedule(family, num_ranks=args.stages, num_microbatches=args.microbatches,
                               num_chunks=chunks, bpipe_budget=args.bpipe_budget, recompute=args.recompute,
                               plan_durations=plan_durations_for(args.forward_time, args.backward_time,
                                                                 args.weight_time), bpipe=args.bpipe,
                               link_plan=plan, bpipe_weights=weights)
    if profiled:
        return _profiled(args, sched, lengths).trace
    return simulate(sched, costs or _costs(args, family, chunks, sched.stage_to_rank, cluster, lengths))


def _bpipe_weights(costs: SimCosts) -> tuple[float, ...] | None:
    """Each micro-batch's activation bytes over the largest's (BPipe's units), None when they are alike."""
    per = costs.microbatch_stages
    if per is None:
        return None
    sizes = [sum(st.activation_bytes for st in row) for row in per]
    top = max(sizes)
    return tuple(n / top for n in sizes) if top > 0 else None


def _microbatch_lengths(args: argparse.Namespace) -> list[list[int]] | None:
    """The documents of each micro-batch from ``--lengths`` (None without it); one line per micro-batch."""
    path = getattr(args, "lengths", None)
    if not path:
        return None
    from evenpipe.plan.lengths import read_microbatch_lengths
    lengths = read_microbatch_lengths(path)
    if len(lengths) != args.microbatches:
        raise ConfigError(f"--lengths {path} holds {len(lengths)} micro-batches (lines) but --microbatches is "
                          f"{args.microbatches}; give one line per micro-batch")
    return lengths


def _shapes(lengths: list[list[int]], *, rows: int, seq_len: int, what: str) -> "tuple[MicrobatchShape, ...]":
    """Each micro-batch's shape: its documents in ``rows`` rows of ``seq_len`` tokens (ConfigError when they
    cannot fit; ``what`` names where the row length comes from)."""
    from evenpipe.cost.shape import MicrobatchShape
    for i, docs in enumerate(lengths, 1):
        if max(docs) > seq_len:
            raise ConfigError(f"--lengths line {i}: a document of {max(docs)} tokens is longer than a row of "
                              f"{seq_len} ({what}); split it")
        if sum(docs) > rows * seq_len:
            raise ConfigError(f"--lengths line {i}: {sum(docs)} tokens exceed a micro-batch of {rows} x {seq_len} "
                              f"(--microbatch-size x {what})")
    return tuple(MicrobatchShape.of_documents(docs, size=rows, seq_len=seq_len) for docs in lengths)


def _scaled_by_tokens(costs: SimCosts, lengths: list[list[int]]) -> SimCosts:
    """Unit costs per micro-batch: every duration and size times its tokens over the mean micro-batch's."""
    tokens = [sum(docs) for docs in lengths]
    mean = sum(tokens) / len(tokens)

    def scaled(st: StageCosts, f: float) -> StageCosts:
        return StageCosts(forward=st.forward * f, backward_input=st.backward_input * f,
                          backward_weight=st.backward_weight * f,
                          recompute=None if st.recompute is None else st.recompute * f,
                          activation_bytes=st.activation_bytes * f, checkpoint_bytes=st.checkpoint_bytes * f,
                          weight_grad_bytes=st.weight_grad_bytes * f, output_bytes=st.output_bytes * f)
    return SimCosts.per_microbatch([[scaled(st, n / mean) for st in costs.stages] for n in tokens],
                                   default_link=costs.default_link, links=costs.links)


def _cluster(args: argparse.Namespace, profiled: bool) -> "Cluster | None":
    """The ``--cluster`` file, checked (``None`` without one)."""
    path = getattr(args, "cluster", None)
    if not path:
        return None
    from evenpipe.cost.cluster import load_cluster  # the cost package loads only when a cluster is given
    if profiled:
        raise ConfigError("--cluster does not combine with --profile (a profile measured this machine's ranks "
                          "and link); allowed: --cluster with unit durations or --model costs")
    if args.link_latency != 0 or args.link_bandwidth != math.inf:
        warnings.warn("--link-latency and --link-bandwidth have no effect with --cluster (its link classes set "
                      "every rank pair's link)", stacklevel=3)
    return load_cluster(path)


def _costs(args: argparse.Namespace, family: ScheduleFamily, chunks: int, stage_to_rank: tuple[int, ...],
           cluster: "Cluster | None", lengths: list[list[int]] | None = None) -> SimCosts:
    """The costs the arguments give: from the model, or the durations and sizes (per micro-batch with
    ``lengths``); on the cluster, if any."""
    if any_model_given(args):
        return _model_costs(args, family, chunks, lengths)
    else:
        costs = SimCosts.uniform(
            num_stages=len(stage_to_rank), num_chunks=chunks, forward=args.forward_time,
            backward=args.backward_time, weight=args.weight_time, activation_bytes=args.activation_bytes,
            output_bytes=args.output_bytes,
            checkpoint_bytes=(args.output_bytes if args.checkpoint_bytes is None else args.checkpoint_bytes)
            if args.recompute else None,
            link=Link(latency_s=args.link_latency, bandwidth_bytes_per_s=args.link_bandwidth))
    if lengths is not None:
        return _scaled_by_tokens(costs, lengths)
    if cluster is None:
        return costs
    from evenpipe.cost.cluster import cluster_sim_costs
    return cluster_sim_costs(costs, cluster, tuple(stage_to_rank))


def link_plan_for(costs: SimCosts, stage_to_rank: tuple[int, ...], *, cap: float | None = None) -> LinkPlan:
    """What the latency-aware generator plans with under ``costs``: the fastest rank's forward, input- and
    weight-gradient times over its stages, every rank's slowdown against it, and every rank pair's time for the
    largest message."""
    from evenpipe.schedule import LinkPlan  # the latency-aware family only
    P = max(stage_to_rank) + 1
    per_rank = [[0.0, 0.0, 0.0] for _ in range(P)]
    for st, r in zip(costs.stages, stage_to_rank):
        for k, t in enumerate((st.forward, st.backward_input, st.backward_weight)):
            per_rank[r][k] += t
    size = max((st.output_bytes for st in costs.stages), default=0.0)
    message = tuple(tuple(0.0 if a == b else costs.link(a, b).transfer_time(size) for b in range(P))
                    for a in range(P))
    base = min(per_rank, key=sum)
    slowdown = tuple(sum(row) / sum(base) for row in per_rank) if sum(base) > 0 else ()
    return LinkPlan(forward=base[0], backward_input=base[1], backward_weight=base[2], message=message, cap=cap,
                    slowdown=slowdown)


def _profiled(args: argparse.Namespace, sched: Any, lengths: list[list[int]] | None = None) -> Any:
    """The :class:`~evenpipe.cost.profile_fit.StepPrediction` of ``sched`` under ``--profile`` (each
    micro-batch at its documents' tokens and squared lengths with ``lengths``)."""
    from evenpipe.cost.profile import load_profile
    from evenpipe.cost.profile_fit import ProfileModel, predict_step
    profile = load_profile(args.profile)
    b = args.microbatch_size or profile.microbatch_sizes[0]
    layout = None
    if args.layout:
        try:
            layout = [int(v) for v in args.layout.split(",")]
        except ValueError:
            raise ConfigError(f"--layout {args.layout!r} must be comma-separated block counts, e.g. 4,4") from None
    fits = ProfileModel(profile)
    shapes = None if lengths is None else _shapes(lengths, rows=b, seq_len=profile.seq_lens[-1],
                                                  what="the profile's longest sequence")
    return predict_step(fits, sched, microbatch_size=b, layout=layout, shapes=shapes)


def _model_costs(args: argparse.Namespace, family: ScheduleFamily, chunks: int,
                 lengths: list[list[int]] | None = None) -> SimCosts:
    """Stage durations and bytes of a model on a GPU from the cost model (embedding and head on their stages),
    per micro-batch with ``lengths``."""
    from evenpipe.cost import ParallelConfig, Recompute, check_config, stage_sim_costs
    if args.gpu is None:
        raise ConfigError("--model / --hf-config / --arch need --gpu (a preset such as a100-80gb, or FILE.json)")
    model, hw = model_from_args(args), with_gpus_per_node(hardware_from_arg(args.gpu), args)
    b = args.microbatch_size or 1
    cfg = ParallelConfig(tp=args.tp, pp=args.stages, chunks=chunks, microbatch_size=b,
                         global_batch=args.microbatches * b, schedule=family,
                         recompute=Recompute.FULL if args.recompute else Recompute.NONE,
                         bpipe_budget=args.bpipe_budget, layout=parse_layout(args.layout) if args.layout else None)
    check_config(model, hw, cfg)
    if lengths is None:
        return stage_sim_costs(model, hw, cfg)
    from evenpipe.cost.analytic_source import AnalyticSource
    from evenpipe.cost.microbatch_costs import microbatch_sim_costs
    shapes = _shapes(lengths, rows=b, seq_len=model.seq_len, what="the model's sequence length")
    return microbatch_sim_costs(AnalyticSource(model, hw), cfg, shapes)


def summary_json(trace: Trace) -> dict[str, Any]:
    """The ``--json`` object."""
    s = trace.schedule
    return {
        "schedule": s.name, "stages": s.num_ranks, "microbatches": s.num_microbatches, "chunks": s.num_chunks,
        "num_stages": s.num_stages, "step_time": trace.step_time, "bubble_fraction": trace.bubble_fraction,
        "repeated_bubble_fraction": trace.repeated_bubble_fraction,
        "peak_activations": list(trace.peak_activations),
        "peak_activation_bytes": list(trace.peak_activation_bytes),
        "actions": trace.num_actions, "transfers": trace.num_transfers,
        "exposed_transfer_time": trace.exposed_transfer_time,
        "exposed_transfers": [{"kind": t.kind.name, "stage": t.stage, "microbatch": t.microbatch, "src": t.src,
                               "dst": t.dst, "start": t.start, "end": t.end, "exposed_s": t.exposed_s}
                              for t in trace.exposed_transfers[:20]],
        "meta": s.meta,
    }


def _prediction_lines(pred: Any) -> str:
    times = ", ".join(f"rank {r} {t * 1e3:.1f} ms" for r, t in enumerate(pred.rank_step_times))
    opt = ", ".join(f"{t * 1e3:.1f}" for t in pred.optimizer_s)
    return (f"predicted training step: {pred.step_time * 1e3:.1f} ms (schedule {pred.trace.step_time * 1e3:.1f} ms + "
            f"optimizer per rank [{opt}] ms + {pred.overhead_s * 1e3:.2f} ms fixed)\n  per rank: {times}\n")


def run(args: argparse.Namespace) -> int:
    from evenpipe.commands.limits import check_schedule_fits
    from evenpipe.commands.output_paths import check_output_dir
    check_output_dir(args.out, "--out")
    family = ScheduleFamily.parse(args.schedule)
    if args.stages >= 1 and args.microbatches >= 1 and (args.chunks is None or args.chunks >= 1):
        check_schedule_fits(num_ranks=args.stages, num_microbatches=args.microbatches,
                            num_chunks=family.traits.chunks.chunks(args.chunks))
    pred = None
    if args.profile:
        family = ScheduleFamily.parse(args.schedule)
        chunks = family.traits.chunks.chunks(None) if args.chunks is None else args.chunks
        sched = build_schedule(family, num_ranks=args.stages, num_microbatches=args.microbatches,
                               num_chunks=chunks, bpipe_budget=args.bpipe_budget, recompute=args.recompute,
                               bpipe=args.bpipe)
        pred = _profiled(args, sched, _microbatch_lengths(args))
        trace = pred.trace
    else:
        trace = trace_from_args(args)
    unit_costs = pred is None and not any_model_given(args) and not args.cluster  # a cluster's links are in s
    files = []
    if args.out:
        from evenpipe.report.bundle import write_bundle  # imports matplotlib

        files = [str(p) for p in write_bundle(trace, args.out,
                                              time_label="time (time units)" if unit_costs else "time (s)")]
    if args.json:
        doc = dict(summary_json(trace), files=files, units="unit costs" if unit_costs else "seconds and bytes")
        if pred is not None:
            doc.update(schedule_time=trace.step_time, step_time=pred.step_time,
                       peak_activation_bytes=list(pred.peak_activation_bytes),
                       rank_step_times=list(pred.rank_step_times), optimizer_s=list(pred.optimizer_s))
        print(json.dumps(doc))
        return 0
    print(summary_table(trace, unit_costs=unit_costs))
    print()
    if pred is not None:
        print(_prediction_lines(pred))
    print(exposed_table(trace, unit_costs=unit_costs))
    if unit_costs:
        print(f"\n({UNIT_COSTS_NOTE})")
    if files:
        print("\nwrote " + ", ".join(files))
    return 0
