"""``evenpipe train`` under two torchrun agents (``--nnodes 2``, c10d rendezvous on this machine, two processes
each) runs unchanged and gives exactly the losses of one node with four processes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from harness import free_port, train_env

pytestmark = pytest.mark.distributed

ARGS = ["--model", "gpt-tiny", "--seq-len", "16", "--stages", "2", "--dp", "2", "--microbatches", "2",
        "--schedule", "1f1b", "--steps", "3", "--seed", "4", "--random-tokens", "--timeout", "60"]


def test_two_torchrun_agents_match_one_node(tmp_path: pathlib.Path) -> None:
    port, multi = free_port(), tmp_path / "multi.json"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "evenpipe",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "evenpipe", "train", *ARGS,
                                "--json-out", str(multi)],
                               env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in (0, 1)]
    try:
        outputs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for a, (out, err) in zip(agents, outputs):
        assert a.returncode == 0, out[-2000:] + err[-3000:]
    single = tmp_path / "single.json"
    one = subprocess.run([sys.executable, "-m", "evenpipe", "train", *ARGS, "--json-out", str(single)],
                         env=train_env(), capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = json.loads(multi.read_text()), json.loads(single.read_text())
    assert len(got["losses"]) == 3 and got["losses"] == want["losses"], (got["losses"], want["losses"])
