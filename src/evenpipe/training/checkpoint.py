"""Checkpoints that survive any change of schedule, pipeline degree, stage layout and data parallelism.

Saved with torch.distributed.checkpoint (DCP) as one flat dictionary of tensors whose keys do not depend on how
the model is cut:

- ``model/<canonical name>``: every parameter, under its name in the whole model (see
  :mod:`evenpipe.training.params`); replicas and stages that hold the same parameter save it once (DCP dedupes);
- ``optim/<canonical name>/<exp_avg | exp_avg_sq | step>``: AdamW's state, flattened per parameter, so stages
  never collide and a rank of any later layout finds the state of the parameters it holds;
- ``trainer/step``, ``trainer/samples``: steps done and sequences consumed (the data position; the learning-rate
  schedule is a function of the step);
- ``rng/cpu/rank<R>`` (and ``rng/cuda/rank<R>``): each rank's RNG state, restored when the world has the same ranks.

A save is atomic: every rank writes into ``<dir>/.tmp-step_<N>``, then global rank 0 renames it to
``<dir>/step_<N>`` and points ``<dir>/latest`` at it (write a temporary file, then ``os.replace``). A job killed
during a save leaves a ``.tmp-`` directory, which the next save removes, and ``latest`` still names the previous
checkpoint. The directory must be shared by all ranks (one file system for all nodes).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from evenpipe.errors import ConfigError
from evenpipe.training.params import RankParameters

__all__ = ["TrainState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_name"]

log = logging.getLogger("evenpipe.train")

LATEST = "latest"
"""File in the checkpoint directory naming the newest complete checkpoint."""
_TMP = ".tmp-"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainState:
    """Where a job stands between steps."""

    step: int
    """Optimizer steps done."""
    samples: int
    """Training sequences consumed (the data position)."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` steps."""
    return f"step_{step:08d}"


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest complete checkpoint in ``directory`` (by the ``latest`` file), or None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return None
    path = os.path.join(directory, name)
    return path if os.path.exists(os.path.join(path, ".metadata")) else None


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state of ``p``, created (zeros, step 0) when it does not exist yet, so a load has a target."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _rng_keys() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    out = {f"rng/cpu/rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/cuda/rank{rank}"] = torch.cuda.get_rng_state()
    return out


def _state_dict(params: RankParameters, optimizer: torch.optim.Optimizer, state: TrainState) -> dict[str, Any]:
    sd: dict[str, Any] = {f"model/{name}": p.detach() for name, p in params.named.items()}
    for name, p in params.named.items():
        adam = _adam_state(optimizer, p)
        for key in _ADAM_KEYS:
            sd[f"optim/{name}/{key}"] = adam[key]
    sd["trainer/step"] = torch.tensor(state.step, dtype=torch.int64)
    sd["trainer/samples"] = torch.tensor(state.samples, dtype=torch.int64)
    return sd


def save_checkpoint(directory: str, *, params: RankParameters, optimizer: torch.optim.Optimizer,
                    state: TrainState, keep: int) -> str:
    """Save this rank's part of the job (collective over the world); the checkpoint's path. Keeps the newest
    ``keep`` checkpoints."""
    name = checkpoint_name(state.step)
    final, tmp = os.path.join(directory, name), os.path.join(directory, _TMP + name)
    me = dist.get_rank()
    if me == 0:
        os.makedirs(directory, exist_ok=True)
        for entry in os.listdir(directory):  # leftovers of saves that were killed
            if entry.startswith(_TMP):
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    dist.barrier()
    sd = {**_state_dict(params, optimizer, state), **_rng_keys()}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp))
    dist.barrier()
    if me == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _point_latest(directory, name)
        _prune(directory, keep)
    dist.barrier()
    return final


def _point_latest(directory: str, name: str) -> None:
    tmp = os.path.join(directory, f"{_TMP}{LATEST}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))


def _prune(directory: str, keep: int) -> None:
    done = sorted(e for e in os.listdir(directory) if e.startswith("step_"))
    for old in done[:-keep]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def load_checkpoint(path: str, *, params: RankParameters, optimizer: torch.optim.Optimizer) -> TrainState:
    """Load the parameters and AdamW state this rank holds, whatever layout saved them (collective)."""
    reader = dcp.FileSystemReader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    sd = _state_dict(params, optimizer, TrainState(step=0, samples=0))
    missing = sorted(k for k in sd if k.startswith("model/") and k not in saved)
    if missing:
        raise ConfigError(f"checkpoint {path} has no parameter {missing[0][6:]!r} ({len(missing)} missing); it was "
                          "saved from a different model")
    sd = {k: v for k, v in sd.items() if k in saved}
    rng = {k: v.clone() for k, v in _rng_keys().items() if k in saved}
    dcp.load({**sd, **rng}, storage_reader=reader)
    with torch.no_grad():
        for name, p in params.named.items():
            p.copy_(sd[f"model/{name}"])  # p.detach() shares storage, so this is a no-op unless on another device
    if rng.keys() == _rng_keys().keys():
        for key, value in rng.items():
            torch.set_rng_state(value) if key.startswith("rng/cpu") else torch.cuda.set_rng_state(value)
    elif dist.get_rank() == 0:
        log.warning("the checkpoint's ranks differ from this job's: random-number state not restored")
    return TrainState(step=int(sd["trainer/step"]), samples=int(sd["trainer/samples"]))
