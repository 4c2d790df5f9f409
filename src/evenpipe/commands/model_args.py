"""The model arguments shared by `evenpipe estimate` and `evenpipe plan`: a preset, a Hugging Face config.json, or
an explicit architecture with its sizes."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from typing import TYPE_CHECKING

from evenpipe.errors import ConfigError

if TYPE_CHECKING:  # the cost model is imported when a model is asked for (`simulate` without one never needs it)
    from evenpipe.cost import Hardware, ModelSpec
    from evenpipe.cost.runtime_memory import RuntimeConventions
    from evenpipe.cost.source import CostSource

__all__ = ["add_model_arguments", "model_from_args", "parse_layout", "any_model_given", "hardware_from_arg",
           "add_profile_arguments", "add_gpus_per_node_argument", "with_gpus_per_node", "source_from_args",
           "add_runtime_arguments", "conventions_from_args"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model (one of --model, --hf-config or --arch with its sizes)")
    m.add_argument("--model", metavar="PRESET", help="model preset, e.g. gpt3-175b, llama2-70b")
    m.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json, or a directory holding one")
    m.add_argument("--arch", metavar="ARCH", help="explicit architecture: gpt or llama")
    m.add_argument("--layers", type=int, help="transformer layers (with --arch)")
    m.add_argument("--hidden", type=int, help="hidden size (with --arch)")
    m.add_argument("--heads", type=int, help="attention heads (with --arch)")
    m.add_argument("--kv-heads", type=int, help="key/value heads (with --arch; default --heads)")
    m.add_argument("--ffn-hidden", type=int, help="MLP size (with --arch; default 4·h for gpt, ~8/3·h for llama)")
    m.add_argument("--vocab", type=int, help="vocabulary size (with --arch)")
    m.add_argument("--seq-len", type=int, help="sequence length (required with --arch; overrides a preset's)")


def parse_layout(text: str, flag: str = "--layout") -> tuple[int, ...]:
    """``"7,8,8,7"`` -> ``(7, 8, 8, 7)``; anything else is a one-line ConfigError."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r} must be comma-separated integers, e.g. 5,6,6,5") from None


def hardware_from_arg(text: str) -> Hardware:
    """``--gpu``: a preset name, or a profile ``FILE.json``."""
    from evenpipe.cost import hardware_preset, load_hardware
    return load_hardware(text) if text.endswith(".json") else hardware_preset(text)


