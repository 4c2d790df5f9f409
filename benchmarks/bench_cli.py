"""Whole-process CLI timings, this checkout against a baseline source tree, alternating runs in one session.

Each run is a fresh ``python -m evenpipe ...`` process (imports, building, validating, simulating, printing all
count). The baseline is another checkout's ``src`` directory put first on ``PYTHONPATH`` (for example
``git archive <commit> src | tar -x -C /tmp/base``); both sides must print the same output, which for ``plan``
means the same top-k (the planner's own search time is left out of the comparison). The 1-minute load average
is printed beside every run, and the child's CPU seconds beside its wall time (the better guide on a busy machine).
The ``imports`` case times a process that only imports the planning commands (``plan`` and ``simulate``).

Both trees are byte-compiled first and the runs read the bytecode (``--bytecode cached``, the default), as an
installed package does: this environment sets ``PYTHONDONTWRITEBYTECODE``, under which every process compiles each
module from source, a cost that grows with the code's size and that no user pays; ``--bytecode none`` keeps that.
The new side is this checkout's ``src``, put first on ``PYTHONPATH`` like the baseline's.

Run: ``.venv/bin/python benchmarks/bench_cli.py --baseline /tmp/base/src [--repeat 3]
[--case simulate|plan|explain|explain-memory|imports] [--new-args "--runtime megatron"]``.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import time

HERE_SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")
IMPORTS = "import evenpipe.cli, evenpipe.commands.plan, evenpipe.commands.simulate"
CASES = {
    "imports": ["-c", IMPORTS],
    "simulate": ["simulate", "--schedule", "1f1b", "--stages", "64", "--microbatches", "1024", "--json"],
    "plan": ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch", "1536"],
    "explain": ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch", "1536",
                "--explain", "bpipe"],
    "explain-memory": ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--global-batch",
                       "1536", "--explain", "memory"],
}


def _run(args: list[str], src: str, *, bytecode: bool) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds of the child, 1-minute load before it, its output without timings)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    command = args if args[0] == "-c" else ["-m", "evenpipe", *args]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *command], check=True, capture_output=True, text=True,
                         env=env).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, load, _TIMING.sub("in _ s", out)


_TIMING = re.compile(r"in [0-9.]+ s")
"""The planner prints its own search time; outputs are compared without it."""


def _same_output(baseline: str, new: str) -> str:
    """"True" or "False"; JSON objects are compared on the keys both have, and keys only one has are named."""
    if baseline == new:
        return "True"
    try:
        a, b = json.loads(baseline), json.loads(new)
    except ValueError:
        return "False"
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return "False"
    shared = all(a[k] == b[k] for k in a.keys() & b.keys())
    added = sorted(b.keys() - a.keys())
    removed = sorted(a.keys() - b.keys())
    return f"{shared} on shared keys (new adds {added}, drops {removed})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", default=None, metavar="SRC", help="baseline src directory (omit: this one only)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--new-args", default="", metavar="ARGS",
                        help="options added to the new side's plan commands only, for a baseline that lacks them "
                             "(e.g. \"--runtime megatron\" to run the baseline's very search)")
    parser.add_argument("--bytecode", choices=("cached", "none"), default="cached",
                        help="cached: byte-compile both trees first and read the bytecode (default); none: compile "
                             "every module from source in every run")
    args = parser.parse_args()
    if args.baseline is not None and not os.path.isdir(os.path.join(args.baseline, "evenpipe")):
        parser.error(f"--baseline {args.baseline!r} holds no evenpipe package; give a src directory")
    bytecode = args.bytecode == "cached"
    extra = args.new_args.split()
    sides = {"new": HERE_SRC} if args.baseline is None else {"baseline": args.baseline, "new": HERE_SRC}
    if bytecode:
        for src in sides.values():
            compileall.compile_dir(src, quiet=1)
    print(f"bytecode: {args.bytecode}; load {os.getloadavg()[0]:.2f}")
    for case in args.case or sorted(CASES):
        cmd = CASES[case]
        print(f"python {' '.join(cmd)}" if cmd[0] == "-c" else f"evenpipe {' '.join(cmd)}")
        walls: dict[str, list[float]] = {k: [] for k in sides}
        cpus: dict[str, list[float]] = {k: [] for k in sides}
        outputs: dict[str, str] = {}
        for i in range(args.repeat):
            for name, src in sides.items():
                side_cmd = cmd + extra if name == "new" and cmd[0] == "plan" else cmd
                wall, cpu, load, out = _run(side_cmd, src, bytecode=bytecode)
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
            same = _same_output(outputs["baseline"], outputs["new"])
            print(f"  baseline/new: best {min(walls['baseline']) / min(walls['new']):.2f}x wall, "
                  f"{min(cpus['baseline']) / min(cpus['new']):.2f}x CPU; median "
                  f"{statistics.median(walls['baseline']) / statistics.median(walls['new']):.2f}x wall; "
                  f"same output: {same}")

if __name__ == "__main__":
    main()
