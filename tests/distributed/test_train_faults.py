"""A rank that dies (SIGKILL) or hangs (SIGSTOP) ends the whole job: every process gone within the timeout plus
15 s, a non-zero exit, and stderr ending with one line per failed rank naming its step and the action it was
blocked on (P=4, a short timeout). Without ``--timeout`` the timeout tightens after the first step, so a hang
ends the job within the tightened timeout (10 s floor), not the first step's 300 s."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from evenpipe.training.fault import TIMEOUT_FLOOR_S

pytestmark = pytest.mark.distributed

VICTIM = 2
SLACK_S = 15.0


def _children(pid: int) -> dict[int, int]:
    """Global rank -> pid of the launcher's worker processes."""
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
            if ranks:
                out[int(ranks[0])] = int(entry.name)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = pathlib.Path(f"/proc/{pid}/stat")
    return state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig,timeout", [(signal.SIGSTOP, 4.0), (signal.SIGKILL, 4.0), (signal.SIGSTOP, None)],
                         ids=["SIGSTOP", "SIGKILL", "SIGSTOP-auto-timeout"])
def test_a_failed_rank_ends_the_job_with_one_line_per_rank(tmp_path: pathlib.Path, sig: signal.Signals,
                                                           timeout: float | None) -> None:
    metrics = tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "evenpipe", "train", "--model", "gpt-tiny", "--seq-len", "16", "--stages", "4",
           "--microbatches", "4", "--steps", "100000", "--random-tokens", "--metrics", str(metrics),
           *(["--timeout", str(timeout)] if timeout else [])]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
            assert time.monotonic() < deadline, "the job did not reach step 3 within 120 s"
            time.sleep(0.1)
        workers = _children(launcher.pid)
        assert sorted(workers) == [0, 1, 2, 3], workers
        t0 = time.monotonic()
        os.kill(workers[VICTIM], sig)
        limit = (timeout or TIMEOUT_FLOOR_S) + SLACK_S
        _, err = launcher.communicate(timeout=limit + 30)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0
    assert elapsed <= limit, f"job took {elapsed:.1f} s to end after {sig.name}, limit {limit:.0f} s\n{err}"
    assert not [r for r, pid in workers.items() if _alive(pid)], "worker processes survived"
    lines = err.strip().splitlines()[-4:]
    assert [int(re.match(r"evenpipe train: rank (\d) step \d+: ", ln).group(1)) for ln in lines] == [0, 1, 2, 3], err
    victim = lines[VICTIM]
    assert ("SIGKILL" in victim) if sig is signal.SIGKILL else ("stopped" in victim), victim
    others = [ln for i, ln in enumerate(lines) if i != VICTIM]
    action = re.compile(r"(waited \d+ s for|posting) (SEND|RECV)_[FB] stage \d mb \d (to|from) rank \d|"
                        r"waited \d+ s for the ")
    assert all(action.search(ln) for ln in others), "\n".join(lines)
    assert "Traceback" not in err, err
