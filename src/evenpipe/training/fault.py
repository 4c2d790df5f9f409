"""Fault diagnosis of one rank: a watchdog that names the schedule action a rank is blocked on.

The executor's waits go through :func:`evenpipe.runtime.comm.wait_all`, which tells an observer (this module's
:class:`Watchdog`) when a wait on a named transfer (``RECV_B stage 2 mb 5``, peer rank 4) begins and ends. A
daemon thread checks the rank's *progress*: when no wait has ended and no step boundary has passed for
``timeout_s`` seconds, the rank is hung (a peer stopped, or a collective never completed). The watchdog then
writes one line -- ``rank 3 step 4: waited 20 s for RECV_B stage 2 mb 5 from rank 4`` -- and ends the process with
``os._exit`` (a thread blocked inside a C++ wait cannot be interrupted, and a stopped peer never answers).

The same line is written when a wait fails because the peer died (the transport reports a closed connection),
and when the launcher (ours, or torchrun's agent) sends SIGTERM: SIGTERM is blocked in every thread but one,
which waits for it, so the rank can report even while its main thread sits inside a wait.

Lines go to ``status_dir/rank<R>.fault`` for the launcher to print at the end of the job, or straight to stderr
when there is no status directory (under a user's own torchrun). ``status_dir/rank<R>.step`` holds the number
of steps the rank has finished (a heartbeat, so the launcher can say when a rank that died silently was lost).

A rank started by ``evenpipe train``'s own launcher does not outlive it: when the launcher is gone (killed, so
its workers were re-parented), the watchdog removes the job's temporary directory and ends the rank quietly
(see :class:`evenpipe.training.jobdir.LauncherLink`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from evenpipe.training.jobdir import LauncherLink

__all__ = ["FaultReport", "Watchdog", "FAULT_EXIT_CODE", "fault_path", "step_path", "timeout_after_step",
           "short_reason"]

FAULT_EXIT_CODE = 3
"""Exit status of a rank that diagnosed a fault (a peer died or hung, or it was told to stop)."""

TIMEOUT_STEP_MULTIPLE = 10.0
"""Without ``--timeout``, a wait may last this many times the slowest step seen so far..."""
TIMEOUT_FLOOR_S = 10.0
"""... but never less than this (start-up noise, garbage collection, a loaded machine)."""

_POLL_S = 0.2


def fault_path(status_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its fault line."""
    return os.path.join(status_dir, f"rank{rank}.fault")


def step_path(status_dir: str, rank: int) -> str:
    """Where rank ``rank`` records how many steps it has finished."""
    return os.path.join(status_dir, f"rank{rank}.step")


