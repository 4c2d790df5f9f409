"""Whole-process CLI timings, this checkout against a baseline source tree, alternating runs in one session.

Each run is a fresh ``python -m evenpipe ...`` process (imports, building, validating, simulating, printing all
count). The baseline is another checkout's ``src`` directory put first on ``PYTHONPATH`` (for example
``git archive <commit> src | tar -x -C /tmp/base``); both sides must print the same output, which for ``plan``
means the same top-k (the planner's own search time is left out of the comparison). The 1-minute load average
is printed beside every run, and the child's CPU seconds beside its wall time (the better guide on a busy machine).

Run: ``.venv/bin/python benchmarks/bench_cli.py --baseline /tmp/base/src [--repeat 3] [--case simulate|plan|explain]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "simulate": ["simulate", "--schedule", "1f1b", "--stages", "64", "--microbatches", "1024", "--json"],
    "plan": ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch", "1536"],
    "explain": ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch", "1536",
                "--explain", "bpipe"],
}


def _run(args: list[str], src: str | None) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds of the child, 1-minute load before it, its output without timings)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "evenpipe", *args], check=True, capture_output=True, text=True,
                         env=env).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, load, _TIMING.sub("in _ s", out)


_TIMING = re.compile(r"in [0-9.]+ s")
"""The planner prints its own search time; outputs are compared without it."""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", default=None, metavar="SRC", help="baseline src directory (omit: this one only)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    args = parser.parse_args()
    for case in args.case or sorted(CASES):
        cmd = CASES[case]
        print(f"evenpipe {' '.join(cmd)}")
        sides = {"new": None} if args.baseline is None else {"baseline": args.baseline, "new": None}
        walls: dict[str, list[float]] = {k: [] for k in sides}
        cpus: dict[str, list[float]] = {k: [] for k in sides}
        outputs: dict[str, str] = {}
        for i in range(args.repeat):
            for name, src in sides.items():
                wall, cpu, load, out = _run(cmd, src)
                walls[name].append(wall)
                cpus[name].append(cpu)
                if name in outputs and outputs[name] != out:
                    print(f"  warning: {name} printed something else on run {i + 1}")
                outputs.setdefault(name, out)
                print(f"  run {i + 1} {name:<8} {wall:6.2f} s wall, {cpu:6.2f} s CPU  (load {load:.2f})")
        for name, w in walls.items():
            print(f"  {name:<8} best {min(w):.2f} s wall ({min(cpus[name]):.2f} s CPU), median "
                  f"{statistics.median(w):.2f} s wall ({statistics.median(cpus[name]):.2f} s CPU)")
        if args.baseline is not None:
            same = outputs["baseline"] == outputs["new"]
            print(f"  baseline/new: best {min(walls['baseline']) / min(walls['new']):.2f}x wall, "
                  f"{min(cpus['baseline']) / min(cpus['new']):.2f}x CPU; median "
                  f"{statistics.median(walls['baseline']) / statistics.median(walls['new']):.2f}x wall; "
                  f"same output: {same}")

if __name__ == "__main__":
    main()
