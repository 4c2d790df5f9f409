"""``evenpipe train``: train a reference model or a Hugging Face causal LM with a pipeline schedule over
torch.distributed.

Every option is checked here, before any process starts (bad values exit 2 with one line). Without torchrun's
environment the command starts ``stages x dp x tp`` local processes itself through ``torch.distributed.run``; under
torchrun (RANK and WORLD_SIZE set) this process is one worker.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from evenpipe.errors import ConfigError
from evenpipe.schedule.family import ScheduleFamily

if TYPE_CHECKING:
    from evenpipe.training.config import DataSource, ScheduleOptions, TrainConfig

__all__ = ["add_arguments", "run", "build_config", "check_fits_machine", "header", "parse_size"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="model preset, e.g. gpt-tiny (default), llama-tiny, gpt-mini")
    model.add_argument("--hf-config", default=None, metavar="PATH",
                       help="a Hugging Face config.json, or a directory holding one (and maybe save_pretrained "
                       "safetensors weights): llama, mistral, qwen2 or gpt2 (needs the 'hf' extra)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations; bfloat16 keeps fp32 master weights and optimizer state")
    p.add_argument("--schedule", default="1f1b",
                   help=f"schedule family: {', '.join(f.value for f in ScheduleFamily)} (default 1f1b)")
    p.add_argument("--bpipe", action="store_true",
                   help="apply BPipe to the schedule (1f1b, interleaved, gpipe, looped-bfs, zb-h1)")
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks P (default 4; 1 runs un-pipelined)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step M (default 8)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1; world = stages x dp x tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (default 1; divides the heads)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism with --tp > 1: norms and stage boundaries sharded over the "
                        "sequence")
    p.add_argument("--sharding", default="none",
                   help="sharded data parallelism: none, optimizer (distributed optimizer) or full (FSDP2)")
    p.add_argument("--chunks", type=int, default=None,
                   help="stages per rank V (interleaved, looped-bfs; default 1); the V-shaped families use 2")
    p.add_argument("--microbatch-size", type=int, default=2,
                   help="sequences per micro-batch b (default 2; with --global-batch, b = global batch / "
                        "(microbatches x dp))")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: microbatch-size x microbatches x dp)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--recompute", nargs="?", const="full", default="none", metavar="MODE",
                   help="activation recomputation: none, selective (the attention core of every block) or full "
                        "(whole stages); or one mode per stage, comma-separated (e.g. full,none,selective,none); a "
                        "bare --recompute is full (default none)")
    p.add_argument("--free-outputs", action=argparse.BooleanOptionalAction, default=True,
                   help="free each stage output once sent (default on)")
    p.add_argument("--plan-link-latency", type=float, default=None, metavar="FORWARDS",
                   help="latency-aware: order for every message between pipeline ranks taking this long, in "
                        "forwards of one rank's layers (e.g. 0.25; default: free links)")
    p.add_argument("--bpipe-budget", type=int, default=None,
                   help="BPipe: activation units a rank may hold (default ceil((P+1)/2))")
    p.add_argument("--offload", default=None, metavar="RANKS",
                   help="host offload: these pipeline ranks copy each micro-batch's saved activations to host memory "
                        "after its forward and back one forward before its backward; 'all' or a list or ranges, "
                        "e.g. 0,1 or 0-1 (default none)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", default=None, help="text file to train on, bytes as tokens (default: the shipped corpus)")
    src.add_argument("--random-tokens", action="store_true", help="train on uniformly random tokens")
    src.add_argument("--tokens", default=None, metavar="PATH",
                     help="pre-tokenised flat token file (uint16 or uint32 ids), read by memory map")
    src.add_argument("--documents", default=None, metavar="PATH",
                     help="whole documents, attention kept inside each: NAME.bin with NAME.idx offsets, .jsonl or "
                          ".parquet of {tokens} or {text} (see docs/commands/train.md)")
    p.add_argument("--token-dtype", default="uint16", help="element type of --tokens / a --documents .bin: uint16 or "
                   "uint32")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a local Hugging Face tokenizer.json for --documents given as text")
    p.add_argument("--microbatch-order", default=None, metavar="HOW",
                   help="--documents: each step's micro-batch order, planned (the planner's: cheap ones at the "
                        "pipeline's ends; default) or simulated (the fastest of a few orders the simulator times)")
    p.add_argument("--microbatching", default=None,
                   help="--documents into micro-batches: pad (one per row), pack (first fit, default) or balance")
    p.add_argument("--split-long-documents", action="store_true",
                   help="cut a --documents document longer than --seq-len + 1 tokens instead of refusing it")
    p.add_argument("--microbatch-memory", default=None, metavar="SIZE",
                   help="--documents: activation bytes one micro-batch may save on the largest stage, by the "
                        "--predict profile's bytes per token (e.g. 200KiB, 64MiB, 2GiB or bytes); a document that "
                        "alone needs more is refused (or cut with --split-long-documents)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="report a held-out loss every N steps (the last 5%% of the data is held out)")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches per evaluation")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--lr-schedule", default="constant", help="learning rate after warm-up: constant or cosine")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the cosine")
    p.add_argument("--decay-steps", type=int, default=None,
                   help="step at which the cosine reaches --min-lr (default: --steps)")
    p.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay of matrices and embeddings (biases and norm gains are not decayed)")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the whole model's gradient L2 norm to this (default: no clipping)")
    p.add_argument("--json-out", default=None, help="write losses, step time, memory, throughput as JSON")
    p.add_argument("--metrics", default=None, help="write one JSON line of metrics per step to this file")
    p.add_argument("--log-every", type=int, default=None,
                   help="progress line every N steps (default: about 50 lines per job)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log metrics to TensorBoard in DIR (needs the tensorboard package)")
    p.add_argument("--trace", default=None, help="write a measured Chrome/Perfetto trace of the last step")
    p.add_argument("--trace-json", default=None, metavar="PATH",
                   help="write the measured trace of the last step as evenpipe Trace JSON (for `evenpipe compare`)")
    p.add_argument("--predict", default=None, metavar="PROFILE",
                   help="profile JSON from `evenpipe profile`: print predicted against measured at the end")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                   help="torch.distributed backend (default: nccl with GPUs, else gloo)")
    p.add_argument("--layout", default=None, help="layers per stage (per virtual chunk), e.g. 5,6,6,5")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (torch.distributed.checkpoint; shared by all ranks)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="save every N steps (default: only after the last step)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints to keep")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (any schedule, stages, "
                        "layout, dp, tp, sharding, dtype)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="hold training for the whole save (default: write in the background; the JSON reports "
                        "how long each save held a step)")
    p.add_argument("--overwrite-checkpoints", action="store_true",
                   help="start at step 0 although --checkpoint-dir holds checkpoints; they are deleted once this "
                        "run's first checkpoint is complete")
    p.add_argument("--slow-rank-threshold", type=float, default=1.3,
                   help="name a pipeline rank whose compute, against the prediction (--predict) or its own first "
                        "steps, is this many times its peers' (default 1.3)")
    p.add_argument("--slow-rank-steps", type=int, default=4,
                   help="consecutive slow steps before a rank is named and replan.json written (default 4)")
    p.add_argument("--emulate-slow-rank", default=None, metavar="RANK:FACTOR[@STEP]",
                   help="for tests and benchmarks: pipeline rank RANK's computes take FACTOR times as long from "
                        "0-based step STEP (it sleeps after each)")
    p.add_argument("--emulate-link-delay", action="append", default=[], metavar="A-B:MS",
                   help="for tests and benchmarks: every message between pipeline ranks A and B lands MS "
                        "milliseconds after it is sent, its sender going on at once (repeatable)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank may wait for a peer before the job fails (default: 300 s for the first "
                        "step, then 10x the slowest step, at least 10 s)")


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The typed job config from the parsed options, plus the checks that depend on this machine (ConfigError)."""
    check_output_paths(args)
    import torch

    from evenpipe.training.config import (Backend, CheckpointOptions, DataOptions, ModelOptions,
                                          OptimizerOptions, OutputOptions, RuntimeOptions, ScheduleOptions,
                                          TrainConfig)

    if args.microbatch_size < 1:
        raise ConfigError(f"--microbatch-size must be >= 1, got {args.microbatch_size}")
    schedule = ScheduleOptions(family=args.schedule, num_ranks=args.stages, num_chunks=args.chunks,
                               num_microbatches=args.microbatches, recompute=args.recompute,
                               free_outputs=bool(args.free_outputs), bpipe_budget=args.bpipe_budget,
                               bpipe=args.bpipe, offload=() if args.offload is None else args.offload,
                               layout=_layout(args.layout), link_latency=args.plan_link_latency)
    _warn_idle_offload(schedule, named=args.offload is not None and args.offload.strip().lower() != "all")
    backend = Backend(args.backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    if backend is Backend.NCCL and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs a CUDA GPU and none is visible; use --backend gloo")
    if args.tensorboard:
        from evenpipe.training.metrics import require_tensorboard
        require_tensorboard()
    runtime = RuntimeOptions(steps=args.steps, dp=args.dp, tp=args.tp, sequence_parallel=args.sequence_parallel,
                             sharding=args.sharding, backend=backend,
                             timeout_s=args.timeout, slow_rank_threshold=args.slow_rank_threshold,
                             slow_rank_steps=args.slow_rank_steps, emulate_slow_rank=args.emulate_slow_rank,
                             emulate_link_delays=tuple(args.emulate_link_delay))
    config = TrainConfig(
        model=ModelOptions(preset=args.model or "gpt-tiny", hf_config=_abs(args.hf_config), seq_len=args.seq_len,
                           init_seed=args.seed, dtype=args.dtype),
        schedule=schedule,
        data=DataOptions(source=_source(args), path=_abs(args.tokens or args.corpus or args.documents), seed=args.seed,
                         token_dtype=args.token_dtype, eval_every=args.eval_every, eval_batches=args.eval_batches,
                         global_batch=args.global_batch or args.microbatch_size * args.microbatches * args.dp,
                         microbatching=args.microbatching, tokenizer=_abs(args.tokenizer),
                         split_long_documents=bool(args.split_long_documents),
                         microbatch_order=args.microbatch_order,
                         microbatch_memory=parse_size(args.microbatch_memory, "--microbatch-memory")),
        optimizer=OptimizerOptions(lr=args.lr, schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                   min_lr=args.min_lr, decay_steps=args.decay_steps, weight_decay=args.weight_decay,
                                   clip_grad_norm=args.clip_grad_norm),
        checkpoint=CheckpointOptions(directory=_abs(args.checkpoint_dir), every=args.checkpoint_every,
                                     resume=bool(args.resume), keep=args.keep_checkpoints,
                                     overwrite=bool(args.overwrite_checkpoints),
                                     synchronous=bool(args.checkpoint_sync)),
        runtime=runtime,
        output=OutputOptions(json_out=_abs(args.json_out), trace=_abs(args.trace), metrics=_abs(args.metrics),
                             tensorboard=_abs(args.tensorboard), trace_json=_abs(args.trace_json),
                             predict=_abs(args.predict), log_every=args.log_every),
    )
    from evenpipe.training.checkpoint_manifest import check_fresh_directory
    ck = config.checkpoint
    check_fresh_directory(ck.directory, resume=ck.resume, overwrite=ck.overwrite)
    check_fits_machine(config.model.resolve().num_params, config.model.name, world=config.world_size)
    if args.predict:  # a bad profile is refused here, before any process starts
        from evenpipe.plan.predict import check_profile_for_training
        check_profile_for_training(args.predict, model_name=config.model.name, model_config=config.model.resolve(),
                                   dtype=config.model.dtype.value,
                                   device="cuda" if backend is Backend.NCCL else "cpu")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != config.world_size:
        raise ConfigError(f"world size {os.environ['WORLD_SIZE']} != stages x dp x tp = {args.stages} x {args.dp} "
                          f"x {args.tp} = {config.world_size}")
    return config


def _warn_idle_offload(schedule: ScheduleOptions, *, named: bool) -> None:
    """Warn (the option has no effect there) about an ``--offload`` rank whose schedule runs every backward right
    after its forward, so nothing is ever offloaded (the last rank of 1F1B, for one): a rank ``named`` on the
    command line, or every rank of ``all``."""
    if not schedule.offload:
        return
    from evenpipe.schedule import ActionKind
    built = schedule.build()
    idle = [r for r in schedule.offload if not any(a.kind is ActionKind.OFFLOAD for a in built.actions[r])]
    if idle and (named or len(idle) == len(schedule.offload)):
        import warnings
        warnings.warn(f"--offload: pipeline rank(s) {', '.join(map(str, idle))} offload nothing in "
                      f"{schedule.family.value} (each backward follows its forward at once there)", stacklevel=2)


def check_output_paths(args: argparse.Namespace) -> None:
    """Every path the job will write, checked before any process starts (one line each; see
    :mod:`evenpipe.commands.output_paths`)."""
    from evenpipe.commands.output_paths import check_output_dir, check_output_file
    for flag in ("json_out", "metrics", "trace", "trace_json"):
        check_output_file(getattr(args, flag), "--" + flag.replace("_", "-"))
    check_output_dir(args.tensorboard, "--tensorboard")
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")


_TRAIN_BYTES_PER_PARAM = 16
"""float32 weights, gradients and two AdamW moments."""


def check_fits_machine(num_params: int, name: str, *, world: int) -> None:
    """Refuse (one line) a model whose training state cannot fit this machine: every local process builds the
    whole model in float32 (4 bytes a parameter), and the stages' gradients and AdamW moments add 12 more."""
    need = num_params * (4 * world + _TRAIN_BYTES_PER_PARAM - 4)
    from evenpipe.commands.limits import available_memory_bytes
    have = available_memory_bytes()
    if need > have:
        raise ConfigError(f"model {name} has {num_params / 1e9:.2f}B parameters: training it in {world} local "
                          f"process(es) needs about {need / 2**30:.1f} GiB but this machine has "
                          f"{have / 2**30:.1f} GiB available; use a smaller model (e.g. gpt-tiny, llama-mini)")


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str | None, flag: str) -> int | None:
    """``"64MiB"`` / ``"2GiB"`` / ``"200KiB"`` / ``"1e6"`` (bytes; KB, MB, GB are powers of ten) -> bytes, or
    ConfigError naming ``flag``."""
    if text is None:
        return None
    value = text.strip()
    number = value.rstrip("BbIiKkMmGg ")
    unit = value[len(number):].strip().lower()
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"{flag} {text!r} must be a size: bytes, or a number with KiB, MiB, GiB (or KB, MB, GB), "
                          "e.g. 64MiB") from None
    if not size >= 1:
        raise ConfigError(f"{flag} {text!r} must be at least 1 byte")
    return int(size)


