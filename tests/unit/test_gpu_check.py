"""``benchmarks/gpu_check.sh --device cpu``: the GPU check's dry run (profile, train 1F1B and BPipe with
``--predict``, print the table) works end to end; the numbers are not judged here."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_cpu(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PY=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "pred step" in out and "worst |error|" in out
    table, split = out.split("worst |error|", 1)  # the prediction table, then where each step went
    rows = [line.split()[0] for line in table.splitlines() if line.startswith(("1f1b ", "bpipe "))]
    assert rows == ["1f1b", "bpipe"]
    assert [line.split()[0] for line in split.splitlines() if line.startswith(("1f1b ", "bpipe "))] == rows
    assert (tmp_path / "profile.json").exists() and (tmp_path / "bpipe_b2_trace.evenpipe.json").exists()
