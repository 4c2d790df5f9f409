"""Entry point of one launched ``evenpipe train`` worker process: ``python -m evenpipe.runtime.worker CONFIG``.

``CONFIG`` is the JSON file :func:`evenpipe.runtime.launch.launch_local` wrote from the typed
:class:`evenpipe.training.config.TrainConfig`; torchrun provides RANK, WORLD_SIZE and the rendezvous. Under a
user's own ``torchrun ... -m evenpipe train ...`` each process parses the command line instead and calls
:func:`run_worker` directly.
"""

from __future__ import annotations

import logging
import pathlib
import sys

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


def run_worker(config: TrainConfig) -> TrainSummary:
    """Train this rank's part of ``config``; the job summary (the same on every rank)."""
    import os

    from evenpipe.training.loop import train
    configure_logging(int(os.environ.get("RANK", "0")))
    summary = train(config)
    sys.stdout.flush()
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m evenpipe.runtime.worker CONFIG.json", file=sys.stderr)
        return 2
    run_worker(TrainConfig.from_json(pathlib.Path(args[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
