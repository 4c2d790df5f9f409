"""What a checkpoint's run was trained with, so that a resume cannot silently change the data order or the
optimisation.

A checkpoint stores the weights, AdamW's state and the step (:mod:`evenpipe.training.checkpoint`), but not the
options that decide which tokens the next step sees and how AdamW moves: the global batch, the data seed, the
data itself, the held-out split, the sequence length, the model, and the optimizer and learning-rate options.
Resumed with another value of any of these, a run trains on a different stream or a different optimisation than
the one it continues, and its losses part from the uninterrupted run's. So the loop records those options in each
checkpoint's manifest (under ``world["run"]``, written last with the rest of the manifest), and the launcher
compares the newest complete checkpoint's record with its own options before any process starts, refusing a
difference in one line naming the option. A checkpoint without a record (saved before records existed) is not
checked.

What may change at a resume: the schedule, pipeline and data-parallel degrees, micro-batch count and size (with
the same global batch), layout, dtype, outputs, evaluation period (not whether there is a held-out split), and
``--steps`` (except under a cosine schedule whose end is ``--steps`` itself, where the learning rate would jump:
give ``--decay-steps`` to keep it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from evenpipe.errors import ConfigError
from evenpipe.training.checkpoint_manifest import read_manifest, size_problem, step_directories
from evenpipe.training.config import LrSchedule, TrainConfig

__all__ = ["RUN_KEY", "run_fingerprint", "check_resume_matches"]

RUN_KEY = "run"
"""Key of the record in a checkpoint manifest's ``world``."""


def run_fingerprint(config: TrainConfig) -> dict[str, Any]:
    """The options a resume must keep, by the command-line option that sets each (JSON values)."""
    data, opt = config.data, config.optimizer
    lr_end = opt.decay_steps if opt.decay_steps is not None else config.runtime.steps
    source = data.source.value + (f" {data.path}" if data.path else "")
    return {
        "--model/--hf-config": config.model.name,
        "--seq-len": config.seq_len,
        "--global-batch": data.global_batch,
        "--seed": data.seed,
        "--corpus/--tokens/--random-tokens/--documents": source,
        "--token-dtype": data.token_dtype,
        "--microbatching": data.microbatching,
        "--tokenizer": data.tokenizer,
        "--split-long-documents": data.split_long_documents,
        "--eval-every": "a held-out split" if data.eval_every is not None else "no held-out split",
        "--lr": opt.lr,
        "--lr-schedule": opt.schedule.value,
        "--warmup-steps": opt.warmup_steps,
        "--min-lr": opt.min_lr,
        "--decay-steps (or --steps, which ends a cosine without it)":
            lr_end if opt.schedule is LrSchedule.COSINE else None,
        "--weight-decay": opt.weight_decay,
        "AdamW betas": list(opt.betas),
        "AdamW eps": opt.eps,
        "--clip-grad-norm": opt.clip_grad_norm,
    }


def _newest_record(directory: str) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint whose manifest is there and whose files have their sizes (the cheap half of what
    resume checks), and its record; None when there is none or it has no record."""
    for name in step_directories(directory):
        path = os.path.join(directory, name)
        manifest, _ = read_manifest(path)
        if manifest is not None and size_problem(path, manifest) is None:
            record = manifest.world.get(RUN_KEY)
            return (name, record) if isinstance(record, dict) else None
    return None


def check_resume_matches(config: TrainConfig) -> None:
    """Refuse (ConfigError, one line) a resume whose options differ from those its checkpoint was trained with."""
    ck = config.checkpoint
    found = _newest_record(ck.directory) if ck.resume and ck.directory else None
    if found is None:
        return
    name, saved = found
    mine = json.loads(json.dumps(run_fingerprint(config)))  # the JSON forms (tuples as lists)
    for option, value in mine.items():
        if option in saved and saved[option] != value:
            raise ConfigError(f"--resume: {option} is {_show(value)} but {name} was trained with "
                              f"{_show(saved[option])}, which decides the data order or the optimisation; resume "
                              "with its value, or start a new run in another --checkpoint-dir")


def _show(value: Any) -> str:
    return "none" if value is None else str(value)
