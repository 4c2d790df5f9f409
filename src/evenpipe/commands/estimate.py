"""``evenpipe estimate``: predict memory per pipeline rank, step time, MFU and HFU of one configuration.

A configuration that does not fit in memory is still estimated: the output says ``fits: no`` (``"fits": false``
in JSON) and the exit code is 0, unless ``--require-fit`` is given (then one line on stderr and exit 2).
Runs without torch; matplotlib is imported only for ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from evenpipe.cost import Attention, Estimate, Hardware, ParallelConfig, Recompute, ScheduleFamily
from evenpipe.cost.estimate import TimeBreakdown, estimate_with
from evenpipe.cost.categories import PEAK_BYTES_KEY
from evenpipe.cost.category_memory import peak_bytes_by_category, with_conventions
from evenpipe.cost.parallel import describe_layout
from evenpipe.cost.source import CostSource
from evenpipe.commands.model_args import (add_gpus_per_node_argument, add_model_arguments, add_profile_arguments,
                                         add_runtime_arguments, conventions_from_args, parse_layout,
                                         source_from_args)
from evenpipe.errors import ConfigError

__all__ = ["add_arguments", "run"]

_SCHEDULES = [f.value for f in ScheduleFamily]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    p = parser.add_argument_group("parallelism")
    p.add_argument("--gpu", metavar="PRESET",
                   help="GPU preset (a100-40gb, a100-80gb, h100-80gb, h200) or a profile FILE.json")
    p.add_argument("--gpus", type=int, metavar="N", help="total GPUs; must equal tp·pp·dp (dp defaults to N/(tp·pp))")
    add_gpus_per_node_argument(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1; divides --gpus-per-node)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, help="data-parallel size (default --gpus/(tp·pp), or 1)")
    p.add_argument("--chunks", type=int, default=None,
                   help="stages per pipeline rank for interleaved (default 1; 2 for the V-shaped families)")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--recompute", default="none", metavar="MODE", help="none, selective or full (default none)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    p.add_argument("--attention", default="flash", metavar="KERNEL", help="eager or flash (default flash)")
    p.add_argument("--schedule", default="1f1b", metavar="NAME", help=f"one of {', '.join(_SCHEDULES)} (default 1f1b)")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state over dp")
    add_runtime_arguments(p)
    p.add_argument("--bpipe", action="store_true", help="apply BPipe's evict/load transform to --schedule "
                   "(1f1b, interleaved, gpipe, looped-bfs, zb-h1; --schedule bpipe is 1F1B with it)")
    p.add_argument("--bpipe-budget", type=int, metavar="K", help="BPipe activation units per rank (default: the "
                   "lowest balanced peak the pairing allows, ⌈(p+1)/2⌉ for 1F1B)")
    p.add_argument("--offload", metavar="RANKS", help="host offload on these pipeline ranks, as `train --offload` "
                   "takes them: 'all' or the first k ranks, e.g. 0-1 (default none)")
    p.add_argument("--layout", metavar="LIST", help="layers per stage (per virtual chunk), e.g. 7,8,8,7 (default: "
                   "even, or one layer fewer on the end stages when the layers do not divide)")
    p.add_argument("--cluster", metavar="FILE", help="cluster description (docs/cluster.md): each rank's device, "
                   "memory and speed and the links between ranks (instead of --gpu)")
    p.add_argument("--placement", default="rank-order", metavar="ORDER",
                   help="with --cluster, which devices run each pipeline rank: rank-order (the runtime's order), "
                        "fast-first or slow-first (devices sorted by speed; default rank-order)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--out", metavar="DIR", help="write memory_per_stage.png (stacked bars per rank) into DIR")
    o.add_argument("--require-fit", action="store_true", help="exit 2 when the configuration does not fit")
    add_profile_arguments(parser)


def _config_from_args(args: argparse.Namespace, *, shards_optimizer: bool = False) -> ParallelConfig:
    tp, pp = args.tp, args.pp
    dp = args.dp
    if dp is None:
        dp = 1
        if args.gpus is not None:
            if tp < 1 or pp < 1 or args.gpus % (tp * pp):
                raise ConfigError(f"--gpus {args.gpus} is not a multiple of tp·pp = {tp}·{pp}")
            dp = args.gpus // (tp * pp)
    family = ScheduleFamily.parse(args.schedule)
    chunks = args.chunks if args.chunks is not None else (1 if family.has_chunks else family.traits.chunks.chunks(None))
    return ParallelConfig(tp=tp, pp=pp, dp=dp, chunks=chunks, microbatch_size=args.microbatch_size,
                          global_batch=args.global_batch, recompute=Recompute.parse(args.recompute),
                          sequence_parallel=args.sequence_parallel, attention=Attention.parse(args.attention),
                          schedule=family,
                          distributed_optimizer=args.distributed_optimizer or shards_optimizer, bpipe_budget=args.bpipe_budget,
                          bpipe=args.bpipe, layout=parse_layout(args.layout) if args.layout else None,
                          offload_ranks=_offload_prefix(args.offload, pp))


def _offload_prefix(text: str | None, pp: int) -> int:
    """How many first pipeline ranks ``--offload`` names (the cost model's offload lever); ConfigError for a set
    that is not the first k ranks."""
    if text is None:
        return 0
    from evenpipe.schedule.rank_set import parse_rank_set, rank_set_text
    ranks = parse_rank_set(text, option="--offload", num_ranks=pp)
    if ranks != frozenset(range(len(ranks))):
        raise ConfigError(f"--offload {text!r}: the estimate prices offload on the first k pipeline ranks; give "
                          f"'all' or 0-k (ranks {rank_set_text(ranks, pp)} are not the first {len(ranks)})")
    return len(ranks)


def run(args: argparse.Namespace) -> int:
    from evenpipe.commands.output_paths import check_output_dir
    check_output_dir(args.out, "--out")
    conventions = conventions_from_args(args)
    header = None
    source: CostSource
    if args.cluster:
        from evenpipe.commands.cluster_plan import estimate_source
        cfg, source, header = estimate_source(args, _config_from_args, conventions)
    else:
        source = with_conventions(source_from_args(args, "estimate"), conventions)
        cfg = _config_from_args(args, shards_optimizer=conventions.shards_optimizer)
    model, hw = source.model, source.hardware
    from evenpipe.commands.limits import check_schedule_fits
    check_schedule_fits(num_ranks=cfg.pp, num_chunks=cfg.chunks, num_microbatches=cfg.num_microbatches)
    source.check(cfg, num_gpus=cfg.num_gpus if args.cluster else args.gpus)
    est = estimate_with(source, cfg)
    picture = None
    if args.out:
        from evenpipe.report.memory_bars import save_memory_bars  # matplotlib only when asked

        usable = est.usable_memory_gib
        picture = save_memory_bars(est.stage_memory, pathlib.Path(args.out) / "memory_per_stage.png",
                                   capacity_gib=hw.memory_gib if hw is not None else usable,
                                   usable_gib=usable,
                                   title=f"{model.name} on {cfg.num_gpus}x {source.name}\n{cfg.describe()}")
    if args.json:
        out = est.to_dict()
        out["runtime"] = conventions.to_dict()
        out[PEAK_BYTES_KEY] = list(peak_bytes_by_category(source, cfg))
        if picture is not None:
            out["memory_picture"] = str(picture)
        print(json.dumps(out, indent=2))
    else:
        if header is not None:
            print(header)
        print(format_estimate(est) if hw is not None else format_measured(est))
        if picture is not None:
            print(f"wrote {picture}")
    if args.require_fit and not est.fits:
        raise ConfigError(f"configuration does not fit: peak {est.peak_memory_gib:.1f} GiB on rank "
                          f"{_peak_rank(est)} > usable {est.usable_memory_gib:.1f} GiB of {source.name}")
    return 0


def format_measured(est: Estimate) -> str:
    """The report of an estimate from measured costs (a profile: small models, MiB, no MFU)."""
    bd = est.breakdown
    lines = [f"{est.config.describe()}: step {est.step_time_s * 1e3:.1f} ms ({est.tokens_per_s:,.0f} tokens/s), "
             f"bubble {est.bubble_fraction:.1%}, optimizer and fixed cost {bd.optimizer * 1e3:.1f} ms",
             "  rank   state MiB   activations MiB   total MiB"]
    for r, (s, total) in enumerate(zip(est.state_bytes, est.peak_bytes)):
        lines.append(f"  {r:4d} {s / 2**20:11.2f} {(total - s) / 2**20:17.2f} {total / 2**20:11.2f}")
    if est.usable_memory_gib is not None:
        lines.append(f"  fits {est.usable_memory_gib:g} GiB per device: {'yes' if est.fits else 'NO'}")
    return "\n".join(lines)


def _peak_rank(est: Estimate) -> int:
    return max(range(len(est.memory_per_stage_gib)), key=lambda r: est.memory_per_stage_gib[r])


def _time_lines(bd: TimeBreakdown, step: float) -> list[str]:
    lines = []
    for name, value in bd.to_dict().items():
        share = 100.0 * value / step if step > 0 else 0.0
        lines.append(f"  {name:<15} {value:>10.3f} s {share:>6.1f}%")
    return lines


def _memory_lines(est: Estimate, hw: Hardware) -> list[str]:
    cols = ("weights", "grads", "optimizer", "activations", "hosted", "embedding", "head")
    head = f"  {'rank':>4} " + " ".join(f"{c:>11}" for c in cols) + f" {'total':>9}"
    lines = [head]
    stages = est.stage_memory
    shown = list(range(len(stages))) if len(stages) <= 16 else sorted(
        {0, 1, len(stages) // 2, len(stages) - 2, len(stages) - 1, _peak_rank(est)})
    prev = -1
    for r in shown:
        if r != prev + 1:
            lines.append("   ...")
        m = stages[r]
        mark = "  <- over" if m.total > hw.usable_memory_gib else ""
        lines.append(f"  {r:>4} " + " ".join(f"{getattr(m, c):>11.2f}" for c in cols) + f" {m.total:>9.2f}{mark}")
        prev = r
    return lines


def format_estimate(est: Estimate) -> str:
    """The human-readable report printed by ``evenpipe estimate``."""
    cfg, hw, model = est.config, est.hardware, est.model
    assert hw is not None, "format_measured reports estimates without a GPU preset"
    bd = est.breakdown
    lines = [
        f"{model.name} ({_count(model.num_params)} params) on {cfg.num_gpus} x {hw.name}",
        f"  {cfg.describe()}",
        f"  layers per stage: {describe_layout(est.layout)}",
        "",
        f"step time       {est.step_time_s:10.3f} s   ({est.tokens_per_s:,.0f} tokens/s)",
        f"MFU             {100 * est.mfu:10.1f} %   (model FLOPs, no recomputation)",
        f"HFU             {100 * est.hfu:10.1f} %   ({est.tflops_per_gpu:.1f} TFLOP/s per GPU executed)",
        f"bubble fraction {100 * est.bubble_fraction:10.1f} %",
        f"limited by      {est.limited_by:>10}",
        "",
        f"time of the critical pipeline rank {est.critical_rank} (sums to the step time):",
        *_time_lines(bd, est.step_time_s),
        "",
        f"peak memory per pipeline rank (GiB; {hw.name} has {hw.memory_gib:g}, usable {hw.usable_memory_gib:g}):",
        *_memory_lines(est, hw),
        "",
        (f"fits: yes (peak {est.peak_memory_gib:.2f} GiB on rank {_peak_rank(est)})" if est.fits else
         f"fits: NO (peak {est.peak_memory_gib:.2f} GiB on rank {_peak_rank(est)} > usable "
         f"{hw.usable_memory_gib:g} GiB)"),
    ]
    return "\n".join(lines)


def _count(n: int) -> str:
    """A parameter count in billions, or millions below one billion (a 14M model is not '0.0B')."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
