"""Memory probes and a tiny local process launcher shared by the runtime benchmarks (not part of the package).

Three measures, taken the same way whatever runs the pipeline:

- **saved bytes**: what autograd saves for backward, through :class:`SavedBytes`, an ``ActivationStash`` whose
  ``hold``/``release`` are no-ops, so only saved tensors count (deduped by storage, parameters excluded, counted
  down when autograd frees them). evenpipe's executor takes it as its stash; for another runtime, wrap the stage
  module (and the loss) in :func:`captured` so every forward runs inside ``capture``.
- **heap**: bytes malloc has handed out and not taken back (glibc ``mallinfo2``: ``uordblks + hblkhd``, every
  arena), sampled by :class:`HeapSampler` after every submodule forward and whenever a submodule output's
  gradient is computed. A step's heap peak minus the heap after the model was built (before the runtime was
  created) covers everything the runtime allocates and keeps at once: saved tensors, stage outputs it keeps,
  receive buffers (including ones it keeps between steps), transfers still in flight, gradients.
- **peak RSS**: ``getrusage`` high-water mark of the process (whole run, warm-up included).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import queue
import resource
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from evenpipe.runtime.stash import ActivationStash

__all__ = ["Captured", "HeapSampler", "SavedBytes", "heap_bytes", "peak_rss_bytes", "run_local_world",
           "answers_or_exit"]


class SavedBytes(ActivationStash):
    """Counts only tensors autograd saves (no executor holds): the same measure for every runtime."""

    def hold(self, key: tuple[int, int], tensor: torch.Tensor) -> None:
        return None

    def release(self, key: tuple[int, int], tensor: torch.Tensor) -> None:
        return None


class Captured(nn.Module):
    """``inner`` with every call run inside ``saved.capture((tag, n))``, n counting calls."""

    def __init__(self, inner: nn.Module, saved: SavedBytes, tag: int) -> None:
        super().__init__()
        self.inner = inner
        self.saved = saved
        self.tag = tag
        self.calls = 0

    def forward(self, *args: Any) -> Any:
        key = (self.tag, self.calls)
        self.calls += 1
        with self.saved.capture(key):
            return self.inner(*args)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> Callable[[], int]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return lambda: 0
    fn.restype = _MallInfo2

    def heap() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)
    return heap


heap_bytes = _mallinfo()
"""Bytes in use from malloc now (0 where glibc's ``mallinfo2`` is missing)."""


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HeapSampler:
    """Heap peak over a window: ``start()``, run, ``peak_above_start()``; samples come from module hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.base = 0
        self.peak = 0
        for sub in module.modules():
            sub.register_forward_hook(self._after_forward)

    def sample(self) -> None:
        self.peak = max(self.peak, heap_bytes())

    def _after_forward(self, _mod: nn.Module, _args: Any, out: Any) -> None:
        self.sample()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.sample()

    def set_base(self) -> None:
        """Take the heap now as the zero line (e.g. after building the model, before any step)."""
        self.base = self.peak = heap_bytes()

    def start(self) -> None:
        """Start a new peak window (the base stays)."""
        self.peak = heap_bytes()

    def peak_above_base(self) -> int:
        self.sample()
        return self.peak - self.base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any,
           timeout_s: float) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result: Any = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001  (report anything, never hang silently)
        result = {"error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"}
    out.put((rank, result))
    out.close()
    out.join_thread()


def run_local_world(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo processes; each rank's return value, by rank.

    A rank that raised, or did not answer within ``timeout_s``, gives ``{"error": ...}``; stragglers are killed.
    """
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out, timeout_s), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, res = out.get(timeout=min(left, 5.0))
                results[rank] = res
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results.get(r, {"error": f"rank {r}: no answer within {timeout_s:.0f} s"}) for r in range(world)]


def answers_or_exit(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 3600.0) -> list[Any]:
    """:func:`run_local_world`, exiting with every rank's error instead when any rank failed."""
    ranks = run_local_world(world, fn, *args, timeout_s=timeout_s)
    errors = [r["error"] for r in ranks if isinstance(r, dict) and "error" in r]
    if errors:
        raise SystemExit("\n".join(errors))
    return ranks