def _source(args: argparse.Namespace) -> DataSource:
    from evenpipe.training.config import DataSource
    if args.documents:
        return DataSource.DOCUMENTS
    if args.tokens:
        return DataSource.TOKENS
    return DataSource.RANDOM if args.random_tokens else DataSource.CORPUS


def _layout(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--layout {text!r} must be comma-separated integers, e.g. 5,6,6,5") from None


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


def header(config: TrainConfig) -> str:
    """The lines ``train`` starts with: model and parameters, world, batch, micro-batches, schedule, steps."""
    sched, rt = config.schedule, config.runtime
    model = config.model.resolve()
    per_replica = config.data.global_batch // (sched.num_microbatches * rt.dp)
    from evenpipe.schedule.rank_set import rank_set_text
    schedule = sched.family.value + (" + bpipe" if sched.bpipe else "") + (
        f" + offload ({rank_set_text(sched.offload, sched.num_ranks)})" if sched.offload else "")
    return (f"train {config.model.name}: {model.num_params:,} parameters ({config.model.dtype.value}), "
            f"world {config.world_size} = pp {sched.num_ranks} x dp {rt.dp} x tp {rt.tp}"
            + (" (sequence parallel)" if rt.sequence_parallel else "") + f" ({rt.backend.value}), schedule {schedule}\n"
            f"  global batch {config.data.global_batch} sequences of {config.seq_len} tokens = "
            f"{sched.num_microbatches} micro-batches of {per_replica} sequence(s) x dp {rt.dp}; {rt.steps} step"
            + ("" if rt.steps == 1 else "s"))


def run(args: argparse.Namespace) -> int:
    config = build_config(args)  # checks the output paths first, before torch is imported
    from evenpipe.runtime.rendezvous import under_torchrun
    from evenpipe.training.launch import launch_local
    from evenpipe.training.preflight import preflight
    preflight(config)  # before any process starts
    if os.environ.get("RANK", "0") == "0":  # once: the launcher here, or rank 0 under torchrun
        print(header(config), flush=True)
    if under_torchrun():
        from evenpipe.training.worker import run_worker
        run_worker(config)
        return 0
    return launch_local(config, nproc=config.world_size)
