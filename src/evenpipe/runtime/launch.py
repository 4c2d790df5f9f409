"""Start local training processes through torch.distributed.run, unless already running under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from evenpipe.training.config import TrainConfig

__all__ = ["under_torchrun", "launch_local"]


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) already set this process's RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(config: TrainConfig, *, nproc: int) -> int:
    """Run ``evenpipe.runtime.worker`` on ``nproc`` local processes (``torchrun --standalone``); its exit code.

    The config crosses to the workers once, as a JSON file removed when the job ends."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="evenpipe-train-") as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            f.write(config.to_json())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "evenpipe.runtime.worker", path]
        return subprocess.call(cmd, env=env)
