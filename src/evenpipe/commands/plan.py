"""``evenpipe plan``: search parallel configurations and schedules; ``--explain bpipe`` says whether BPipe pays."""

from __future__ import annotations

import argparse
import json
import time

from evenpipe.cost import (
    Arch,
    Attention,
    Hardware,
    ModelSpec,
    Recompute,
    from_hf_config,
    hardware_preset,
    model_preset,
)
from evenpipe.errors import ConfigError, choice_error
from evenpipe.plan.explain import BPipeExplanation, Verdict, explain_bpipe
from evenpipe.plan.search import PLANNED_SCHEDULES, Candidate, PlanResult, Searcher, SearchSpace
from evenpipe.schedule import ScheduleFamily

__all__ = ["add_arguments", "run"]

_EXPLAIN_TOPICS = ("bpipe",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of --model, --hf-config or --arch with its sizes)")
    model.add_argument("--model", metavar="PRESET", help="model preset, e.g. gpt3-175b, llama2-70b")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json")
    model.add_argument("--arch", metavar="ARCH", help="explicit architecture: gpt or llama")
    model.add_argument("--layers", type=int, help="transformer layers (with --arch)")
    model.add_argument("--hidden", type=int, help="hidden size (with --arch)")
    model.add_argument("--heads", type=int, help="attention heads (with --arch)")
    model.add_argument("--kv-heads", type=int, help="key/value heads (with --arch; default: --heads)")
    model.add_argument("--ffn-hidden", type=int, help="MLP hidden size (with --arch; default from the arch)")
    model.add_argument("--vocab", type=int, help="vocabulary size (with --arch)")
    model.add_argument("--seq-len", type=int, help="sequence length (required with --arch; overrides presets)")
    parser.add_argument("--gpu", required=True, metavar="PRESET", help="GPU preset, e.g. a100-80gb, h100-80gb")
    parser.add_argument("--gpus", type=int, required=True, metavar="N", help="total number of GPUs")
    parser.add_argument("--global-batch", type=int, required=True, metavar="B", help="sequences per step")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="configurations to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--explain", metavar="TOPIC", help="explain a choice; 'bpipe': does BPipe pay here?")
    parser.add_argument("--attention", default=Attention.FLASH.value, metavar="KERNEL",
                        help="attention kernel: eager or flash (default flash)")
    parser.add_argument("--schedules", metavar="LIST", help="comma-separated schedule families to search "
                        f"(default {','.join(s.value for s in PLANNED_SCHEDULES)})")
    parser.add_argument("--recompute", metavar="LIST", help="comma-separated recomputation policies to search "
                        "(default none,selective,full)")
    parser.add_argument("--max-microbatch-size", type=int, default=16, metavar="N",
                        help="largest micro-batch size tried (default 16)")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="never use sequence parallelism")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="shard optimizer state over data parallelism")
    parser.add_argument("--bpipe-budget", type=int, metavar="K", help="BPipe per-rank activation budget")


def _parse_enum_list(text: str | None, enum_type: type, what: str, default: tuple) -> tuple:  # type: ignore[type-arg]
    if text is None:
        return default
    by_value = {e.value: e for e in enum_type}
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name not in by_value:
            raise choice_error(what, name, list(by_value))
        out.append(by_value[name])
    if not out:
        raise ConfigError(f"--{what} needs at least one value; choose from: {', '.join(by_value)}")
    return tuple(dict.fromkeys(out))


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    chosen = [flag for flag, value in (("--model", args.model), ("--hf-config", args.hf_config),
                                       ("--arch", args.arch)) if value is not None]
    if len(chosen) != 1:
        raise ConfigError(f"give exactly one of --model, --hf-config or --arch (got {', '.join(chosen) or 'none'})")
    if args.model is not None:
        spec = model_preset(args.model)
    elif args.hf_config is not None:
        return from_hf_config(args.hf_config, seq_len=args.seq_len)
    else:
        return _model_from_arch(args)
    return spec if args.seq_len is None else _replace(spec, seq_len=args.seq_len)


def _model_from_arch(args: argparse.Namespace) -> ModelSpec:
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "vocab", "seq_len")
               if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"--arch {args.arch} also needs {', '.join(missing)}")
    arch = Arch.parse(args.arch)
    ffn = args.ffn_hidden if args.ffn_hidden is not None else _default_ffn(arch, args.hidden)
    return ModelSpec(name=f"custom-{arch.value}", arch=arch, num_layers=args.layers, hidden=args.hidden,
                     num_heads=args.heads, num_kv_heads=args.kv_heads or args.heads, ffn_hidden=ffn,
                     vocab=args.vocab, seq_len=args.seq_len, tied_embeddings=arch is Arch.GPT)


