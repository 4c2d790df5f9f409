"""``evenpipe plan``: search parallel configurations and schedules; ``--explain bpipe`` says whether BPipe pays."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import time
from typing import TYPE_CHECKING, TypeVar

from evenpipe.commands.model_args import (add_gpus_per_node_argument, add_model_arguments, add_profile_arguments,
                                         add_runtime_arguments, conventions_from_args, parse_layout,
                                         source_from_args)
from evenpipe.cost import Attention, Hardware, ModelSpec, Recompute
from evenpipe.cost.source import CostSource
from evenpipe.cost.parallel import describe_layout, join_bpipe, split_bpipe
from evenpipe.errors import ConfigError, choice_error
from evenpipe.plan.launch import LaunchCommand, launch_command
from evenpipe.plan.search import PLANNED_BPIPE_SCHEDULES, PLANNED_SCHEDULES, Candidate, PlanResult, Searcher, SearchSpace
from evenpipe.schedule import ScheduleFamily
from evenpipe.sim.kernel import gc_paused

if TYPE_CHECKING:  # --explain only: imported where it is asked for (a plain plan needs neither)
    from evenpipe.plan.explain import BPipeExplanation
    from evenpipe.plan.levers import MemoryAnswer

__all__ = ["add_arguments", "run"]

_EXPLAIN_TOPICS = ("bpipe", "memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--gpu", metavar="PRESET", help="GPU preset, e.g. a100-80gb, h100-80gb")
    parser.add_argument("--gpus", type=int, metavar="N", help="total number of GPUs (required without --cluster)")
    parser.add_argument("--cluster", metavar="FILE", help="cluster description (docs/cluster.md): plan for its "
                        "devices and links, heterogeneity-aware, beside the best plan that treats them alike")
    parser.add_argument("--what-if", action="append", metavar="CHANGE", help="what a change costs the best plan and "
                        "the best response, e.g. 'rank 5 x1.5' (5 computes 1.5x slower) or 'link 3-4 +5ms' "
                        "(repeatable; on --cluster, or on --gpus devices of --gpu)")
    add_gpus_per_node_argument(parser)
    parser.add_argument("--global-batch", type=int, required=True, metavar="B", help="sequences per step")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="configurations to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--explain", metavar="TOPIC", help="explain a choice; 'bpipe': does BPipe pay here? 'memory': which memory lever "
                        "(BPipe, host offload, recomputation, V schedules) pays?")
    parser.add_argument("--attention", default=Attention.FLASH.value, metavar="KERNEL",
                        help="attention kernel: eager or flash (default flash)")
    parser.add_argument("--schedules", metavar="LIST", help="comma-separated schedule families to search, "
                        "FAMILY+bpipe for one with BPipe's transform (default "
                        f"{','.join([s.value for s in PLANNED_SCHEDULES] + [f'{s.value}+bpipe' for s in PLANNED_BPIPE_SCHEDULES])})")
    parser.add_argument("--recompute", metavar="LIST", help="comma-separated recomputation policies to search "
                        "(default none,selective,full)")
    parser.add_argument("--max-microbatch-size", type=int, default=16, metavar="N",
                        help="largest micro-batch size tried (default 16)")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="never use sequence parallelism")
    parser.add_argument("--layout", metavar="LIST", help="fixed layers per stage, e.g. 7,8,8,7 (default: the "
                        "planner tries the even split and the end-lighter one)")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="shard optimizer state over data parallelism (default: the planner tries both)")
    parser.add_argument("--bpipe-budget", type=int, metavar="K", help="BPipe per-rank activation budget")
    add_runtime_arguments(parser, preset_dtype="bfloat16")  # a plan for GPUs assumes bf16 training
    add_profile_arguments(parser)


_E = TypeVar("_E", bound=enum.Enum)


def _parse_enum_list(text: str | None, enum_type: type[_E], flag: str, what: str,
                     default: tuple[_E, ...]) -> tuple[_E, ...]:
    """A comma-separated list of enum values (parsed once, here at the edge); duplicates dropped."""
    if text is None:
        return default
    by_value = {str(e.value): e for e in enum_type}
    out = []
    for name in (t.strip().lower() for t in text.split(",") if t.strip()):
        if name not in by_value:
            raise choice_error(f"{what} in {flag}", name, list(by_value))
        out.append(by_value[name])
    if not out:
        raise ConfigError(f"{flag} needs at least one {what}; choose from: {', '.join(by_value)}")
    return tuple(dict.fromkeys(out))


def _replace(obj: SearchSpace, **changes: object) -> SearchSpace:
    return dataclasses.replace(obj, **changes)  # type: ignore[arg-type]


def _parse_schedules(text: str | None) -> tuple[tuple[ScheduleFamily, ...], tuple[ScheduleFamily, ...] | None]:
    """``--schedules``: the families to try plain, and those to try with BPipe's transform (``FAMILY+bpipe``;
    ``1f1b+bpipe`` is schedule ``bpipe``); ``None``: the search space's default."""
    if text is None:
        return PLANNED_SCHEDULES, None
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    suffix = "+bpipe"

    def parse(names: list[str]) -> tuple[ScheduleFamily, ...]:
        return _parse_enum_list(",".join(names), ScheduleFamily, "--schedules", "schedule", ()) if names else ()
    transformed = parse([t[:-len(suffix)] for t in tokens if t.lower().endswith(suffix)])
    plain = [t for t in tokens if not t.lower().endswith(suffix)]
    named = [(f, join_bpipe(f)) for f in transformed]  # 1f1b+bpipe is schedule bpipe
    plain += [n.value for _, n in named if n is not None]
    transformed = tuple(f for f, n in named if n is None)
    families = parse(plain)
    if not families and not transformed:
        raise ConfigError("--schedules needs at least one schedule")
    return families, transformed


