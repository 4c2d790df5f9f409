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

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from evenpipe.runtime.rendezvous import hosted_rendezvous
from evenpipe.training.config import TrainConfig
from evenpipe.training.fault import fault_path, step_path
from evenpipe.training.jobdir import job_directory

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
    """Run ``nproc`` workers of ``config`` on this machine; 0 when all succeed, else 1 after the fault summary, or
    128 + the signal's number when SIGTERM, SIGINT or SIGHUP stopped the launcher (one line on stderr).

    The config crosses to the workers once, as a JSON file in the job's temporary directory, which goes when the
    job ends (see :mod:`evenpipe.training.jobdir`). The workers run in a process group of their own, so a Ctrl-C
    at the terminal reaches the launcher alone; it ends the whole group and says so once."""
    try:
        with _stop_on_signals(), job_directory() as tmp:
            return _run_job(config, nproc, policy, tmp)
    except _Stopped as stop:
        after = f" after {stop.steps_done} step(s)" if stop.steps_done is not None else ""
        print(f"evenpipe train: stopped by {stop.signal.name}{after}; all {nproc} worker process(es) ended",
              file=sys.stderr)
        return 128 + int(stop.signal)


def _run_job(config: TrainConfig, nproc: int, policy: FaultPolicy, tmp: str) -> int:
    """Start, supervise and end the workers of one job in its directory ``tmp``; the fault summary printed."""
    path, status = os.path.join(tmp, "config.json"), os.path.join(tmp, "status")
    os.mkdir(status)
    with open(path, "w") as f:
        f.write(config.to_json())
    procs: list[subprocess.Popen[bytes]] = []
    with hosted_rendezvous(nproc) as port:
        try:
            _start(path, status, nproc, port, procs)
            codes, stopped = _supervise(procs, policy)
        except _Stopped as stop:
            stop.steps_done = _steps_done(status, nproc)
            raise
        finally:
            _end_group(procs, policy)
    lines = _summary(codes, status, stopped=stopped)
    for line in lines:
        print(f"evenpipe train: {line}", file=sys.stderr)
    return 1 if lines else 0


class _Stopped(Exception):
    """The launcher received a stopping signal."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.signal = sig
        self.steps_done: int | None = None
        """Steps every worker had finished when the signal came (None: unknown, or before the first)."""


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM, SIGINT and SIGHUP into :class:`_Stopped` while the block runs (the first one; later ones are
    ignored so the clean-up is not interrupted). A signal this process ignores stays ignored (e.g. SIGINT in a
    background job); off the main thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise _Stopped(signal.Signals(signum))
    before = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    for s, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _start(config_path: str, status_dir: str, nproc: int, port: int,
           procs: list[subprocess.Popen[bytes]]) -> None:
    """Start the workers into ``procs`` (appended one by one, so a stop half-way ends those started), joining the
    rendezvous store on ``port`` (see :func:`~evenpipe.runtime.rendezvous.hosted_rendezvous`). They stay out of
    this process's group (:func:`_own_group`), and each is told to end when this process is gone."""
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "evenpipe.training.worker", config_path,
                                       "--status-dir", status_dir, "--launcher-pid", str(os.getpid())], env=env,
                                      **_own_group(procs)))


def _own_group(procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Popen options that keep a worker out of the launcher's process group: the workers' shared group, led by
    rank 0 (Python 3.11+), else a session of its own (Python 3.10 has no ``process_group``)."""
    if sys.version_info >= (3, 11):
        return {"process_group": procs[0].pid if procs else 0}
    return {"start_new_session": True}


def _end_group(procs: list[subprocess.Popen[bytes]], policy: FaultPolicy) -> None:
    """End every worker still running: SIGTERM to their group, SIGKILL ``policy.kill_after_s`` later; reap all.
    A stopping signal that arrives meanwhile does not cut this short (the ending is finished, then it is raised)."""
    try:
        _signal_until_gone(procs, policy)
    except _Stopped:
        _signal_until_gone(procs, policy)  # stopping signals are ignored from now on
        raise


def _signal_until_gone(procs: list[subprocess.Popen[bytes]], policy: FaultPolicy) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if all(p.poll() is not None for p in procs):
            return
        _signal_groups(procs, sig)
        deadline = time.monotonic() + policy.kill_after_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(policy.poll_s)
    for p in procs:
        p.wait()


def _signal_groups(procs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    """``sig`` to the process group of every worker not yet reaped (so also to what a worker started); to the
    worker alone should it share the launcher's group. A reaped worker is skipped: its pid may be another's."""
    for p in procs:
        if p.poll() is not None:
            continue
        try:
            group = os.getpgid(p.pid)
            if group == os.getpgrp():
                p.send_signal(sig)
            else:
                os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _steps_done(status_dir: str, nproc: int) -> int | None:
    """The steps every rank has finished by its heartbeat, or None before the first."""
    done = [_read(step_path(status_dir, rank)) for rank in range(nproc)]
    return min(int(d) for d in done if d is not None) if all(d is not None for d in done) else None


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
