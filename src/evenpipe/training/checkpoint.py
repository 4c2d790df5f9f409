"""Checkpoints that survive any change of schedule, pipeline degree, stage layout, data-parallel degree,
tensor-parallel degree, sharding mode and dtype.

Saved with torch.distributed.checkpoint (DCP) as one flat dictionary of tensors whose keys do not depend on how
the model is cut or sharded:

- ``model/<canonical name>`` and ``optim/<canonical name>/<exp_avg | exp_avg_sq | step>``: the fp32 weights the
  optimizer steps and AdamW's state, under each parameter's name in the whole model, in the un-sharded layout
  (DTensor shards of tensor parallelism and FSDP are saved as shards of it; see
  :mod:`evenpipe.training.checkpoint_state`);
- ``trainer/step``, ``trainer/samples``: steps done and sequences consumed (the data position; the learning-rate
  schedule is a function of the step);
- ``rng/cpu/rank<R>`` (and ``rng/cuda/rank<R>``): each rank's RNG state, restored when the world has the same ranks.

A save is atomic and self-checking: every rank writes into ``<dir>/.tmp-step_<N>``, the ranks checksum the files,
then global rank 0 writes ``manifest.json`` (every file's size and CRC-32, the step, the saving layout; see
:mod:`evenpipe.training.checkpoint_manifest`), renames the directory to ``<dir>/step_<N>`` and points
``<dir>/latest`` at it (for people; resume does not trust it). A job killed during a save leaves a ``.tmp-``
directory, which the next save removes. Resume takes the newest ``step_<N>`` whose files agree with its manifest
and names, in one line each, the newer ones it skipped. The directory must be shared by all ranks.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import collective
from evenpipe.training.checkpoint_manifest import (FileEntry, Manifest, checkpoint_name, checksum_problem,
                                                   file_entry, prune_plan, read_manifest, size_problem,
                                                   step_directories, write_manifest)
from evenpipe.training.checkpoint_state import CheckpointTarget, load_plan, missing_weights, save_entries

__all__ = ["TrainState", "SaveJob", "state_to_save", "save_checkpoint", "load_checkpoint",
           "newest_complete_checkpoint", "checkpoint_name"]

log = logging.getLogger("evenpipe.train")

LATEST = "latest"
"""File in the checkpoint directory naming the newest checkpoint saved (informative only)."""
_TMP = ".tmp-"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainState:
    """Where a job stands between steps."""

    step: int
    """Optimizer steps done."""
    samples: int
    """Training sequences consumed (the data position)."""


def _rng_keys() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    out = {f"rng/cpu/rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/cuda/rank{rank}"] = torch.cuda.get_rng_state()
    return out


def _trainer_keys(state: TrainState) -> dict[str, torch.Tensor]:
    return {"trainer/step": torch.tensor(state.step, dtype=torch.int64),
            "trainer/samples": torch.tensor(state.samples, dtype=torch.int64)}


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveJob:
    """One save's bookkeeping around DCP's write: the directories, then the manifest, rename and pruning."""

    directory: str
    """The checkpoint directory."""
    step: int
    """Steps done (names the checkpoint)."""
    keep: int
    """Checkpoints no newer than this one to keep."""
    world: dict[str, Any]
    """The saving job's layout, recorded in the manifest."""
    replaced: tuple[str, ...] = ()
    """An earlier run's checkpoints this job overwrites: deleted once this save is complete."""

    @property
    def final(self) -> str:
        return os.path.join(self.directory, checkpoint_name(self.step))

    @property
    def tmp(self) -> str:
        return os.path.join(self.directory, _TMP + checkpoint_name(self.step))

    def begin(self) -> None:
        """Rank 0 creates the directory and removes what killed saves left; then every rank may write."""
        if dist.get_rank() == 0:
            os.makedirs(self.directory, exist_ok=True)
            for entry in os.listdir(self.directory):
                if entry.startswith(_TMP):
                    shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)
        with collective("the checkpoint's opening barrier"):
            dist.barrier()

    def complete(self, group: Any = None) -> None:
        """After every rank's DCP write: checksum the files between the ranks, then rank 0 writes the manifest
        (last), renames the directory, points ``latest`` at it and prunes (collective over ``group``)."""
        with collective("the barrier after the checkpoint's writes"):
            dist.barrier(group)
        entries = _gather_entries(self.tmp, group)
        if dist.get_rank() == 0:
            write_manifest(self.tmp, Manifest(step=self.step, world=self.world, files=entries))
            if os.path.exists(self.final):  # a damaged or overwritten checkpoint of the same step
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            name = checkpoint_name(self.step)
            _point_latest(self.directory, name)
            for old in prune_plan(step_directories(self.directory), saved=name, keep=self.keep,
                                  replaced=self.replaced):
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        with collective("the barrier after the checkpoint's manifest"):
            dist.barrier(group)


