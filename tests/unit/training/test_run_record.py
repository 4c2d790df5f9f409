"""A resume refuses, in one line naming the option, a change that alters the data order or the optimisation
(global batch, seed, data, held-out split, learning-rate options, the cosine's end), and accepts the changes that
do not (schedule, stages, micro-batches with the same global batch, --steps with a fixed --decay-steps). The record
is read from the newest complete checkpoint's manifest."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from evenpipe.errors import ConfigError
from evenpipe.training.checkpoint_manifest import Manifest, checkpoint_name, write_manifest
from evenpipe.training.config import (CheckpointOptions, DataOptions, OptimizerOptions, RuntimeOptions,
                                      ScheduleOptions, TrainConfig)
from evenpipe.training.run_record import RUN_KEY, check_resume_matches, run_fingerprint


def _config(ckpt: pathlib.Path, *, resume: bool = True, **changes: object) -> TrainConfig:
    base = TrainConfig(
        schedule=ScheduleOptions(num_ranks=2, num_microbatches=4),
        data=DataOptions(source="random", global_batch=8, seed=1),
        optimizer=OptimizerOptions(schedule="cosine", decay_steps=8),
        checkpoint=CheckpointOptions(directory=str(ckpt), resume=resume),
        runtime=RuntimeOptions(steps=4))
    for name, value in changes.items():
        part, field = name.split("__")
        base = dataclasses.replace(base, **{part: dataclasses.replace(getattr(base, part), **{field: value})})
    return base


def saved_checkpoint(directory: pathlib.Path, config: TrainConfig, step: int, *, record: bool = True) -> None:
    """A checkpoint directory as a save of ``config`` leaves it (its manifest; no tensors)."""
    path = directory / checkpoint_name(step)
    path.mkdir(parents=True)
    world = {"world": 2, RUN_KEY: run_fingerprint(config)} if record else {"world": 2}
    write_manifest(str(path), Manifest(step=step, world=world, files=()))  # type: ignore[arg-type]


@pytest.fixture()
def saved(tmp_path: pathlib.Path) -> pathlib.Path:
    ckpt = tmp_path / "ckpt"
    saved_checkpoint(ckpt, _config(ckpt, resume=False), 4)
    return ckpt


@pytest.mark.parametrize("change,option", [
    ({"data__global_batch": 16}, "--global-batch"),
    ({"data__seed": 2}, "--seed"),
    ({"data__source": "corpus"}, "--corpus/--tokens"),
    ({"data__eval_every": 2}, "--eval-every"),
    ({"optimizer__lr": 2e-3}, "--lr"),
    ({"optimizer__weight_decay": 0.1}, "--weight-decay"),
    ({"optimizer__decay_steps": 16}, "--decay-steps"),
    ({"optimizer__clip_grad_norm": 1.0}, "--clip-grad-norm"),
])
def test_a_resume_that_changes_the_data_or_the_optimisation_is_refused(saved: pathlib.Path, change: dict,
                                                                       option: str) -> None:
    with pytest.raises(ConfigError, match=r"^--resume: " + option.replace("-", r"\-")) as e:
        check_resume_matches(_config(saved, **change))
    assert "\n" not in str(e.value) and "step_00000004" in str(e.value)


def test_changes_that_keep_the_data_and_the_optimisation_are_accepted(saved: pathlib.Path) -> None:
    check_resume_matches(_config(saved, schedule__num_microbatches=2, schedule__num_ranks=4, runtime__steps=8))
    check_resume_matches(_config(saved, resume=False, data__global_batch=16))  # not a resume: nothing to keep


def test_the_end_of_a_cosine_set_by_steps_cannot_move(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved_checkpoint(ckpt, _config(ckpt, resume=False, optimizer__decay_steps=None), 4)
    with pytest.raises(ConfigError, match="--decay-steps .* is 8 but step_00000004 was trained with 4"):
        check_resume_matches(_config(ckpt, optimizer__decay_steps=None, runtime__steps=8))


def test_the_newest_complete_checkpoint_decides(saved: pathlib.Path) -> None:
    other = _config(saved, data__global_batch=16)
    saved_checkpoint(saved, other, 6)
    check_resume_matches(other)  # step 6 was trained with a global batch of 16
    (saved / checkpoint_name(6) / "manifest.json").unlink()  # an unfinished save: step 4 decides
    with pytest.raises(ConfigError, match="--global-batch is 16 but step_00000004 was trained with 8"):
        check_resume_matches(other)


def test_a_checkpoint_without_a_record_is_not_checked(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved_checkpoint(ckpt, _config(ckpt), 4, record=False)
    check_resume_matches(_config(ckpt, data__global_batch=16))
