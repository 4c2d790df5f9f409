"""``evenpipe profile``: measure a model's layers, optimizer step and point-to-point messages on this machine,
write the profile JSON, print the fits and draw ``efficiency_vs_microbatch.png``."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from evenpipe.cost.profile import LayerKind, Profile
from evenpipe.cost.profile_fit import Fit, ProfileModel, link_from_profile
from evenpipe.errors import ConfigError

__all__ = ["add_arguments", "run", "parse_int_list", "fit_report"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="reference model preset, e.g. gpt-mini, llama-mini")
    src.add_argument("--hf-config", default=None, metavar="PATH", help="a Hugging Face config.json")
    src.add_argument("--analyze", default=None, metavar="PROFILE",
                     help="measure nothing: print the fits of an existing profile and draw its picture")
    p.add_argument("--microbatch-sizes", default="1,2,4", metavar="B,B,..", help="sizes to measure (default 1,2,4)")
    p.add_argument("--seq-len", default=None, metavar="S[,S..]",
                   help="sequence length(s) to measure (default: the model's)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per mean (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    p.add_argument("--block-chain", type=int, default=4, metavar="N",
                   help="distinct blocks timed one after another for a block's times, as a stage runs them "
                        "(default 4, at most the model's blocks)")
    p.add_argument("--processes", type=int, default=2,
                   help="processes measuring at once on CPU, one per pipeline rank you will train with (default 2)")
    p.add_argument("--predict-sizes", default=None, metavar="B,B,..",
                   help="unprofiled micro-batch sizes to print predictions for (default: between and after)")
    p.add_argument("--out", default="profile.json", help="profile JSON to write (default profile.json)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="efficiency picture (default efficiency_vs_microbatch.png next to --out)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else one line per step)")


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; ConfigError naming the flag otherwise."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r} must be comma-separated positive integers, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r} must be comma-separated positive integers, e.g. 1,2,4")
    return tuple(sorted(set(values)))


def _model_config(args: argparse.Namespace, seq_lens: tuple[int, ...]):  # -> ModelConfig
    from evenpipe.models import load_model_config, model_config
    longest = max(seq_lens) if seq_lens else None
    if args.hf_config:
        # named by its absolute path, as `train --hf-config` names it, so `train --predict` accepts the profile
        # from any working directory
        return os.path.abspath(args.hf_config), load_model_config(args.hf_config,
                                                                  **({"seq_len": longest} if longest else {}))
    name = args.model or "gpt-mini"
    cfg = model_config(name)
    if longest and longest > cfg.seq_len:
        cfg = model_config(name, seq_len=longest)
    return name, cfg


def _fmt(v: float, quantity: str) -> str:
    if quantity.endswith("_s"):
        return f"{v * 1e3:11.3f} ms"
    return f"{v / 2**20:10.3f} MiB"


def _resid(fit: Fit) -> str:
    """The residual cell: ``exact`` where the fit has as many terms as distinct points and passes through them
    (nothing is left to measure the fit against), else the largest relative residual."""
    distinct = len({xs for xs, _ in fit.points})
    if distinct <= sum(1 for c in fit.coefficients if c != 0) and fit.max_abs_residual < 1e-9:
        return f"{'exact':>10s} "
    return f"{fit.max_abs_residual:10.1%} "


def fit_report(profile: Profile, predict_sizes: tuple[int, ...] = ()) -> str:
    """The fits: every quantity per kind at the profiled sizes (measured, fit, residual) and at ``predict_sizes``."""
    model = ProfileModel(profile)
    lines = [f"profile of {profile.model.name} on {profile.machine.device_name} ({profile.machine.device}, "
             f"{profile.machine.dtype}, {profile.machine.num_threads} thread(s) x {profile.machine.num_processes} "
             f"process(es), torch {profile.machine.torch_version})",
             f"blocks timed {profile.block_chain} in a row, per block; "
             f"fit: each quantity = {' + '.join(model.features)} terms, least squares over the profiled sizes", ""]
    quantities = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "recompute_s", "saved_bytes",
                  "input_saved_bytes", "output_bytes", "weight_grad_bytes")
    sizes = profile.microbatch_sizes
    extra = tuple(b for b in predict_sizes if b not in sizes)
    header = f"{'kind':9s} {'quantity':18s}" + "".join(f"{'b=' + str(b):>14s}" for b in sizes) \
        + f"{'max resid':>11s}" + "".join(f"{'b=' + str(b) + ' pred':>15s}" for b in extra)
    lines += [header, "-" * len(header)]
    seq = profile.seq_lens[-1]
    for kind in LayerKind:
        samples = {s.microbatch_size: s for s in profile.layers[kind] if s.seq_len == seq}
        for q in quantities:
            fit = model.fits[(kind, q)]
            row = f"{kind.value:9s} {q:18s}" + "".join(
                (_fmt(samples[b].value(q), q) if b in samples else f"{'-':>14s}") for b in sizes)
            row += _resid(fit) + "".join(
                f"{_fmt(getattr(model.predict(kind, b), q), q):>15s}" for b in extra)
            lines.append(row)
    if any("exact" in line for line in lines[4:]):
        lines.append(f"(exact: as many profiled sizes as fit terms ({len(model.features)}), so the fit passes through "
                     "every point by construction and has no residual to show; profile more sizes to test it)")
    opt = ", ".join(f"{k.value} {v * 1e3:.2f} ms" for k, v in profile.optimizer_s.items())
    lines += ["", f"after the schedule (gradient norm and AdamW) per layer: {opt}"]
    link = link_from_profile(profile)
    if profile.link:
        bw = link.bandwidth_bytes_per_s
        lines.append(f"point-to-point ({profile.machine.backend}): latency {link.latency_s * 1e3:.3f} ms, "
                     f"bandwidth {bw / 1e9:.2f} GB/s (fit over {len(profile.link)} sizes, "
                     f"{profile.link[0].num_bytes} B .. {profile.link[-1].num_bytes / 2**20:.0f} MiB)")
    if profile.handoff_latency_s > 0:
        lines.append(f"a hand-off between computing processes ({profile.handoff_bytes / 2**10:.0f} KiB): "
                     f"{profile.handoff_latency_s * 1e3:.3f} ms mean with its receive waiting (the link's latency: "
                     f"{link.latency_s * 1e3:.3f} ms), {profile.late_receive_s * 1e3:.3f} ms more when the receive "
                     "is posted after the send")
    if profile.alternation_blocks > 0:
        lines.append(f"two chunks of {profile.alternation_blocks} block(s) on one rank in interleaved order: "
                     f"forward {profile.alternation_forward:.3f}x, backward {profile.alternation_backward:.3f}x "
                     "their time alone (applied where a rank holds several stages)")
    if profile.transfer_cpu_s_per_byte > 0:
        lines.append(f"a transfer's cost to the computes at both ends: {profile.transfer_cpu_s_per_byte * 2**20 * 1e3:.3f} "
                     "ms per MiB sent or received")
    lines.append(f"fixed per step (loss broadcast): {profile.step_overhead_s * 1e3:.3f} ms")
    eff = model.efficiency(sorted(set(sizes) | set(extra)))
    lines += ["", "achieved FLOP/s of one block (forward):"]
    for p in eff:
        meas = f"{p.measured_flops_per_s / 1e9:8.2f}" if p.measured_flops_per_s else "       -"
        lines.append(f"  b={p.microbatch_size:<3d} measured {meas} GFLOP/s   fit {p.predicted_flops_per_s / 1e9:8.2f} "
                     "GFLOP/s")
    return "\n".join(lines)


def _default_predict_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    between = [b for b in range(sizes[0], sizes[-1] + 1) if b not in sizes]
    return tuple(between[:3]) + (2 * sizes[-1],)


def _check_writable(out: pathlib.Path) -> None:
    """Create ``out``'s folder if missing; ConfigError (one line) when it cannot hold the file."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot create its folder ({e.strerror})") from None
    if out.is_dir() or not os.access(out.parent, os.W_OK):
        raise ConfigError(f"--out {str(out)!r} must be a file path in a writable folder")


