"""A job killed with SIGKILL in the middle of writing a checkpoint leaves the previous one loadable: ``latest``
still names it, the resumed job continues from it with the killed job's own losses, says so in one line, and the
partial save is cleaned up by the next one. A checkpoint with one truncated file is named and skipped the same
way, and nothing a complete save wrote is lost."""

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

    summary, said = _resume(ckpt, tmp_path / "resumed.json")
    assert said == [f"resuming from {ckpt / 'step_00000002'} (step 2)"]
    assert summary["first_step"] == 2 and summary["losses"] == before[2:]
    assert (ckpt / "latest").read_text().strip() == "step_00000004" and not partial.exists()
    waits = summary["checkpoints"]
    assert waits["asynchronous"] and [s["step"] for s in waits["saves"]] == [4]
    assert all(s["wait_s"] >= 0 for s in waits["saves"]) and waits["final_wait_s"] >= 0

    shard = sorted((ckpt / "step_00000004").glob("*.distcp"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    (ckpt / "latest").unlink()
    summary, said = _resume(ckpt, tmp_path / "again.json")
    assert said == [f"skipping damaged checkpoint {ckpt / 'step_00000004'}: {shard.name} has {size - 100} bytes "
                    f"where the manifest says {size}",
                    f"resuming from {ckpt / 'step_00000002'} (step 2)"]
    assert summary["first_step"] == 2 and summary["losses"] == before[2:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def _resume(ckpt: pathlib.Path, out: pathlib.Path) -> tuple[dict, list[str]]:
    """Resume ARGS from ``ckpt``; the summary and the lines that say which checkpoint (or why not)."""
    run = subprocess.run([sys.executable, "-m", "evenpipe", "train", *ARGS, "--checkpoint-dir", str(ckpt),
                          "--resume", "--json-out", str(out)], env=train_env(), capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in (run.stdout + run.stderr).splitlines() if "checkpoint" in line or "resuming" in line]
    return json.loads(out.read_text()), [line for line in said if not line.startswith("saved ")]


def _train(ckpt: pathlib.Path, out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evenpipe", "train", *ARGS, "--checkpoint-dir", str(ckpt),
                           "--json-out", str(out), *extra], env=train_env(), capture_output=True, text=True,
                          timeout=180)


def test_a_fresh_run_never_loses_another_runs_checkpoints(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = _train(ckpt, tmp_path / "first.json", "--checkpoint-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    steps = sorted(p.name for p in ckpt.glob("step_*"))
    assert steps == ["step_00000002", "step_00000004"]
    refused = _train(ckpt, tmp_path / "refused.json", "--steps", "2")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--overwrite-checkpoints" in refused.stderr and "--resume" in refused.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == steps and not (tmp_path / "refused.json").exists()
    longer = _train(ckpt, tmp_path / "longer.json", "--resume", "--steps", "6", "--keep-checkpoints", "3")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("step_*")) == [*steps, "step_00000006"]
    fresh = _train(ckpt, tmp_path / "fresh.json", "--overwrite-checkpoints", "--steps", "2")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002"]
    summary = json.loads((tmp_path / "fresh.json").read_text())
    assert summary["first_step"] == 0
    assert summary["losses"] == json.loads((tmp_path / "first.json").read_text())["losses"][:2]
