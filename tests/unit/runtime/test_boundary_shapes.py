"""Boundary shapes of a micro-batch length never handshaken are derived from two that were: each dimension on the
line through them (hidden states grow with the length, sequence-parallel slices at 1/tp of it), and a length
that gives a fractional dimension is refused in one line."""

from __future__ import annotations

import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.runtime.boundary_shapes import _derive


def test_each_dimension_follows_the_length() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    probes = [(8, {0: ((2, 8, 33), f32), 2: ((2, 4, 33), bf16)}),  # plain, and sliced over tp = 2
              (16, {0: ((2, 16, 33), f32), 2: ((2, 8, 33), bf16)})]
    assert _derive(probes, 40) == {0: ((2, 40, 33), f32), 2: ((2, 20, 33), bf16)}
    assert _derive(probes, 4) == {0: ((2, 4, 33), f32), 2: ((2, 2, 33), bf16)}


def test_a_length_the_model_cannot_divide_is_refused() -> None:
    probes = [(8, {1: ((1, 4, 9), torch.float32)}), (16, {1: ((1, 8, 9), torch.float32)})]
    assert _derive(probes, 6) == {1: ((1, 3, 9), torch.float32)}
    with pytest.raises(ConfigError, match="length 5 gives stage 1 an output dimension of 5/2"):
        _derive(probes, 5)
