"""Import time of the planning layers, this checkout against a baseline source tree, in alternating fresh processes.

    .venv/bin/python benchmarks/bench_imports.py --baseline /tmp/base/src [--repeat 11]

Each run is a fresh interpreter that times, in-process, one import line (interpreter start-up excluded, which
``bench_cli.py --case imports`` includes): what the ``plan`` and ``simulate`` commands load before their work, and
the simulator and planner as a library. Both trees are byte-compiled first and read from their bytecode, as an
installed package is (this environment sets ``PYTHONDONTWRITEBYTECODE``, which would time compiling instead).
The baseline is another checkout's ``src`` (``git archive <commit> src | tar -x -C /tmp/base``). Prints each
line's median milliseconds on both sides, their ratio, the spread of the ratio over the alternating pairs and
each side's best, with the 1-minute load before and after: on a busy host the figures mean little.
"""

from __future__ import annotations

import argparse
import compileall
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cli import HERE_SRC, IMPORTS  # noqa: E402

TARGETS = {
    "cli+plan+simulate": IMPORTS.removeprefix("import "),
    "cli+simulate": "evenpipe.cli, evenpipe.commands.simulate",
    "cli+plan": "evenpipe.cli, evenpipe.commands.plan",
    "sim": "evenpipe.sim",
    "plan.search": "evenpipe.plan.search",
}


def import_ms(src: str, modules: str) -> float:
    """Milliseconds a fresh interpreter with ``src`` first on its path takes to import ``modules``."""
    env = dict(os.environ, PYTHONPATH=src)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    code = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return 1e3 * float(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--baseline", required=True, metavar="SRC", help="the baseline checkout's src directory")
    ap.add_argument("--repeat", type=int, default=11, help="processes per side and line (default 11)")
    ap.add_argument("--only", action="append", choices=sorted(TARGETS), help="time only this line (repeatable)")
    args = ap.parse_args()
    if args.repeat < 1 or not (pathlib.Path(args.baseline) / "evenpipe").is_dir():
        print(f"bench_imports: --repeat must be >= 1 (got {args.repeat}) and --baseline a src directory holding "
              f"evenpipe/ (got {args.baseline!r})", file=sys.stderr)
        sys.exit(2)
    for src in (args.baseline, HERE_SRC):
        compileall.compile_dir(src, quiet=1)
    print(f"baseline {args.baseline}, new {HERE_SRC}; {args.repeat} processes a side, alternating; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'line':20s} {'baseline':>9s} {'new':>9s} {'new/base':>9s} {'pairs min-max':>14s} "
          f"{'best (base / new)':>20s}")
    for name in args.only or list(TARGETS):
        base, new = [], []
        for _ in range(args.repeat):
            base.append(import_ms(args.baseline, TARGETS[name]))
            new.append(import_ms(HERE_SRC, TARGETS[name]))
        mb, mn = statistics.median(base), statistics.median(new)
        pairs = [n / b for b, n in zip(base, new)]
        print(f"{name:20s} {mb:6.1f} ms {mn:6.1f} ms {mn / mb:9.2f} {min(pairs):7.2f}-{max(pairs):.2f} "
              f"{min(base):9.1f} / {min(new):.1f} ms")
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