def _space_from_args(args: argparse.Namespace) -> SearchSpace:
    attention = _parse_enum_list(args.attention, Attention, "--attention", "attention kernel", (Attention.FLASH,))
    if len(attention) != 1:
        raise ConfigError(f"--attention takes one kernel, got {args.attention!r}")
    schedules, bpipe_schedules = _parse_schedules(args.schedules)
    return SearchSpace(
        schedules=schedules, bpipe_schedules=bpipe_schedules,
        recomputes=_parse_enum_list(args.recompute, Recompute, "--recompute", "recompute mode",
                                    (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)),
        max_microbatch_size=args.max_microbatch_size, attention=attention[0],
        sequence_parallel=not args.no_sequence_parallel, distributed_optimizer=args.distributed_optimizer,
        bpipe_budget=args.bpipe_budget, layout=parse_layout(args.layout) if args.layout else None)


def _profile_space(args: argparse.Namespace, space: SearchSpace) -> SearchSpace:
    """A profile measures whole layers on one device, one replica, no sequence parallelism: one replica whose
    pipeline divides the GPUs, tp 1, no recomputation unless ``--recompute`` asks, no optimizer sharding unless
    ``--distributed-optimizer`` asks."""
    return _replace(space, data_parallel=False, max_tp=1, sequence_parallel=False,
                    recomputes=space.recomputes if args.recompute else (Recompute.NONE,),
                    distributed_optimizer=bool(args.distributed_optimizer))


def run(args: argparse.Namespace) -> int:
    with gc_paused():  # one short command: its searches and estimates fill caches with acyclic objects, which
        # collections would scan again and again (and once more at the end) for a few hundred cyclic objects
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.explain is not None and args.explain not in _EXPLAIN_TOPICS:
        raise choice_error("--explain topic", args.explain, _EXPLAIN_TOPICS)
    if args.cluster or args.what_if:
        from evenpipe.commands.cluster_plan import run_plan
        return run_plan(args, _space_from_args(args))
    if args.gpus is None:
        raise ConfigError("plan needs --gpus N (or --cluster FILE)")
    from evenpipe.cost.category_memory import with_conventions
    source = with_conventions(source_from_args(args, "plan"), conventions_from_args(args))
    model, hw = source.model, source.hardware
    space = _space_from_args(args)
    if hw is None:
        space = _profile_space(args, space)
        if args.explain == "memory":
            raise ConfigError("--explain memory needs --gpu: a profile measures no host link to price offload over")
        if args.explain == "bpipe" and args.memory_gib is None:
            raise ConfigError("--explain bpipe --profile needs --memory-gib (BPipe pays only by what memory buys)")
    if args.explain == "bpipe" and not any(split_bpipe(f)[1] for f in space.schedules):
        space = _replace(space, schedules=space.schedules + (ScheduleFamily.BPIPE,))
    searcher = Searcher.over(source)
    t0 = time.perf_counter()
    result = searcher.search(num_gpus=args.gpus, global_batch=args.global_batch, space=space, top_k=args.top)
    explanation: BPipeExplanation | None = None
    memory: MemoryAnswer | None = None
    if args.explain == "bpipe":
        from evenpipe.plan.explain import explain_bpipe
        explanation = explain_bpipe(searcher, num_gpus=args.gpus, global_batch=args.global_batch, space=space)
    elif args.explain == "memory":
        from evenpipe.plan.levers import explain_memory
        memory = explain_memory(searcher, num_gpus=args.gpus, global_batch=args.global_batch, space=space)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps(_json(source, args, result, explanation, elapsed, memory), indent=2))
    elif hw is None:
        print("\n".join(_measured_table(result)))
        print("\n".join(_measured_notes(result, _profiled_sizes(source))))
        if result.candidates:
            print("\n".join(_launch_lines(_launch(result.candidates[0], model, args.gpus, args))))
        if explanation is not None:
            print()
            print(explanation.text)
    else:
        print("\n".join(_table(model, hw, args, space, result, elapsed)))
        if result.candidates:
            print("\n".join(_launch_lines(_launch(result.candidates[0], model, hw.gpus_per_node, args))))
        if explanation is not None:
            print()
            from evenpipe.commands.plan_explain import explanation_lines
            print("\n".join(explanation_lines(model, hw, args, space, explanation)))
        if memory is not None:
            print()
            print(memory.text)
    return 0


