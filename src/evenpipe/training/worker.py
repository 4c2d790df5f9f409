"""Entry point of one ``evenpipe train`` worker process:
``python -m evenpipe.training.worker CONFIG [--status-dir D] [--launcher-pid PID]``.

``CONFIG`` is the JSON file :func:`evenpipe.training.launch.launch_local` wrote from the typed
:class:`evenpipe.training.config.TrainConfig`; ``--status-dir`` is where this rank leaves its heartbeat and fault
line for the launcher; ``--launcher-pid`` ties the worker to its launcher (it ends, removing the job's directory,
when the launcher is gone; see :class:`evenpipe.training.jobdir.LauncherLink`), before torch is imported. Under a user's own ``torchrun ... -m evenpipe train ...`` each process parses the command
line instead and calls :func:`run_worker` directly (fault lines then go to stderr).

A failing rank does not raise through to a traceback: its watchdog writes one line naming the rank, the step
and the action it was blocked on, and the process exits with :data:`evenpipe.training.fault.FAULT_EXIT_CODE`.
Only an error raised by this rank's own code (not a failed peer) also prints its traceback, once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING

from evenpipe.training.jobdir import LauncherLink

if TYPE_CHECKING:
    from evenpipe.training.config import TrainConfig
    from evenpipe.training.summary import TrainSummary

__all__ = ["run_worker", "configure_logging", "main"]


def configure_logging(rank: int) -> None:
    """Progress on stdout from global rank 0 (message only); other ranks log warnings and errors to stderr."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("evenpipe")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False


def run_worker(config: TrainConfig, *, status_dir: str | None = None,
               launcher: LauncherLink | None = None) -> TrainSummary:
    """Train this rank's part of ``config`` under a fault watchdog; the job summary (the same on every rank).

    Never returns on failure: the watchdog reports and ends the process; nor when ``launcher`` has gone."""
    from evenpipe.runtime.comm import PeerFailure, observe_waits
    from evenpipe.training.fault import Watchdog, short_reason
    from evenpipe.training.loop import train

    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank)
    watchdog = Watchdog(rank=rank, timeout_s=config.runtime.initial_timeout_s, status_dir=status_dir,
                        launcher=launcher)
    watchdog.start()
    observe_waits(watchdog)
    try:
        summary = train(config, watchdog=watchdog)
    except PeerFailure as e:
        watchdog.fail(watchdog.describe_failure(e))
    except BaseException as e:  # this rank's own error: its traceback once, then the one-line report
        traceback.print_exc()
        sys.stderr.flush()
        watchdog.fail(f"raised {type(e).__name__}: {short_reason(e)}")
    finally:
        observe_waits(None)
    sys.stdout.flush()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evenpipe.training.worker")
    parser.add_argument("config", help="TrainConfig JSON file")
    parser.add_argument("--status-dir", default=None, help="directory for heartbeats and fault lines")
    parser.add_argument("--launcher-pid", type=int, default=None, help="end when this parent process is gone")
    args = parser.parse_args(argv)
    launcher = None
    if args.launcher_pid is not None:
        launcher = LauncherLink(pid=args.launcher_pid, job_dir=os.path.dirname(os.path.abspath(args.config)))
        launcher.bind()
    from evenpipe.training.config import TrainConfig
    with open(args.config) as f:
        config = TrainConfig.from_json(f.read())
    run_worker(config, status_dir=args.status_dir, launcher=launcher)
    return 0


if __name__ == "__main__":
    sys.exit(main())
