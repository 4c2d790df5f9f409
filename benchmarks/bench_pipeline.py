"""Build + validate + simulate per action, this checkout against a baseline source tree, on bench_sim.py's rows.

Each measurement is a fresh child process (``python bench_pipeline.py --child ROW``) that builds the row's schedule
(generation, communication, validation), then simulates it once on the cost model of ``bench_sim.py`` (a first
call: the simulator has not seen the schedule), and prints its CPU seconds and a fingerprint of the trace. Runs
alternate baseline / new so both see the same machine; best of N per side. The fingerprints must agree (step
time, per-rank peaks, transfer count, and sums of every action's and transfer's times).

Run: ``.venv/bin/python benchmarks/bench_pipeline.py --baseline /tmp/base/src [--repeat 3] [--rows 0,1]``
(baseline e.g. ``git archive <commit> src | tar -x -C /tmp/base``; without ``--baseline`` only this tree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _child(row: int) -> None:
    from evenpipe.schedule import build_schedule
    from evenpipe.sim import Link, SimCosts, simulate

    family, p, m, v, link = _rows(Link)[row]
    c0 = time.process_time()
    sched = build_schedule(family, num_ranks=p, num_microbatches=m, num_chunks=v)
    c1 = time.process_time()
    costs = SimCosts.uniform(num_stages=p * v, num_chunks=v, output_bytes=1e6, link=link)
    trace = simulate(sched, costs)
    c2 = time.process_time()
    if hasattr(trace, "action_times"):
        times = [trace.action_times(r) for r in range(p)]
    else:  # a tree from before the columnar trace
        times = [([rec.start for rec in recs], [rec.end for rec in recs]) for recs in trace.actions]
    actions = sum(len(starts) for starts, _ in times)
    sums = [math.fsum(math.fsum(t[k]) for t in times) for k in (0, 1)]
    print(json.dumps({"build": c1 - c0, "sim": c2 - c1, "actions": actions, "fingerprint": [
        trace.step_time, list(trace.peak_activation_bytes), len(trace.transfers), sums,
        math.fsum(t.start + t.end + t.exposed_s for t in trace.transfers)]}))


def _rows(link_cls: type) -> list[tuple[str, int, int, int, object]]:
    return [("1f1b", 64, 1024, 1, link_cls()),
            ("1f1b", 64, 1024, 1, link_cls(latency_s=1e-5, bandwidth_bytes_per_s=1e9)),
            ("bpipe", 64, 1024, 1, link_cls()),
            ("interleaved", 16, 256, 4, link_cls()),
            ("zb-h1", 32, 512, 1, link_cls())]


def _measure(row: int, src: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(row)], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", default=None, metavar="SRC")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    names = ["1f1b 64x1024 free", "1f1b 64x1024 1GB/s", "bpipe 64x1024 free", "interleaved 16x256 v4 free",
             "zb-h1 32x512 free"]
    rows = range(len(names)) if args.rows is None else [int(x) for x in args.rows.split(",")]
    sides = {"new": SRC} if args.baseline is None else {"baseline": args.baseline, "new": SRC}
    print(f"CPU seconds, best of {args.repeat} fresh processes per side, alternating; build = generate + "
          f"communication + validate, sim = first simulate call")
    for row in rows:
        best: dict[str, dict[str, float]] = {}
        prints: dict[str, object] = {}
        loads = []
        for _ in range(args.repeat):
            for name, src in sides.items():
                loads.append(os.getloadavg()[0])
                res = _measure(row, src)
                prints.setdefault(name, res["fingerprint"])
                if prints[name] != res["fingerprint"]:
                    raise SystemExit(f"{name} printed another trace on a later run")
                total = float(res["build"]) + float(res["sim"])  # type: ignore[arg-type]
                if name not in best or total < best[name]["total"]:
                    best[name] = {"build": float(res["build"]), "sim": float(res["sim"]),  # type: ignore[arg-type]
                                  "total": total, "actions": float(res["actions"])}  # type: ignore[arg-type]
        cells = "  ".join(f"{name}: build {b['build']:.3f} + sim {b['sim']:.3f} = {b['total']:.3f} s "
                          f"({b['total'] / b['actions'] * 1e6:.2f} us/action)" for name, b in best.items())
        ratio = ""
        if "baseline" in best:
            ratio = f"  baseline/new {best['baseline']['total'] / best['new']['total']:.2f}x, same trace: " \
                    f"{prints['baseline'] == prints['new']}"
        print(f"{names[row]:<27} {int(best['new']['actions']):>7} actions  {cells}{ratio}  "
              f"(load {min(loads):.2f}-{max(loads):.2f})")


if __name__ == "__main__":
    main()