def state_to_save(target: CheckpointTarget, state: TrainState) -> dict[str, torch.Tensor]:
    """Everything this rank writes (collective for tensor parallelism's reordered rows)."""
    return {**save_entries(target), **_trainer_keys(state), **_rng_keys()}


def save_checkpoint(directory: str, *, target: CheckpointTarget, state: TrainState, keep: int,
                    world: dict[str, Any] | None = None, replaced: Sequence[str] = ()) -> str:
    """Save this rank's part of the job (collective over the world); the checkpoint's path.

    Every rank writes its DCP files into ``.tmp-step_<N>``; then :meth:`SaveJob.complete`: of the checkpoints
    no newer than this one rank 0 keeps the newest ``keep``, and it deletes ``replaced`` (an earlier run's
    checkpoints this job was told to overwrite). ``world`` describes the saving job's layout."""
    job = SaveJob(directory=directory, step=state.step, keep=keep,
                  world=dict(world or {"world": dist.get_world_size()}), replaced=tuple(replaced))
    job.begin()
    dcp.save(state_to_save(target, state), storage_writer=dcp.FileSystemWriter(job.tmp))
    job.complete()
    return job.final


def _gather_entries(path: str, group: Any = None) -> tuple[FileEntry, ...]:
    """Sizes and checksums of every file under ``path``, each rank reading its share; on rank 0 (else ())."""
    names = sorted(os.path.relpath(os.path.join(root, f), path) for root, _, files in os.walk(path) for f in files)
    me, world = dist.get_rank(), dist.get_world_size()
    mine = [file_entry(path, n) for n in names[me::world]]
    gathered: list[Any] = [None] * world if me == 0 else []
    with collective("the gather of the checkpoint's checksums", 0):
        dist.gather_object(mine, gathered if me == 0 else None, dst=0, group=group)
    return tuple(sorted((e for part in gathered for e in part), key=lambda e: e.name)) if me == 0 else ()


def _point_latest(directory: str, name: str) -> None:
    tmp = os.path.join(directory, f"{_TMP}{LATEST}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))


def newest_complete_checkpoint(directory: str) -> str | None:
    """Path of the newest complete checkpoint in ``directory`` (collective), or None; ``latest`` is not read.

    Rank 0 walks the ``step_<N>`` directories from the newest, skipping (with one warning line each) those
    without a manifest or whose files have the wrong sizes; every rank then checksums its share of the
    candidate's files, and a mismatch anywhere moves on to the next older one."""
    me, world = dist.get_rank(), dist.get_world_size()
    names = step_directories(directory) if me == 0 else []
    while True:
        payload: list[Any] = [_next_candidate(directory, names) if me == 0 else None]
        with collective("the broadcast of the checkpoint to resume from", 0):
            dist.broadcast_object_list(payload, src=0)
        if payload[0] is None:
            return None
        path, manifest = payload[0]
        problems: list[Any] = [None] * world
        mine = checksum_problem(path, manifest.files[me::world])
        with collective("the all-gather of the checkpoint's checksum results"):
            dist.all_gather_object(problems, mine)
        bad = [p for p in problems if p]
        if not bad:
            return str(path)
        if me == 0:
            log.warning(f"skipping damaged checkpoint {path}: {bad[0]}")


def _next_candidate(directory: str, names: list[str]) -> tuple[str, Manifest] | None:
    """Pop ``names`` (newest first) until one has a manifest and the files' sizes agree with it."""
    while names:
        path = os.path.join(directory, names.pop(0))
        manifest, why = read_manifest(path)
        problem = why if manifest is None else size_problem(path, manifest)
        if problem is None and manifest is not None:
            return path, manifest
        log.warning(f"skipping {'incomplete' if manifest is None else 'damaged'} checkpoint {path}: {problem}")
    return None


def load_checkpoint(path: str, *, target: CheckpointTarget) -> TrainState:
    """Load the weights and AdamW state this rank holds, whatever layout, mode or dtype saved them (collective)."""
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    missing = missing_weights(target, saved)
    if missing:
        raise ConfigError(f"checkpoint {path} has no parameter {missing[0]!r} ({len(missing)} missing); it was "
                          "saved from a different model")
    plan = load_plan(target)
    sd = {k: v for k, v in plan.state_dict.items() if k in saved}
    trainer = _trainer_keys(TrainState(step=0, samples=0))
    rng = {k: v.clone() for k, v in _rng_keys().items() if k in saved}
    dcp.load({**sd, **trainer, **rng}, storage_reader=reader)
    plan.finish()
    if rng.keys() == _rng_keys().keys():
        for key, value in rng.items():
            torch.set_rng_state(value) if key.startswith("rng/cpu") else torch.cuda.set_rng_state(value)
    elif dist.get_rank() == 0:
        log.warning("the checkpoint's ranks differ from this job's: random-number state not restored")
    return TrainState(step=int(trainer["trainer/step"]), samples=int(trainer["trainer/samples"]))