def any_model_given(args: argparse.Namespace) -> bool:
    """Whether one of --model, --hf-config or --arch was given."""
    return any(getattr(args, n) is not None for n in ("model", "hf_config", "arch"))


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The ModelSpec named by exactly one of --model, --hf-config, --arch (+ sizes); --seq-len overrides."""
    from evenpipe.cost import Arch, ModelSpec, from_hf_config, model_preset
    from evenpipe.cost.specs import swiglu_ffn_hidden
    chosen = [flag for flag, value in (("--model", args.model), ("--hf-config", args.hf_config),
                                       ("--arch", args.arch)) if value is not None]
    if len(chosen) != 1:
        raise ConfigError(f"give exactly one of --model, --hf-config or --arch (got {', '.join(chosen) or 'none'})")
    if args.model is not None:
        spec = model_preset(args.model)
    elif args.hf_config is not None:
        spec = from_hf_config(args.hf_config)
    else:
        arch = Arch.parse(args.arch)
        missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "vocab", "seq_len")
                   if getattr(args, n) is None]
        if missing:
            raise ConfigError(f"--arch {arch.value} needs {', '.join(missing)}")
        ffn = args.ffn_hidden or (4 * args.hidden if arch is Arch.GPT else swiglu_ffn_hidden(args.hidden))
        return ModelSpec(name=f"{arch.value}-L{args.layers}-h{args.hidden}", arch=arch, num_layers=args.layers,
                         hidden=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads or args.heads,
                         ffn_hidden=ffn, vocab=args.vocab, seq_len=args.seq_len,
                         tied_embeddings=arch is Arch.GPT)
    if args.seq_len is not None:
        spec = dataclasses.replace(spec, seq_len=args.seq_len)
    return spec


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("measured profile (instead of --gpu)")
    g.add_argument("--profile", default=None, metavar="PROFILE",
                   help="profile JSON from `evenpipe profile`: predict on the profiled machine")
    g.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="with --profile: memory budget per device (the CPU has no preset capacity)")


def add_gpus_per_node_argument(parser: "argparse.ArgumentParser | argparse._ArgumentGroup") -> None:
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help="GPUs in one node (default: the --gpu preset's, 8); tensor parallelism must divide it")


def with_gpus_per_node(hw: "Hardware", args: argparse.Namespace) -> "Hardware":
    """``hw`` with ``--gpus-per-node`` when given (one-line error unless it is a positive integer)."""
    n = getattr(args, "gpus_per_node", None)
    if n is None:
        return hw
    if n < 1:
        raise ConfigError(f"--gpus-per-node must be a positive integer, got {n}")
    return dataclasses.replace(hw, gpus_per_node=n)


def source_from_args(args: argparse.Namespace, command: str) -> CostSource:
    """Where the costs come from: ``--gpu PRESET`` (with the model arguments) or ``--profile PROFILE`` (the
    profiled model on the profiled machine, ``--memory-gib`` per device)."""
    from evenpipe.cost.analytic_source import AnalyticSource
    if args.profile:
        if args.gpu is not None:
            raise ConfigError(f"give one of --gpu or --profile, not both (got --gpu {args.gpu} and --profile "
                              f"{args.profile})")
        from evenpipe.cost.profile import load_profile
        from evenpipe.cost.profile_fit import ProfileModel
        from evenpipe.cost.profiled_source import ProfiledSource
        profile = load_profile(args.profile)
        if getattr(args, "model", None) and args.model != profile.model.name:
            profile.check_model(args.model)
        if args.memory_gib is not None and not args.memory_gib > 0:
            raise ConfigError(f"--memory-gib must be > 0, got {args.memory_gib}")
        if getattr(args, "gpus_per_node", None) is not None:
            warnings.warn("--gpus-per-node has no effect with --profile (a profile plans tp 1 on its device)",
                          stacklevel=2)
        return ProfiledSource(ProfileModel(profile), memory_budget_gib=args.memory_gib)
    if args.gpu is None:
        raise ConfigError(f"give --gpu PRESET (or --profile PROFILE to {command} on the profiled machine)")
    return AnalyticSource(model_from_args(args), with_gpus_per_node(hardware_from_arg(args.gpu), args))



def add_runtime_arguments(parser: "argparse.ArgumentParser | argparse._ArgumentGroup", *,
                          default_runtime: str = "evenpipe", preset_dtype: str = "float32") -> None:
    """``--runtime``, ``--dtype`` and ``--sharding``: whose model-state conventions the memory follows;
    ``preset_dtype`` is evenpipe's training dtype on a GPU preset when ``--dtype`` is not given."""
    parser.add_argument("--runtime", default=default_runtime, metavar="NAME",
                        help="model-state conventions: evenpipe (what `evenpipe train` keeps) or megatron (bf16 "
                             "weights, fp32 grads, masters and Adam: the published tables); default "
                             f"{default_runtime}")
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help="training dtype as `train --dtype`: float32 or bfloat16 (default: a profile's dtype, "
                             f"else {preset_dtype}; evenpipe runtime only)")
    parser.set_defaults(preset_dtype=preset_dtype)
    parser.add_argument("--sharding", default=None, metavar="MODE",
                        help="as `train --sharding`: none, optimizer or full (default none; optimizer with "
                             "--distributed-optimizer)")


def conventions_from_args(args: argparse.Namespace) -> "RuntimeConventions":
    """The runtime conventions named by ``--runtime``, ``--dtype`` and ``--sharding`` (one-line errors)."""
    from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions, StateSharding, TrainPrecision
    from evenpipe.errors import parse_choice
    runtime = parse_choice(Runtime, args.runtime, "runtime")
    dtype = args.dtype
    if runtime is Runtime.MEGATRON and dtype is None:
        dtype = "bfloat16"
    elif dtype is None:
        profile = getattr(args, "profile", None)
        dtype = _profile_dtype(profile) if profile else getattr(args, "preset_dtype", "float32")
    elif runtime is Runtime.MEGATRON and dtype != "bfloat16":
        raise ConfigError(f"--dtype {dtype}: Megatron's conventions are bf16 mixed precision; --dtype is for "
                          "--runtime evenpipe")
    sharding = args.sharding
    if sharding is None:
        sharding = "optimizer" if getattr(args, "distributed_optimizer", False) else "none"
    elif getattr(args, "distributed_optimizer", False) and parse_choice(StateSharding, sharding, "sharding") is StateSharding.NONE:
        raise ConfigError("--distributed-optimizer with --sharding none: give one (--sharding optimizer is the "
                          "distributed optimizer)")
    return RuntimeConventions(runtime=runtime, dtype=parse_choice(TrainPrecision, dtype, "dtype"),
                              sharding=parse_choice(StateSharding, sharding, "sharding"))


def _profile_dtype(path: str) -> str:
    from evenpipe.cost.profile import load_profile
    return load_profile(path).machine.dtype