def _measured_table(result: PlanResult) -> list[str]:
    """The plan from measured costs (a profile: small models, milliseconds and MiB)."""
    lines = [f"{'configuration':44s} {'step ms':>9s} {'tokens/s':>10s} {'peak MiB':>9s} {'bubble':>7s}"]
    for c in result.candidates:
        e = c.estimate
        lines.append(f"{_describe_short(c):44s} {c.step_time_s * 1e3:9.1f} {e.tokens_per_s:10,.0f} "
                     f"{c.peak_memory_gib * 1024:9.1f} {e.bubble_fraction:7.1%}")
    return lines


def _profiled_sizes(source: CostSource) -> tuple[int, ...] | None:
    """The micro-batch sizes a profile measured (None for an analytic source)."""
    from evenpipe.cost.profiled_source import ProfiledSource  # a measured source only: off an analytic plan's path
    return source.fits.profile.microbatch_sizes if isinstance(source, ProfiledSource) else None


def microbatch_fit(b: int, profiled: tuple[int, ...]) -> str:
    """``measured`` when ``b`` was profiled; ``interpolated`` between profiled sizes; else ``extrapolated``."""
    if b in profiled:
        return "measured"
    return "interpolated" if profiled and profiled[0] < b < profiled[-1] else "extrapolated"


def _measured_notes(result: PlanResult, profiled: tuple[int, ...] | None) -> list[str]:
    """One line per micro-batch size the candidates use that the profile did not measure."""
    if profiled is None:
        return []
    sizes = sorted({c.config.microbatch_size for c in result.candidates} - set(profiled))
    measured = ", ".join(map(str, profiled))
    return [f"note: b={b} was not profiled (measured: b={measured}); its layer costs are "
            f"{microbatch_fit(b, profiled)} from the profile's fit" for b in sizes]


def _describe_short(c: Candidate) -> str:
    cfg = c.config
    chunks = f" v={cfg.chunks}" if cfg.chunks > 1 else ""
    return f"{cfg.schedule_name}{chunks} pp={cfg.pp} dp={cfg.dp} b={cfg.microbatch_size} m={cfg.num_microbatches}"


# -- presentation ---------------------------------------------------------------------------------------------------
def _json(source: CostSource, args: argparse.Namespace, result: PlanResult,
          explanation: BPipeExplanation | None, elapsed: float,
          memory: MemoryAnswer | None = None) -> dict[str, object]:
    s = result.stats
    per_node = source.hardware.gpus_per_node if source.hardware is not None else args.gpus
    profiled = _profiled_sizes(source)
    out: dict[str, object] = {
        "model": source.model.name, "gpu": source.name, "gpus": args.gpus, "global_batch": args.global_batch,
        "candidates": [{**c.to_dict(), "launch": _launch(c, source.model, per_node, args).to_dict(),
                        **_fit_key(c, profiled)} for c in result.candidates],
        "search": {**s.to_dict(), "seconds": elapsed},
    }
    if profiled is not None:
        out["profiled_microbatch_sizes"] = list(profiled)
    if memory is not None:
        out["explain_memory"] = memory.to_dict()
        out["lever"] = memory.lever.value  # the answer, at the top
    if explanation is not None:
        e = explanation.to_dict()
        out["explain_bpipe"] = e
        out.update({k: e[k] for k in ("pays", "text", "without", "with_bpipe")})  # the answer, at the top
    return out


def _fit_key(c: Candidate, profiled: tuple[int, ...] | None) -> dict[str, str]:
    """``{"microbatch_costs": measured|interpolated|extrapolated}`` for a profiled plan, else nothing."""
    return {} if profiled is None else {"microbatch_costs": microbatch_fit(c.config.microbatch_size, profiled)}


