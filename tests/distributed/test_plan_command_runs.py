"""Planner to runtime (issue 13): ``evenpipe plan`` for a small model on 8 processes prints a launch command, and
that command, run as printed (torchrun on this machine), trains."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def test_planned_command_runs_as_printed() -> None:
    bindir = str(pathlib.Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + env.get("PATH", ""))
    plan = subprocess.run([sys.executable, "-m", "evenpipe", "plan", "--model", "gpt-tiny", "--gpu", "a100-80gb",
                           "--gpus", "8", "--global-batch", "16", "--top", "1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("run the best"))
    command = lines[at + 1].strip()
    assert command.startswith("torchrun --nproc-per-node=8 --standalone -m evenpipe train "), command
    for option in ("--tp", "--stages", "--dp", "--sharding", "--schedule", "--chunks", "--microbatches",
                   "--microbatch-size", "--layout"):
        assert f" {option} " in command, (option, command)
    run = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step\s+\d+/\d+\s+loss (\S+)", run.stdout, re.M)]
    assert len(losses) == 20 and losses[-1] < losses[0], run.stdout[-2000:]
