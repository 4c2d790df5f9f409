"""``estimate --profile`` and ``plan --profile``: the same questions answered from a measured profile of this
machine instead of the GPU presets (the device is the profiled one; ``--memory-gib`` is the per-device budget)."""

from __future__ import annotations

import argparse
import json

from evenpipe.cost.profile_fit import ProfileModel
from evenpipe.errors import ConfigError
from evenpipe.plan.profiled import ProfiledConfig, ProfiledEstimate, estimate_profiled, explain_bpipe_profiled, \
    plan_profiled
from evenpipe.schedule import ScheduleFamily

__all__ = ["add_profile_arguments", "run_estimate", "run_plan", "format_profiled"]


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("measured profile (instead of --gpu)")
    g.add_argument("--profile", default=None, metavar="PROFILE",
                   help="profile JSON from `evenpipe profile`: predict on the profiled machine")
    g.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="with --profile: memory budget per device (the CPU has no preset capacity)")


def _model(args: argparse.Namespace) -> ProfileModel:
    from evenpipe.cost.profile import load_profile
    profile = load_profile(args.profile)
    if getattr(args, "model", None) and args.model != profile.model.name:
        profile.check_model(args.model)
    return ProfileModel(profile)


def _budget(args: argparse.Namespace) -> float | None:
    if args.memory_gib is None:
        return None
    if not args.memory_gib > 0:
        raise ConfigError(f"--memory-gib must be > 0, got {args.memory_gib}")
    return args.memory_gib * 2**30


def format_profiled(e: ProfiledEstimate) -> str:
    m = e.prediction
    lines = [f"{e.config.describe()}: step {e.step_time_s * 1e3:.1f} ms ({e.tokens_per_s:,.0f} tokens/s), bubble "
             f"{e.bubble_fraction:.1%}, schedule {m.trace.step_time * 1e3:.1f} ms + optimizer "
             f"{max(m.optimizer_s) * 1e3:.1f} ms"]
    lines.append("  rank   state MiB   activations MiB   total MiB")
    for r, (s, a) in enumerate(zip(e.state_bytes, e.activation_bytes)):
        lines.append(f"  {r:4d} {s / 2**20:11.2f} {a / 2**20:17.2f} {(s + a) / 2**20:11.2f}")
    if e.memory_budget_bytes is not None:
        lines.append(f"  fits {e.memory_budget_bytes / 2**30:g} GiB per device: {'yes' if e.fits else 'NO'}")
    return "\n".join(lines)


def run_estimate(args: argparse.Namespace) -> int:
    """One configuration: --schedule, --pp, --chunks, --microbatch-size, --global-batch (dp 1)."""
    model = _model(args)
    family = ScheduleFamily.parse(args.schedule)
    if args.global_batch % args.microbatch_size:
        raise ConfigError(f"--global-batch {args.global_batch} is not divisible by --microbatch-size "
                          f"{args.microbatch_size}")
    cfg = ProfiledConfig(schedule=family, num_ranks=args.pp, microbatch_size=args.microbatch_size,
                         num_microbatches=args.global_batch // args.microbatch_size,
                         num_chunks=family.traits.chunks.chunks(args.chunks), bpipe_budget=args.bpipe_budget,
                         bpipe=bool(getattr(args, "bpipe", False)))
    est = estimate_profiled(model, cfg, memory_budget_bytes=_budget(args))
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_profiled(est))
    if getattr(args, "require_fit", False) and not est.fits:
        raise ConfigError(f"configuration does not fit: peak {max(est.peak_bytes) / 2**30:.3f} GiB > "
                          f"{args.memory_gib:g} GiB")
    return 0


def run_plan(args: argparse.Namespace, schedules: tuple[ScheduleFamily, ...]) -> int:
    """Search pipeline configurations on ``--gpus`` devices; ``--explain bpipe`` answers from the profile."""
    model = _model(args)
    budget = _budget(args)
    devices = args.gpus
    if args.explain:
        if budget is None:
            raise ConfigError("--explain bpipe --profile needs --memory-gib (BPipe pays only by what memory buys)")
        answer = explain_bpipe_profiled(model, num_devices=devices, global_batch=args.global_batch,
                                        memory_budget_bytes=budget, max_microbatch_size=args.max_microbatch_size)
        if args.json:
            print(json.dumps({"pays": answer.pays, "text": answer.text,
                              "with_bpipe": answer.with_bpipe.to_dict() if answer.with_bpipe else None,
                              "without": answer.without.to_dict() if answer.without else None}, indent=2))
        else:
            print(answer.text)
        return 0
    cands = plan_profiled(model, num_devices=devices, global_batch=args.global_batch, memory_budget_bytes=budget,
                          schedules=schedules, max_microbatch_size=args.max_microbatch_size)
    fitting = [e for e in cands if e.fits][: args.top]
    if args.json:
        print(json.dumps([e.to_dict() for e in fitting], indent=2))
        return 0
    if not fitting:
        raise ConfigError(f"nothing fits {args.memory_gib:g} GiB per device; the smallest needs "
                          f"{min(max(e.peak_bytes) for e in cands) / 2**30:.3f} GiB")
    print(f"{'configuration':38s} {'step ms':>9s} {'tokens/s':>10s} {'peak MiB':>9s} {'bubble':>7s}")
    for e in fitting:
        print(f"{e.config.describe():38s} {e.step_time_s * 1e3:9.1f} {e.tokens_per_s:10,.0f} "
              f"{max(e.peak_bytes) / 2**20:9.1f} {e.bubble_fraction:7.1%}")
    return 0