def _launch(c: Candidate, model: ModelSpec, gpus_per_node: int, args: argparse.Namespace) -> LaunchCommand:
    """The command that runs candidate ``c`` (see :mod:`evenpipe.plan.launch`)."""
    profiled_config = bool(args.profile) and model.name.endswith(".json")  # a profile of a Hugging Face config
    if args.hf_config is not None or profiled_config:
        model_args: tuple[str, ...] = ("--hf-config", os.path.abspath(args.hf_config or model.name))
    else:
        model_args = ("--model", args.model or model.name)
    cmd = launch_command(c.config, model=model, model_args=model_args, gpus_per_node=gpus_per_node,
                         dtype=conventions_from_args(args).dtype.value)
    if args.model is None and args.hf_config is None and not args.profile:
        cmd = dataclasses.replace(cmd, notes=(*cmd.notes, "evenpipe train builds named presets: --arch models "
                                                           "have no train equivalent yet"))
    elif args.hf_config is not None and not _train_accepts("--hf-config"):
        cmd = dataclasses.replace(cmd, notes=(*cmd.notes, "this evenpipe train has no --hf-config yet"))
    return cmd


def _train_accepts(option: str) -> bool:
    from evenpipe.commands import train
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return option in parser._option_string_actions


def _launch_lines(cmd: LaunchCommand) -> list[str]:
    where = "on each node" if cmd.num_nodes > 1 else "on one node"
    return [f"run the best ({cmd.num_nodes} node(s) x {cmd.procs_per_node} processes, {where}):",
            f"  {cmd.text()}"] + [f"  note: {n}" for n in cmd.notes]


TABLE_LEGEND: list[str] = [
    "columns: schedule (+bpipe: with BPipe's activation eviction; bpipe = 1F1B with it); v = stages (chunks) per rank;",
    "  tp, pp, dp = tensor-, pipeline-, data-parallel sizes; mbs = sequences per micro-batch; m = micro-batches per",
    "  replica per step; recompute = none, selective (attention core) or full (whole stage); MFU = model FLOPs over",
    "  peak; peak GiB = the fullest rank; bubble = idle share of the pipeline; distopt = optimizer state sharded over",
    "  dp; layers = transformer layers per stage in pipeline order (12,14x4,12 = 12, four stages of 14, then 12);",
    "  limited by = the largest share of the slowest rank's step (compute, communication or bubble), or memory (it",
    "  does not fit, or it is compute-bound within 90% of usable memory: a larger micro-batch would not fit)",
]
"""The legend printed under the plan table (docs/commands/plan.md explains the same columns)."""


def _table(model: ModelSpec, hw: Hardware, args: argparse.Namespace, space: SearchSpace, result: PlanResult,
           elapsed: float) -> list[str]:
    head = ("#", "schedule", "v", "tp", "pp", "dp", "mbs", "m", "recompute", "step s", "MFU", "peak GiB",
            "bubble", "distopt", "layers", "limited by")
    rows = [head]
    for i, c in enumerate(result.candidates, 1):
        cfg = c.config
        rows.append((str(i), cfg.schedule_name, str(cfg.chunks), str(cfg.tp), str(cfg.pp), str(cfg.dp),
                     str(cfg.microbatch_size), str(cfg.num_microbatches), cfg.recompute.value,
                     f"{c.step_time_s:.3f}", f"{100 * c.mfu:.1f}%", f"{c.peak_memory_gib:.1f}",
                     f"{100 * c.estimate.bubble_fraction:.1f}%", "yes" if cfg.distributed_optimizer else "no",
                     describe_layout(c.estimate.layout), c.limited_by))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    s = result.stats
    lines = [f"{model.name} on {args.gpus} x {hw.name} ({hw.memory_gib:g} GiB), global batch {args.global_batch}, "
             f"seq {model.seq_len}, {space.attention.value} attention, "
             + ("sequence parallel with tp > 1" if space.sequence_parallel else "no sequence parallelism")
             + {None: ", distributed optimizer searched", True: ", distributed optimizer",
                False: ", no distributed optimizer"}[space.distributed_optimizer]]
    lines += ["  ".join(cell.rjust(w) if j not in (1, 8, 14, 15) else cell.ljust(w)
                        for j, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines += TABLE_LEGEND
    lines.append(f"searched {s.num_enumerated} configurations in {elapsed:.2f} s: {s.num_invalid} invalid, "
                 f"{s.num_over_memory} over memory, {s.num_bounded} skipped by the step-time bound, "
                 f"{s.num_dominated} dominated (lighter recomputation fits), {s.num_estimated} simulated")
    return lines
