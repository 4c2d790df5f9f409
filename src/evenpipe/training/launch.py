"""Start the local worker processes of ``evenpipe train`` and supervise them, unless already under torchrun.

The launcher plays torchrun's ``--standalone`` part (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for each
worker) and adds a fault policy torchrun lacks: when one worker fails, the others get ``grace_s`` seconds to
notice and report by themselves (their waits time out or see the closed connection); then the launcher sends
SIGTERM (a worker answers by reporting what it was blocked on) and, ``kill_after_s`` later, SIGKILL -- a stopped
(SIGSTOP) process ignores SIGTERM, so without that escalation a hung rank would hold the job. stderr ends with one
line per failed rank, in rank order (see :mod:`evenpipe.training.fault`).

Rendezvous. As torchrun's agent does, the launcher itself hosts the workers' rendezvous store, on a port the
kernel picks when the store binds it (:func:`evenpipe.runtime.rendezvous.hosted_rendezvous`), and every worker,
rank 0 included, joins it as a client. No other process can take the port between its choice and its use, which it
could when rank 0 listened on a port the launcher had found free a moment before.

The launcher and the workers (:mod:`evenpipe.training.worker`) run training jobs, so they live on the training
floor; the rendezvous they share with the profiler is the runtime's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from evenpipe.runtime.rendezvous import hosted_rendezvous
from evenpipe.training.config import TrainConfig
from evenpipe.training.fault import fault_path, step_path

__all__ = ["launch_local", "FaultPolicy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultPolicy:
    """How the launcher ends a job once a worker has failed."""

    grace_s: float = 5.0
    """Seconds the other workers get to report by themselves."""
    kill_after_s: float = 3.0
    """Seconds between SIGTERM and SIGKILL."""
    poll_s: float = 0.1
    """How often the launcher looks at its workers."""


def launch_local(config: TrainConfig, *, nproc: int, policy: FaultPolicy = FaultPolicy()) -> int:
    """Run ``nproc`` workers of ``config`` on this machine; 0 when all succeed, else 1 after the fault summary.

    The config crosses to the workers once, as a JSON file removed when the job ends."""
    with tempfile.TemporaryDirectory(prefix="evenpipe-train-") as tmp:
        path, status = os.path.join(tmp, "config.json"), os.path.join(tmp, "status")
        os.mkdir(status)
        with open(path, "w") as f:
            f.write(config.to_json())
        with hosted_rendezvous(nproc) as port:
            procs = _start(path, status, nproc, port)
            try:
                codes, stopped = _supervise(procs, policy)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        if all(c == 0 for c in codes):
            return 0
        for line in _summary(codes, status, stopped=stopped):
            print(f"evenpipe train: {line}", file=sys.stderr)
        return 1


def _start(config_path: str, status_dir: str, nproc: int, port: int) -> list[subprocess.Popen[bytes]]:
    """Start the workers, joining the rendezvous store on ``port`` (see :func:`~evenpipe.runtime.rendezvous.hosted_rendezvous`)."""
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "evenpipe.training.worker", config_path,
                                       "--status-dir", status_dir], env=env))
    return procs


def _supervise(procs: list[subprocess.Popen[bytes]], policy: FaultPolicy) -> tuple[list[int], set[int]]:
    """Wait for every worker; after the first failure apply ``policy``. Exit codes (negative: killed by that
    signal) and the ranks found stopped."""
    stopped: set[int] = set()
    failed_at: float | None = None
    terminated_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None], stopped
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and terminated_at is None and now - failed_at > policy.grace_s:
            terminated_at = now
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    if _is_stopped(p.pid):
                        stopped.add(rank)
                        p.kill()
                    else:
                        p.terminate()
        if terminated_at is not None and now - terminated_at > policy.kill_after_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(policy.poll_s)


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state ``T``, e.g. by SIGSTOP); False where /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _summary(codes: list[int], status_dir: str, *, stopped: set[int]) -> list[str]:
    """One line per failed rank: its own report, or what the launcher saw (a signal, being stopped)."""
    lines = []
    for rank, code in enumerate(codes):
        if code == 0:
            continue
        report = _read(fault_path(status_dir, rank))
        if report is not None and rank not in stopped:
            lines.append(report)
            continue
        done = _read(step_path(status_dir, rank))
        step = f"step {int(done) + 1}" if done is not None else "step 1"
        if rank in stopped:
            lines.append(f"rank {rank} {step}: was stopped (SIGSTOP; it ignored SIGTERM); killed by the launcher")
        elif code < 0:
            lines.append(f"rank {rank} {step}: killed by {signal.Signals(-code).name}")
        else:
            lines.append(f"rank {rank} {step}: exited with status {code}")
    return lines


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