def run(args: argparse.Namespace) -> int:
    from evenpipe.commands.output_paths import check_picture_file
    from evenpipe.cost.profile import load_profile
    check_picture_file(args.plot, "--plot", create_folders=True)
    if args.analyze:
        profile = load_profile(args.analyze)
        out = pathlib.Path(args.analyze)
    else:
        from evenpipe.runtime.profile import ProfileOptions, profile_model
        sizes = parse_int_list(args.microbatch_sizes, "--microbatch-sizes")
        seq_lens = parse_int_list(args.seq_len, "--seq-len") if args.seq_len else ()
        name, cfg = _model_config(args, seq_lens)
        options = ProfileOptions(model_name=name, model_config=cfg, hf_config=args.hf_config,
                                 microbatch_sizes=sizes, seq_lens=seq_lens, dtype=args.dtype, device=args.device,
                                 repeats=args.repeats, warmup=args.warmup, num_processes=args.processes,
                                 block_chain=args.block_chain)
        out = pathlib.Path(args.out)
        _check_writable(out)  # before minutes of measuring, not after
        if not args.no_progress:
            print(f"profiling {name} at micro-batch sizes {','.join(map(str, sizes))} on {args.device} "
                  f"({args.processes} process(es) at once) into {out}", file=sys.stderr, flush=True)
        profile = profile_model(options, show_progress=not args.no_progress)
        out.write_text(profile.to_json())
        print(f"wrote {out}")
    predict = parse_int_list(args.predict_sizes, "--predict-sizes") if args.predict_sizes else \
        _default_predict_sizes(profile.microbatch_sizes)
    print(fit_report(profile, predict))
    from evenpipe.report.efficiency import save_efficiency  # matplotlib
    plot = pathlib.Path(args.plot) if args.plot else out.with_name("efficiency_vs_microbatch.png")
    sizes_all = sorted(set(profile.microbatch_sizes) | set(predict))
    save_efficiency(ProfileModel(profile).efficiency(sizes_all), plot,
                    title=f"{pathlib.PurePath(profile.model.name).name}, one block\n{profile.machine.device_name} "
                          f"({profile.machine.dtype})")  # a config.json's path would overflow the line
    print(f"\nwrote {plot}")
    return 0
