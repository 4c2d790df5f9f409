"""Saving a job's checkpoints without stalling training longer than it must.

Asynchronously (the default where torch offers ``dcp.async_save``): at a save, a step waits only for the previous
save to finish and for DCP to copy this rank's state into CPU memory; the files are written, checksummed,
renamed and pruned by a background thread, whose collectives run on a process group of their own (gloo) so they
never interleave with training's. The checkpoint is complete (has its manifest) only when that thread is done;
:meth:`CheckpointWriter.close` waits for it before the job ends. Synchronously, a step waits for all of it.
Either way :attr:`CheckpointWriter.waits` records how long each save held the step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from evenpipe.training.checkpoint import SaveJob, TrainState, state_to_save
from evenpipe.training.checkpoint_state import CheckpointTarget

__all__ = ["SaveWait", "CheckpointWriter"]

log = logging.getLogger("evenpipe.train")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveWait:
    """How long one save held training."""

    step: int
    """The checkpoint's step."""
    wait_s: float
    """Seconds the step waited (the previous save's end, then staging; or the whole save when synchronous)."""

    def to_dict(self) -> dict[str, float]:
        return {"step": self.step, "wait_s": self.wait_s}


class CheckpointWriter:
    """Writes one job's checkpoints, one at a time (collective: every rank makes the same calls)."""

    def __init__(self, *, asynchronous: bool) -> None:
        self.asynchronous = asynchronous and hasattr(dcp, "async_save")
        self.group = dist.new_group(backend="gloo") if self.asynchronous else None
        self.waits: list[SaveWait] = []
        self.final_wait_s = 0.0
        """Seconds the end of the job waited for the last save."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evenpipe-ckpt") \
            if self.asynchronous else None
        self._pending: Future[str] | None = None

    def save(self, job: SaveJob, target: CheckpointTarget, state: TrainState) -> None:
        """Start saving ``state`` (and finish it, when synchronous)."""
        t0 = time.perf_counter()
        self._finish_pending()
        job.begin()
        sd = state_to_save(target, state)
        writer = dcp.FileSystemWriter(job.tmp)
        if self._pool is None:
            dcp.save(sd, storage_writer=writer)
            job.complete()
            _saved(job.final)
        else:
            written = dcp.async_save(sd, storage_writer=writer, process_group=self.group)
            self._pending = self._pool.submit(self._complete, written, job)
        self.waits.append(SaveWait(step=state.step, wait_s=time.perf_counter() - t0))

    def _complete(self, written: Any, job: SaveJob) -> str:
        written.result()
        job.complete(self.group)
        _saved(job.final)
        return job.final

    def _finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight (its time goes to :attr:`final_wait_s`) and stop the thread."""
        t0 = time.perf_counter()
        self._finish_pending()
        self.final_wait_s = time.perf_counter() - t0
        if self._pool is not None:
            self._pool.shutdown()

    def report(self) -> dict[str, Any]:
        """The JSON form: mode, each save's wait and the final wait."""
        return {"asynchronous": self.asynchronous, "saves": [w.to_dict() for w in self.waits],
                "final_wait_s": self.final_wait_s}


def _saved(path: str) -> None:
    if dist.get_rank() == 0:
        log.info(f"saved {path}")