def _default_ffn(arch: Arch, hidden: int) -> int:
    if arch is Arch.GPT:
        return 4 * hidden
    # LLaMA's SwiGLU: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023's multiple_of)
    return -(-(8 * hidden // 3) // 256) * 256


def _replace(spec: ModelSpec, **changes: int) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def _space_from_args(args: argparse.Namespace) -> SearchSpace:
    attention = _parse_enum_list(args.attention, Attention, "attention", (Attention.FLASH,))
    if len(attention) != 1:
        raise ConfigError(f"--attention takes one kernel, got {args.attention!r}")
    return SearchSpace(
        schedules=_parse_enum_list(args.schedules, ScheduleFamily, "schedules", PLANNED_SCHEDULES),
        recomputes=_parse_enum_list(args.recompute, Recompute, "recompute",
                                    (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)),
        max_microbatch_size=args.max_microbatch_size, attention=attention[0],
        sequence_parallel=not args.no_sequence_parallel, distributed_optimizer=args.distributed_optimizer,
        bpipe_budget=args.bpipe_budget)


def run(args: argparse.Namespace) -> int:
    if args.explain is not None and args.explain not in _EXPLAIN_TOPICS:
        raise choice_error("--explain topic", args.explain, _EXPLAIN_TOPICS)
    model = _model_from_args(args)
    hw: Hardware = hardware_preset(args.gpu)
    space = _space_from_args(args)
    if args.explain == "bpipe" and ScheduleFamily.BPIPE not in space.schedules:
        space = _replace_space(space, schedules=space.schedules + (ScheduleFamily.BPIPE,))
    searcher = Searcher(model, hw)
    t0 = time.perf_counter()
    result = searcher.search(num_gpus=args.gpus, global_batch=args.global_batch, space=space, top_k=args.top)
    explanation = explain_bpipe(searcher, result) if args.explain == "bpipe" else None
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps(_json(model, hw, args, result, explanation, elapsed), indent=2))
    else:
        print("\n".join(_table(model, hw, args, space, result, elapsed)))
        if explanation is not None:
            print()
            print("\n".join(_explanation_lines(model, hw, args, space, explanation)))
    return 0


def _replace_space(space: SearchSpace, **changes: object) -> SearchSpace:
    import dataclasses

    return dataclasses.replace(space, **changes)  # type: ignore[arg-type]


# -- presentation ---------------------------------------------------------------------------------------------------
def _json(model: ModelSpec, hw: Hardware, args: argparse.Namespace, result: PlanResult,
          explanation: BPipeExplanation | None, elapsed: float) -> dict[str, object]:
    s = result.stats
    out: dict[str, object] = {
        "model": model.name, "gpu": hw.name, "gpus": args.gpus, "global_batch": args.global_batch,
        "candidates": [c.to_dict() for c in result.candidates],
        "best_by_schedule": {f.value: c.to_dict() for f, c in result.best_by_schedule.items()},
        "search": {"enumerated": s.num_enumerated, "invalid": s.num_invalid, "over_memory": s.num_over_memory,
                   "bounded": s.num_bounded, "estimated": s.num_estimated, "seconds": elapsed},
    }
    if explanation is not None:
        out["explain_bpipe"] = explanation.to_dict()
    return out


def _describe(c: Candidate) -> str:
    cfg = c.config
    chunks = f" v={cfg.chunks}" if cfg.chunks > 1 else ""
    return (f"{cfg.schedule.value}{chunks} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} mbs={cfg.microbatch_size} "
            f"(m={cfg.num_microbatches}) recompute={cfg.recompute.value}")


def _table(model: ModelSpec, hw: Hardware, args: argparse.Namespace, space: SearchSpace, result: PlanResult,
           elapsed: float) -> list[str]:
    head = ("#", "schedule", "v", "tp", "pp", "dp", "mbs", "m", "recompute", "step s", "MFU", "peak GiB",
            "bubble", "limited by")
    rows = [head]
    for i, c in enumerate(result.candidates, 1):
        cfg = c.config
        rows.append((str(i), cfg.schedule.value, str(cfg.chunks), str(cfg.tp), str(cfg.pp), str(cfg.dp),
                     str(cfg.microbatch_size), str(cfg.num_microbatches), cfg.recompute.value,
                     f"{c.step_time_s:.3f}", f"{100 * c.mfu:.1f}%", f"{c.peak_memory_gib:.1f}",
                     f"{100 * c.estimate.bubble_fraction:.1f}%", c.limited_by))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    s = result.stats
    lines = [f"{model.name} on {args.gpus} x {hw.name} ({hw.memory_gib:g} GiB), global batch {args.global_batch}, "
             f"seq {model.seq_len}, {space.attention.value} attention"]
    lines += ["  ".join(cell.rjust(w) if j not in (1, 8, 13) else cell.ljust(w)
                        for j, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.append(f"searched {s.num_enumerated} configurations in {elapsed:.2f} s: {s.num_invalid} invalid, "
                 f"{s.num_over_memory} over memory, {s.num_bounded} skipped by the step-time bound, "
                 f"{s.num_estimated} simulated")
    return lines


def _explanation_lines(model: ModelSpec, hw: Hardware, args: argparse.Namespace, space: SearchSpace,
                       e: BPipeExplanation) -> list[str]:
    where = f"{model.name} on {args.gpus} x {hw.name} ({space.attention.value} attention)"
    if e.bpipe is None:
        return [f"Does BPipe pay for {where}? Not applicable: no BPipe configuration fits "
                "(BPipe needs at least 3 pipeline ranks)."]
    answer = {Verdict.PAYS: f"YES: {100 * e.gain:+.1f}% throughput",
              Verdict.MARGINAL: f"MARGINAL: {100 * e.gain:+.1f}% throughput, within the {100 * e.margin:.0f}% margin",
              Verdict.DOES_NOT_PAY: f"NO: the best BPipe configuration is {100 * -e.gain / (1 + e.gain):.1f}% "
                                    "slower"}[e.verdict]
    base, bp = e.baseline, e.bpipe
    lines = [f"Does BPipe pay for {where}? {answer}.",
             f"  best without BPipe: {_describe(base)}",
             f"      step {base.step_time_s:.3f} s, MFU {100 * base.mfu:.1f}%, peak {base.peak_memory_gib:.1f} GiB, "
             f"bubble {100 * base.estimate.bubble_fraction:.1f}%",
             f"  best with BPipe:    {_describe(bp)}",
             f"      step {bp.step_time_s:.3f} s, MFU {100 * bp.mfu:.1f}%, peak {bp.peak_memory_gib:.1f} GiB, "
             f"bubble {100 * bp.estimate.bubble_fraction:.1f}%"]
    lines += _lever_lines(e, hw)
    lines += _component_lines(e)
    return lines


def _lever_lines(e: BPipeExplanation, hw: Hardware) -> list[str]:
    assert e.bpipe is not None
    base, bp = e.baseline.config, e.bpipe.config
    details = {"a larger micro-batch": f"micro-batch {base.microbatch_size} -> {bp.microbatch_size}",
               "less recomputation": f"recompute {base.recompute.value} -> {bp.recompute.value}",
               "fewer pipeline stages": f"pp {base.pp} -> {bp.pp}",
               "less tensor parallelism": f"tp {base.tp} -> {bp.tp}"}
    if e.levers:
        lever = "; ".join(f"{lv.value} ({details[lv.value]})" for lv in e.levers)
    else:
        lever = "none (it uses the same micro-batch, recomputation, pp and tp as the best configuration without it)"
    lines = [f"  lever: {lever}"]
    if e.twin_fits is False:
        lines.append(f"    the same configuration with 1F1B needs {e.twin_peak_memory_gib:.1f} GiB on its first stage "
                     f"(> {hw.memory_gib:g} GiB): BPipe is what makes it fit")
    elif e.twin is not None:
        lines.append(f"    the same configuration also fits with 1F1B ({e.twin_peak_memory_gib:.1f} GiB, step "
                     f"{e.twin.step_time_s:.3f} s): BPipe unlocks nothing here, its transfers only add time")
    return lines


def _component_lines(e: BPipeExplanation) -> list[str]:
    assert e.bpipe is not None
    gains = [c for c in e.components if c.delta_s < 0]
    costs = [c for c in e.components if c.delta_s > 0]
    fmt = lambda cs: ", ".join(f"{c.name.replace('_', ' ')} {c.delta_s:+.3f} s" for c in cs) or "nothing"  # noqa
    m_base, m_bp = e.baseline.config.num_microbatches, e.bpipe.config.num_microbatches
    lines = [f"  saves: {fmt(gains)}",
             f"  eaten by: {fmt(costs)}"]
    notes = []
    for eater in e.eaters:
        if eater.name == "BUBBLE":
            notes.append(f"bubble {100 * e.baseline.estimate.bubble_fraction:.1f}% -> "
                         f"{100 * e.bpipe.estimate.bubble_fraction:.1f}% with {m_base} -> {m_bp} micro-batches")
        elif eater.name == "TRANSFER":
            notes.append(f"evict/load transfers expose {e.component('bpipe_transfer').bpipe_s:.3f} s")
        elif eater.name == "ACCEPTOR_MEMORY":
            notes.append(f"acceptors host up to {e.hosted_gib:.1f} GiB of their partners' activations")
    if notes:
        lines.append("    " + "; ".join(notes))
    return lines