def timeout_after_step(slowest_step_s: float) -> float:
    """The tightened wait timeout once a step has been measured (see the constants above)."""
    return max(TIMEOUT_FLOOR_S, TIMEOUT_STEP_MULTIPLE * slowest_step_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultReport:
    """What one rank says about its failure."""

    rank: int
    """Global rank."""
    step: int
    """The step it was in (1-based; 0 before the first step)."""
    cause: str
    """What it was doing, e.g. ``waited 20 s for RECV_B stage 2 mb 5 from rank 4``."""

    def line(self) -> str:
        return f"rank {self.rank} step {self.step}: {self.cause}"


class Watchdog:
    """Per-rank progress watchdog and wait observer (see the module docstring)."""

    def __init__(self, *, rank: int, timeout_s: float, status_dir: str | None,
                 launcher: LauncherLink | None = None) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        """Longest a rank may go without progress; the loop may tighten it after the first step."""
        self.status_dir = status_dir
        self.step = 0
        """The step being run (1-based), set by the training loop."""
        self.phase = "starting"
        """What the rank is doing outside transfer waits (``running the pipeline``, ``saving a checkpoint``...)."""
        self.watched = False
        """Whether the phase itself is bounded by the timeout (the pipeline step is; start-up, checkpoints and
        the final summary are bounded by the process groups' own timeouts instead)."""
        self._wait: tuple[str, int, float] | None = None  # (what, peer, since)
        self._last_wait = ""
        self._progress = time.monotonic()
        self._lock = threading.Lock()
        self._failed = False
        self._launcher = launcher
        """The launcher this rank must not outlive (None under a user's own torchrun)."""

    # -- wait observer (called by evenpipe.runtime.comm.wait_all) ------------------------------------------
    def begin_wait(self, what: str, peer: int) -> None:
        self._wait = (what, peer, time.monotonic())

    def end_wait(self) -> None:
        if self._wait is not None:  # a collective has no one peer (-1)
            what, peer, _ = self._wait
            self._last_wait = f"{what} (rank {peer})" if peer >= 0 else what
        self._wait = None
        self._progress = time.monotonic()

    def describe_failure(self, error: BaseException) -> str:
        """The cause of a failed transfer or collective: the pending wait and the transport's reason."""
        if self._wait is not None:
            return f"{self.describe()} ({short_reason(error)})"
        posting = getattr(error, "posting", "")
        if posting:  # a send to a peer that is gone fails as it is posted, before any wait
            return f"posting {posting} failed ({short_reason(error)})"
        return short_reason(error)

    # -- the training loop -------------------------------------------------------------------------------------
    def progress(self, phase: str | None = None, *, watched: bool | None = None) -> None:
        """Mark progress (a step boundary); ``phase`` names what comes next, ``watched`` whether the phase as a
        whole must progress within the timeout (a pending transfer wait always must)."""
        if phase is not None:
            self.phase = phase
        if watched is not None:
            self.watched = watched
        self._progress = time.monotonic()

    def finished_step(self, steps_done: int) -> None:
        """Heartbeat after a finished step (written for the launcher)."""
        self.progress()
        if self.status_dir is not None:
            try:
                _write_atomic(step_path(self.status_dir, self.rank), str(steps_done))
            except OSError:  # the launcher is ending the job and removed the directory
                pass

    def start(self) -> None:
        """Start the watchdog and SIGTERM threads; call before creating process groups, so that every later
        thread inherits the blocked SIGTERM."""
        signal.pthread_sigmask(signal.SIG_BLOCK, self._stop_signals())
        threading.Thread(target=self._watch, name="evenpipe-watchdog", daemon=True).start()
        threading.Thread(target=self._on_stop_signal, name="evenpipe-sigterm", daemon=True).start()

    # -- reporting -----------------------------------------------------------------------------------------
    def describe(self) -> str:
        """What the rank is blocked on, in one clause."""
        now = time.monotonic()
        wait = self._wait
        if wait is not None:
            what, peer, since = wait
            direction = "to" if what.startswith("SEND") else "from"
            source = f" {direction} rank {peer}" if peer >= 0 else ""
            return f"waited {now - since:.0f} s for {what}{source}"
        after = f" after {self._last_wait}" if self._last_wait else ""
        return f"no progress for {now - self._progress:.0f} s while {self.phase}{after} (in a collective)"

    def fail(self, cause: str) -> NoReturn:
        """Report ``cause`` once and end the process (quietly when the launcher is gone)."""
        self._leave_if_orphaned()
        with self._lock:
            if not self._failed:
                self._failed = True
                try:
                    self._emit(FaultReport(rank=self.rank, step=self.step, cause=cause).line())
                except OSError:  # the status directory is gone (the launcher removed it): end all the same
                    pass
        os._exit(FAULT_EXIT_CODE)

    def _emit(self, line: str) -> None:
        if self.status_dir is not None:
            _write_atomic(fault_path(self.status_dir, self.rank), line)
        else:
            print(f"evenpipe train: {line}", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while True:
            time.sleep(_POLL_S)
            self._leave_if_orphaned()
            now, wait = time.monotonic(), self._wait
            if wait is not None and now - wait[2] > self.timeout_s:
                self.fail(self.describe())
            if wait is None and self.watched and now - self._progress > self.timeout_s:
                self.fail(self.describe())

    def _on_stop_signal(self) -> None:
        info = signal.sigwaitinfo(self._stop_signals())
        if self._launcher is not None and info.si_signo == self._launcher.ORPHAN_SIGNAL:
            self._launcher.abandon()  # the kernel's word that the launcher died (it may not have re-parented us yet)
        self._leave_if_orphaned()
        self.fail(f"stopped by SIGTERM; {self.describe()}")


    def _stop_signals(self) -> set[signal.Signals]:
        """SIGTERM, and the signal the kernel sends when the launcher dies (when there is one)."""
        return {signal.SIGTERM} | ({self._launcher.ORPHAN_SIGNAL} if self._launcher is not None else set())

    def _leave_if_orphaned(self) -> None:
        """End quietly, removing the job's directory, when the launcher has gone (killed, or stopped by a signal
        it could not pass on): nobody is left to read a fault line."""
        if self._launcher is not None and self._launcher.gone():
            self._launcher.abandon()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


_REASONS = (("Connection closed", "the peer closed the connection"),
            ("Connection reset", "the peer closed the connection"),
            ("Broken pipe", "the peer closed the connection"),
            ("Timed out", "timed out"), ("timed out", "timed out"))


def short_reason(e: BaseException, *, limit: int = 160) -> str:
    """A transport error in a few words (a closed connection, a timeout), else its first line, shortened."""
    text = str(e).strip()
    for needle, reason in _REASONS:
        if needle in text:
            return reason
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= limit else first[:limit - 3] + "..."
