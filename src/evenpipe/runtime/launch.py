"""Start local training processes through torch.distributed.run, unless already running under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping

__all__ = ["under_torchrun", "launch_local", "ARGS_ENV"]

ARGS_ENV = "EVENPIPE_TRAIN_ARGS"
"""Environment variable carrying the parsed ``evenpipe train`` options (JSON) to the launched workers."""


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) already set this process's RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(options: Mapping[str, Any], *, nproc: int) -> int:
    """Run ``evenpipe.runtime.worker`` on ``nproc`` local processes (``torchrun --standalone``); its exit code."""
    env = dict(os.environ)
    env[ARGS_ENV] = json.dumps(dict(options))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "evenpipe.runtime.worker"]
    return subprocess.call(cmd, env=env)
