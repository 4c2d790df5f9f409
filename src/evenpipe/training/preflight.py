"""Checks of a training job that need more than its options' own ranges, run once by the launcher before any worker
starts, so that a job that cannot train says so in one line instead of two tracebacks from inside the workers
(or minutes of silence):

- a Hugging Face ``model_type`` the cost model reads but the runtime cannot cut into stages (e.g. gpt_neox);
- a ``--seq-len`` beyond the model's positions (a preset's context, or a config's ``max_position_embeddings``);
- a token file holding an id outside the model's vocabulary (the whole file is scanned, in blocks);
- a resume that would change the data order or the optimisation (:mod:`evenpipe.training.run_record`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evenpipe.errors import ConfigError
from evenpipe.training.config import DataSource, TrainConfig
from evenpipe.training.run_record import check_resume_matches

__all__ = ["preflight", "check_trainable_model", "check_token_ids"]

_SCAN_BLOCK = 1 << 24
"""Tokens read at a time when scanning a token file."""


def preflight(config: TrainConfig) -> None:
    """Every check above (ConfigError, one line)."""
    check_trainable_model(config)
    if config.data.source is DataSource.TOKENS:
        check_token_ids(config.token_batches(config.model.resolve().vocab).token_file, config.model.name)
    check_resume_matches(config)


def check_trainable_model(config: TrainConfig) -> None:
    """The runtime can build the model, at this sequence length."""
    model = config.model
    if model.hf_config is not None:
        from evenpipe.cost.specs import hf_model_type
        from evenpipe.models.hf import HF_SPLITS
        kind = hf_model_type(model.hf_config)
        if kind not in HF_SPLITS:
            raise ConfigError(f"Hugging Face model_type {kind!r} ({model.hf_config}) cannot be trained: the runtime "
                              f"cuts {', '.join(HF_SPLITS)} into stages (estimate and plan read {kind})")
        return
    from evenpipe.models.config import PRESETS
    preset = PRESETS[model.preset.lower()]
    positions = preset.max_positions or preset.seq_len
    if model.seq_len is not None and model.seq_len > positions:
        raise ConfigError(f"--seq-len {model.seq_len} exceeds the {positions} positions of {model.preset} (its "
                          f"context length); use --seq-len <= {positions}, or a model with more positions")


def check_token_ids(token_file: Any, model_name: str) -> None:
    """Every id in ``token_file`` (a :class:`evenpipe.runtime.token_file.TokenFile`) is below its vocabulary."""
    tokens, vocab = token_file.tokens, token_file.vocab
    if vocab > np.iinfo(tokens.dtype).max:
        return
    for start in range(0, len(tokens), _SCAN_BLOCK):
        block = np.asarray(tokens[start:start + _SCAN_BLOCK])
        if block.size and int(block.max()) >= vocab:
            at = int(np.argmax(block >= vocab))
            raise ConfigError(f"token id {int(block[at])} at position {start + at} of {token_file.path} is outside "
                              f"the vocabulary of {model_name} (ids 0..{vocab - 1}); check --tokens and "
                              "--token-dtype, or use a model with a larger vocabulary")
