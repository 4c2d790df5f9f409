"""Every top-k candidate `plan` prints runs as printed (issues 31 and 33): a check, not a timing.

    .venv/bin/python benchmarks/plan_commands_run.py [--model gpt-tiny] [--gpus 8] [--global-batch 16] [--top 10]
        [--steps 3] [--extra "--memory-gib 0.001"] [--json]

Runs ``evenpipe plan ... --top K --json``, then each candidate's printed launch command (torchrun on this machine,
``--steps`` appended so each run is short), and reports per candidate its configuration, notes, exit code and
first/last loss. Exit 0 when every command trained and no candidate carried a note. Too slow for ``make test``
(eight processes per candidate on this host); ``tests/distributed/test_plan_command_runs.py`` runs the best one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--gpu", default="a100-80gb")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--extra", default="", help="more plan options, one string")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    bindir = str(pathlib.Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + env.get("PATH", ""))
    plan_argv = [sys.executable, "-m", "evenpipe", "plan", "--model", a.model, "--gpu", a.gpu, "--gpus", str(a.gpus),
                 "--global-batch", str(a.global_batch), "--top", str(a.top), "--json", *shlex.split(a.extra)]
    plan = subprocess.run(plan_argv, env=env, capture_output=True, text=True, timeout=300)
    if plan.returncode != 0:
        print(plan.stderr.strip(), file=sys.stderr)
        return plan.returncode
    results = []
    for i, cand in enumerate(json.loads(plan.stdout)["candidates"], 1):
        command = cand["launch"]["command"] + f" --steps {a.steps}"
        run = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=a.timeout)
        losses = [float(x) for x in re.findall(r"^step\s+\d+/\d+\s+loss (\S+)", run.stdout, re.M)]
        results.append({"rank": i, "command": command, "notes": cand["launch"]["notes"], "returncode": run.returncode,
                        "losses": losses, "error": "" if run.returncode == 0 else run.stderr.strip()[-400:]})
        r = results[-1]
        loss = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no loss"
        print(f"{i:2d} rc={run.returncode} {loss} notes={len(r['notes'])}: {command.split(' train ', 1)[-1]}",
              file=sys.stderr if a.json else sys.stdout, flush=True)
        if run.returncode:
            print("   " + r["error"].replace("\n", "\n   "), file=sys.stderr)
    ok = all(r["returncode"] == 0 and len(r["losses"]) == a.steps and not r["notes"] for r in results)
    if a.json:
        print(json.dumps({"ok": ok, "candidates": results}, indent=1))
    else:
        print(f"{sum(r['returncode'] == 0 for r in results)}/{len(results)} ran; "
              f"{sum(bool(r['notes']) for r in results)} with notes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
