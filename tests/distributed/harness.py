"""Start one gloo world of N local processes, run a function on every rank, collect what each rank reports.

Each rank returns a list of strings: failures, and proofs that a check ran (``RAN`` lines, see :func:`ran`).
A check passes only when its proof is there and no failure names it, so a check that never ran fails. The
parent waits with a deadline and kills any process still running, so a hang fails the test instead of
blocking CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from evenpipe.runtime.rendezvous import hosted_rendezvous

RankFn = Callable[[int, int], list[str]]

RAN = "ran: "
"""Prefix of a proof line: ``ran(label)`` is reported by a rank that completed the check ``label``."""


def ran(label: str) -> str:
    """The proof line for check ``label`` on this rank."""
    return f"{RAN}{label}"


def failures_only(lines: list[str]) -> list[str]:
    """The failure lines (proofs dropped)."""
    return [f for f in lines if not f.startswith(RAN)]


def missing_runs(lines: list[str], label: str, expected: int) -> list[str]:
    """A failure when fewer than ``expected`` ranks proved that they ran ``label``."""
    got = sum(1 for f in lines if f == ran(label) or f.startswith(ran(label) + " rank "))
    return [] if got >= expected else [f"{label}: only {got} of {expected} ranks reported that it ran"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: RankFn, out: Any, pg_timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        failures = fn(rank, world)
    except BaseException as e:  # report, never hang silently
        failures = [f"rank {rank} raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"]
    out.put((rank, failures))
    out.close()
    out.join_thread()
    if dist.is_initialized() and not failures_only(failures):
        dist.destroy_process_group()


def run_world(world: int, fn: RankFn, *, timeout_s: float = 240.0, pg_timeout_s: float = 60.0) -> dict[int, list[str]]:
    """Run ``fn(rank, world)`` on ``world`` spawned processes; returns each rank's failures. Their rendezvous
    store is hosted by this process, as ``evenpipe train``'s launcher hosts its workers'."""
    with hosted_rendezvous(world) as port:
        return _run_world(world, fn, port, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)


def _run_world(world: int, fn: RankFn, port: int, *, timeout_s: float, pg_timeout_s: float) -> dict[int, list[str]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, out, pg_timeout_s), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, list[str]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, failures = out.get(timeout=min(left, 5.0))
                results[rank] = failures
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(world):
        results.setdefault(r, [f"rank {r} reported nothing within {timeout_s:.0f} s (hang or crash)"])
    return results


def train_env() -> dict[str, str]:
    """This process's environment without torchrun's variables (so ``evenpipe train`` launches its own world)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_train(args: list[str], json_out: Any, *, timeout_s: float = 240.0) -> tuple[dict, str]:
    """Run ``python -m evenpipe train ARGS --json-out JSON_OUT``; its summary and stdout (asserts success)."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "evenpipe", "train", *args, "--json-out", str(json_out)],
                          env=train_env(), capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(json_out) as f:
        return json.load(f), proc.stdout
