"""The launcher's own end ends the job: SIGTERM or SIGKILL to the launcher alone, or a Ctrl-C (SIGINT to the
launcher's process group, as a terminal sends it), during a real training run (gpt-tiny, 2 processes) leaves no
worker running 5 s later, at most one line on stderr (none after SIGKILL: the workers leave quietly) and no
``evenpipe-train-*`` directory behind. The job runs with TMPDIR in the test's directory, so its workers are found
by their command lines (which name the job's directory there)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.distributed

GONE_WITHIN_S = 5.0


def _workers(marker: str) -> list[int]:
    """Pids of live (not zombie) worker processes whose command line contains ``marker``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if "evenpipe.training.worker" in cmd and marker in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def _start(tmp_path: pathlib.Path) -> tuple[subprocess.Popen[str], pathlib.Path]:
    metrics = tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "evenpipe", "train", "--model", "gpt-tiny", "--seq-len", "16", "--stages", "2",
           "--microbatches", "2", "--steps", "1000000", "--random-tokens", "--metrics", str(metrics)]
    # as from a terminal: SIGINT at its default (pytest-xdist's workers ignore it, and an ignored SIGINT is inherited
    # and, by design, left ignored by the launcher)
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return launcher, metrics


def _wait_for_steps(launcher: subprocess.Popen[str], metrics: pathlib.Path, steps: int) -> None:
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
        assert time.monotonic() < deadline, f"the job did not reach step {steps} within 180 s"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_the_job_ends_with_its_launcher(tmp_path: pathlib.Path, sig: signal.Signals) -> None:
    launcher, metrics = _start(tmp_path)
    try:
        _wait_for_steps(launcher, metrics, 3)
        workers = _workers(str(tmp_path))
        assert len(workers) == 2, workers
        if sig is signal.SIGINT:
            os.killpg(launcher.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            os.kill(launcher.pid, sig)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _workers(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _workers(str(tmp_path))
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _workers(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"workers {left} outlived the launcher by {GONE_WITHIN_S} s"
    lines = err.splitlines()
    assert "Traceback" not in err, err
    if sig is signal.SIGKILL:
        assert lines == [], err
        assert launcher.returncode == -signal.SIGKILL
    else:
        assert len(lines) == 1, err
        assert lines[0].startswith(f"evenpipe train: stopped by {sig.name}"), lines[0]
        assert launcher.returncode == 128 + sig
    deadline = time.monotonic() + GONE_WITHIN_S  # orphaned workers remove the directory as they leave
    while list(tmp_path.glob("evenpipe-train-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp_path.glob("evenpipe-train-*")) == []
