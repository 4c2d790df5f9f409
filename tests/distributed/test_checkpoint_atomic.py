"""A job killed with SIGKILL in the middle of writing a checkpoint leaves the previous one loadable: ``latest``
still names it, the resumed job continues from it with the killed job's own losses, and the partial save is
cleaned up by the next one."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import pytest

from harness import free_port, train_env

pytestmark = pytest.mark.distributed

HERE = pathlib.Path(__file__).parent
ARGS = ["--model", "gpt-tiny", "--seq-len", "16", "--stages", "1", "--microbatches", "2", "--random-tokens",
        "--seed", "2", "--steps", "4", "--timeout", "60"]


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    killed = subprocess.run([sys.executable, str(HERE / "kill_mid_save.py"), str(free_port()), *ARGS,
                             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics", str(metrics)],
                            env=train_env(), capture_output=True, text=True, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    partial = ckpt / ".tmp-step_00000004"
    assert partial.is_dir() and any(partial.iterdir()) and not (partial / ".metadata").exists()
    assert not (ckpt / "step_00000004").exists()
    before = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(before) == 4

    out = tmp_path / "resumed.json"
    resumed = subprocess.run([sys.executable, "-m", "evenpipe", "train", *ARGS, "--checkpoint-dir", str(ckpt),
                              "--resume", "--json-out", str(out)], env=train_env(), capture_output=True, text=True,
                             timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["first_step"] == 2 and summary["losses"] == before[2:]
    assert (ckpt / "latest").read_text().strip() == "step_00000004" and not partial.exists()
