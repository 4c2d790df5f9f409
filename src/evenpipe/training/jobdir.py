"""The temporary directory of one local ``evenpipe train`` job, and the tie between its workers and launcher.

The launcher writes the job's config and its workers' status files into ``<tmp>/evenpipe-train-XXXX``, with an
``owner`` file naming the launcher's pid and start time. The directory goes when the job ends, when the launcher is
stopped by SIGTERM, SIGINT or SIGHUP, and, when the launcher is killed outright (SIGKILL), when its workers notice
they are orphaned (:class:`LauncherLink`) or when the next launch finds it stale (:func:`remove_stale_job_dirs`).

This module imports nothing heavy: a worker ties itself to its launcher before it imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from typing import Iterator, NoReturn

__all__ = ["JOB_DIR_PREFIX", "job_directory", "remove_stale_job_dirs", "LauncherLink", "ORPHAN_EXIT_CODE"]

JOB_DIR_PREFIX = "evenpipe-train-"
"""Name prefix of a job's temporary directory."""
_OWNER = "owner"
ORPHAN_EXIT_CODE = 4
"""Exit status of a worker that ended because its launcher was gone."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(pid: int, start: str | None) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a reused pid does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start


def remove_stale_job_dirs(parent: str | None = None) -> list[str]:
    """Remove the job directories under ``parent`` (default: the temporary directory) whose launcher is dead;
    the paths removed. A directory without an owner file is left alone (it may be being created)."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(parent, name)
        if not name.startswith(JOB_DIR_PREFIX):
            continue
        try:
            with open(os.path.join(path, _OWNER)) as f:
                fields = f.read().split()
            pid, start = int(fields[0]), (fields[1] if len(fields) > 1 else None)
        except (OSError, ValueError, IndexError):
            continue
        if not _owner_alive(pid, start):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def job_directory() -> Iterator[str]:
    """A fresh job directory owned by this process while the block runs (stale ones are removed first)."""
    remove_stale_job_dirs()
    path = tempfile.mkdtemp(prefix=JOB_DIR_PREFIX)
    try:
        with open(os.path.join(path, _OWNER), "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid()) or ''}\n")
        yield path
    finally:
        try:
            shutil.rmtree(path, ignore_errors=True)
        except BaseException:  # a signal's exception cut the removal short: finish it, then let it through
            shutil.rmtree(path, ignore_errors=True)
            raise


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherLink:
    """A worker's tie to the launcher that started it: the worker ends when the launcher is gone."""

    pid: int
    """The launcher's pid (the worker's parent)."""
    job_dir: str | None = None
    """The job's temporary directory, removed by an orphaned worker."""

    ORPHAN_SIGNAL = signal.SIGUSR2
    """What the kernel sends a worker when its launcher dies (PR_SET_PDEATHSIG). Not SIGTERM, which the launcher
    itself sends to end its workers: the signal comes as the launcher's threads exit, before this process may see
    its new parent, so it must say by itself that the launcher is gone."""

    def bind(self) -> None:
        """Ask the kernel for :attr:`ORPHAN_SIGNAL` when the parent dies (Linux; elsewhere the watchdog's polling
        remains), then leave at once if the launcher already died before that request."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(self.ORPHAN_SIGNAL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if self.gone():
            self.abandon()

    def gone(self) -> bool:
        """Whether the launcher has exited (this process was re-parented)."""
        return os.getppid() != self.pid

    def abandon(self) -> NoReturn:
        """Remove the job directory and end this process quietly (the launcher's user has gone)."""
        if self.job_dir is not None and os.path.basename(self.job_dir).startswith(JOB_DIR_PREFIX):
            shutil.rmtree(self.job_dir, ignore_errors=True)
        os._exit(ORPHAN_EXIT_CODE)
