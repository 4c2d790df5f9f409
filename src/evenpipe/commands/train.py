"""``evenpipe train``: train a reference model with a pipeline schedule over torch.distributed.

Every option is checked here, before any process starts (bad values exit 2 with one line). Without torchrun's
environment the command starts ``stages x dp`` local processes itself through ``torch.distributed.run``; under
torchrun (RANK and WORLD_SIZE set) this process is one worker.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from evenpipe.errors import ConfigError

__all__ = ["add_arguments", "run", "check_options"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help="model preset, e.g. gpt-tiny, llama-tiny, gpt-mini")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, looped-bfs, zb-h1 or bpipe")
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks P (1 runs un-pipelined)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step M")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = stages x dp)")
    p.add_argument("--chunks", type=int, default=1, help="stages per rank V (interleaved, looped-bfs)")
    p.add_argument("--microbatch-size", type=int, default=2, help="sequences per micro-batch b")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: microbatch-size x microbatches x dp)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation per stage")
    p.add_argument("--free-outputs", action=argparse.BooleanOptionalAction, default=True,
                   help="free each stage output once sent (default on)")
    p.add_argument("--bpipe-budget", type=int, default=None,
                   help="BPipe: activation units a rank may hold (default ceil((P+1)/2))")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", default=None, help="text file to train on, bytes as tokens (default: the shipped corpus)")
    src.add_argument("--random-tokens", action="store_true", help="train on uniformly random tokens")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--json-out", default=None, help="write losses, step time, memory, throughput as JSON")
    p.add_argument("--trace", default=None, help="write a measured Chrome/Perfetto trace of the last step")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                   help="torch.distributed backend (default: nccl with GPUs, else gloo)")
    p.add_argument("--layout", default=None, help="layers per stage (per virtual chunk), e.g. 5,6,6,5")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every option and return the plain dict the workers receive (ConfigError on bad input)."""
    import torch

    from evenpipe.models import model_config
    from evenpipe.runtime.stages import partition_layers
    from evenpipe.schedule import ScheduleFamily, build_schedule

    for name in ("stages", "microbatches", "steps", "dp", "chunks", "microbatch_size"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    family = ScheduleFamily.parse(args.schedule)
    cfg = model_config(args.model, **({"seq_len": args.seq_len} if args.seq_len else {}))
    pp, dp, chunks = args.stages, args.dp, args.chunks
    if pp == 1 and family is ScheduleFamily.BPIPE:
        raise ConfigError("--schedule bpipe needs --stages >= 2 (ranks exchange activations in pairs)")
    build_schedule(family, num_ranks=pp, num_microbatches=args.microbatches, num_chunks=chunks,
                   bpipe_budget=args.bpipe_budget if family is ScheduleFamily.BPIPE else None,
                   recompute=args.recompute)
    num_stages = pp * chunks
    layout = None
    if args.layout:
        try:
            layout = [int(x) for x in args.layout.split(",")]
        except ValueError:
            raise ConfigError(f"--layout {args.layout!r} must be comma-separated integers, e.g. 5,6,6,5") from None
    partition_layers(cfg.num_layers, num_stages, layout=layout)
    global_batch = args.global_batch or args.microbatch_size * args.microbatches * dp
    if global_batch % (args.microbatches * dp):
        raise ConfigError(f"--global-batch {global_batch} is not divisible by microbatches x dp = "
                          f"{args.microbatches} x {dp}")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs a CUDA GPU and none is visible; use --backend gloo")
    world = pp * dp
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"world size {os.environ['WORLD_SIZE']} != stages x dp = {pp} x {dp} = {world}")
    from evenpipe.runtime.data import TokenBatches, TokenSource
    TokenBatches(source=TokenSource.RANDOM if args.random_tokens else TokenSource.CORPUS, seq_len=cfg.seq_len,
                 vocab=cfg.vocab, seed=args.seed, path=args.corpus)  # checks the corpus and the vocabulary
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return {
        "model": args.model, "schedule": family.value, "stages": pp, "microbatches": args.microbatches,
        "steps": args.steps, "dp": dp, "chunks": chunks, "global_batch": global_batch, "seq_len": cfg.seq_len,
        "recompute": bool(args.recompute), "free_outputs": bool(args.free_outputs),
        "bpipe_budget": args.bpipe_budget, "corpus": os.path.abspath(args.corpus) if args.corpus else None,
        "random_tokens": bool(args.random_tokens), "seed": args.seed, "lr": args.lr, "json_out":
        os.path.abspath(args.json_out) if args.json_out else None, "trace": os.path.abspath(args.trace)
        if args.trace else None, "backend": backend, "layout": layout, "timeout": args.timeout,
    }


def run(args: argparse.Namespace) -> int:
    from evenpipe.runtime.launch import launch_local, under_torchrun

    options = check_options(args)
    if under_torchrun():
        from evenpipe.runtime.worker import train
        return train(options)
    return launch_local(options, nproc=options["stages"] * options["dp"])
