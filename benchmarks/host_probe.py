"""How much of two cores the host gives two busy processes right now: a line both timing benchmarks print.

On a virtual machine the load average only sees this machine's own processes; the host may still run two busy
vCPUs on one physical core (or beside another tenant) for seconds at a time, and then every process computes at
up to half speed. Measured on this repo's 2-vCPU machine: two single-thread matmul loops ran 2.0x slower each
than one alone for a whole 5-second window, and 1.0x in the next. Pipeline ranks compute concurrently, so such a
window stretches a training step while a profile taken in a steady window does not see it. This probe times a
fixed single-thread matmul block alone, then in ``processes`` concurrent copies, and reports the slowdown
(median and 90th percentile over blocks): ``1.00x`` is a steady host, ``2.00x`` a host that runs both on one core.

    .venv/bin/python benchmarks/host_probe.py            # prints one line
    .venv/bin/python benchmarks/host_probe.py --drift 360   # how the host's speed moves over 6 minutes

``--drift SECONDS`` runs ``processes`` concurrent copies of the matmul loop for that long and reports the speed of
each 5-second window (the slower copy's) over the median window, and of each minute: on a host whose speed moves
by more than a prediction's tolerance between a profile and a run, no profile can predict that run that closely.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import os
import statistics
import time
from typing import Any

__all__ = ["host_line", "concurrent_slowdown", "steal_seconds", "drift"]


def steal_seconds() -> float:
    """CPU seconds the hypervisor has taken from this VM's vCPUs since boot (``steal`` in /proc/stat; 0 where
    not reported). The difference over a run is time the run's processes were ready but not running."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def _blocks(seconds: float, out: "mp.Queue[list[float]] | None" = None) -> list[float]:
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    for _ in range(3):
        a @ b
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append(time.perf_counter() - t0)
    if out is not None:
        out.put(times)
    return times


def _in_copies(target: Any, args: tuple, copies: int) -> list[list[float]]:
    """Run ``target(*args, queue)`` in ``copies`` concurrent spawned processes; what each put on the queue."""
    ctx = mp.get_context("spawn")
    q: mp.Queue[list[float]] = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for _ in range(copies)]
    for p in procs:
        p.start()
    results: list[list[float]] = []
    while len(results) < copies:  # a copy that died must not leave the probe waiting forever
        try:
            results.append(q.get(timeout=5.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                raise SystemExit(f"host probe: {copies - len(results)} of {copies} copies exited without a result")
    for p in procs:
        p.join()
    return results


def concurrent_slowdown(seconds: float = 2.0, processes: int = 2) -> tuple[float, float]:
    """(median, 90th percentile) of a block's time with ``processes`` copies running, over its median alone."""
    base = statistics.median(_in_copies(_blocks, (seconds,), 1)[0])
    together = sorted(t for times in _in_copies(_blocks, (seconds,), processes) for t in times)
    return statistics.median(together) / base, together[int(0.9 * (len(together) - 1))] / base


def host_line(seconds: float = 2.0, processes: int = 2) -> str:
    """One line: the probe's result, for a benchmark's log."""
    med, p90 = concurrent_slowdown(seconds, processes)
    return (f"host probe: {processes} concurrent single-thread matmul loops ran {med:.2f}x (median) / {p90:.2f}x "
            f"(90th pct) the time of one alone (1.00x: steady; 2.00x: two vCPUs sharing one core)")


def _windows(seconds: float, window: float, out: "mp.Queue[list[float]]") -> None:
    """Matmul blocks per second in each ``window``-second window for ``seconds`` seconds."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    rates: list[float] = []
    start = time.perf_counter()
    edge, done = start + window, 0
    while time.perf_counter() < start + seconds:
        for _ in range(20):
            a @ b
        done += 20
        if time.perf_counter() >= edge:
            rates.append(done / window)
            edge, done = edge + window, 0
    out.put(rates)


def drift(seconds: float, processes: int = 2, window: float = 5.0) -> str:
    """Lines describing how the host's speed moved over ``seconds`` (see the module)."""
    slowest = [min(w) for w in zip(*_in_copies(_windows, (seconds, window), processes))]
    mid = statistics.median(slowest)
    rel = sorted(x / mid for x in slowest)
    n = len(rel)
    per = int(round(60 / window))
    minutes = [statistics.mean(slowest[i:i + per]) / mid for i in range(0, n - per + 1, per)]
    return "\n".join([
        f"host drift: {processes} concurrent single-thread matmul loops, {n} windows of {window:g} s; speed over "
        f"the median window: min {rel[0]:.2f}, p10 {rel[n // 10]:.2f}, p90 {rel[(9 * n) // 10]:.2f}, max {rel[-1]:.2f}",
        "one-minute means: " + " ".join(f"{x:.3f}" for x in minutes),
        f"{window:g}-s windows: " + " ".join(f"{x / mid:.2f}" for x in slowest)])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--drift", type=float, default=None, metavar="SECONDS",
                    help="report how the host's speed moves over this many seconds instead")
    args = ap.parse_args()
    print(drift(args.drift) if args.drift else host_line())
