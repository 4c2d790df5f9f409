"""How much CPU a gloo transfer takes from the computes it overlaps (issue 10: BPipe under-predicted on CPU).

Two processes, one thread each, as training runs them. Each times a small MLP's forward and backward alone, with a
receive posted and pending, and while both exchange ``N`` MiB (each sends ``N`` and receives ``N``), side by side
in one run, alternating. The simulator puts a transfer on its link only; on a CPU host gloo's threads copy the
bytes, and this prints what that costs the compute, per MiB exchanged, next to the link's own time for the same
bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_transfer_contention.py --sizes 1,4,20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20


def _compute(block: torch.nn.Module, x: torch.Tensor) -> float:
    t = time.perf_counter()
    block(x).sum().backward()
    for p in block.parameters():
        p.grad = None
    return time.perf_counter() - t


def _worker(rank: int, port: int, sizes: list[int], repeats: int, queue: "mp.Queue[object]") -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(256, 256, requires_grad=True)
    peer = 1 - rank
    for _ in range(3):
        _compute(block, x)
    rows: dict[str, list[float]] = {"alone": [], "pending receive": []}
    for n in sizes:
        rows[f"exchanging {n} MiB"] = []
        rows[f"link {n} MiB"] = []
    for _ in range(repeats):  # alternate every case within each repeat
        dist.barrier()
        rows["alone"].append(_compute(block, x))
        dist.barrier()
        buf = torch.empty(1024)
        pending = dist.irecv(buf, src=peer, tag=1)
        rows["pending receive"].append(_compute(block, x))
        dist.barrier()
        done = dist.isend(torch.ones(1024), dst=peer, tag=1)
        pending.wait()
        done.wait()
        for n in sizes:
            out, into = torch.ones(n * MIB // 4), torch.empty(n * MIB // 4)
            dist.barrier()
            works = [dist.isend(out, dst=peer, tag=2), dist.irecv(into, src=peer, tag=2)]
            rows[f"exchanging {n} MiB"].append(_compute(block, x))
            for w in works:
                w.wait()
            dist.barrier()
            t = time.perf_counter()  # the link alone: one way, rank 0 to 1, nothing computing
            if rank == 0:
                dist.send(out, dst=1, tag=3)
            else:
                dist.recv(into, src=0, tag=3)
            rows[f"link {n} MiB"].append(time.perf_counter() - t)
    queue.put((rank, {k: statistics.median(v) for k, v in rows.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,20", help="MiB each process sends (and receives) while computing")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--port", type=int, default=29613)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.port, sizes, args.repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}; median of {args.repeats} alternating repeats, ms")
    print(f"{'case':24s} {'rank 0':>8s} {'rank 1':>8s}   compute slowdown vs alone (per MiB exchanged)")
    alone = [results[r]["alone"] for r in (0, 1)]
    for case in results[0]:
        vals = [results[r][case] for r in (0, 1)]
        line = f"{case:24s} {vals[0] * 1e3:8.2f} {vals[1] * 1e3:8.2f}"
        if case.startswith("exchanging"):
            n = int(case.split()[1])
            extra = [(v - a) * 1e3 for v, a in zip(vals, alone)]
            line += f"   {extra[0]:+.2f} / {extra[1]:+.2f} ms ({extra[0] / (2 * n):+.3f} / {extra[1] / (2 * n):+.3f} ms/MiB)"
        elif case == "pending receive":
            line += f"   {(vals[0] - alone[0]) * 1e3:+.2f} / {(vals[1] - alone[1]) * 1e3:+.2f} ms"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
