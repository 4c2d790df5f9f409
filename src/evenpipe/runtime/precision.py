"""Mixed precision for training: low-precision (bf16) model weights and activations, fp32 master weights.

The optimizer steps the fp32 masters (so its state is fp32 too); before each step the model's bf16 gradients
(accumulated by autograd over the micro-batches, summed across replicas and tied copies in fp32 by the executor
and rounded to bf16 once) are copied into the masters' fp32 ``.grad``; after it, the masters are rounded into the
model's bf16 weights. Activations, pipeline messages, BPipe transfers and the stash carry the model's dtype.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch
from torch import nn

from evenpipe.errors import parse_choice

__all__ = ["TrainDtype", "MasterWeights", "MasterWeightOptimizer"]


class TrainDtype(enum.Enum):
    """Dtype of the model's weights and activations during training."""

    FLOAT32 = "float32"
    """Everything in fp32."""
    BFLOAT16 = "bfloat16"
    """bf16 weights and activations, fp32 master weights and optimizer state."""

    @classmethod
    def parse(cls, name: "str | TrainDtype") -> "TrainDtype":
        return parse_choice(cls, name, "dtype")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is TrainDtype.BFLOAT16 else torch.float32


class MasterWeights:
    """fp32 master copies of a model's low-precision parameters; hand :attr:`params` to the optimizer."""

    def __init__(self, model_params: Sequence[nn.Parameter]) -> None:
        self.model_params = list(model_params)
        self.params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        """The fp32 masters, one per model parameter."""

    def grads_to_master(self) -> None:
        """Copy the model's gradients into the masters' fp32 ``.grad`` (``None`` stays ``None``)."""
        for p, m in zip(self.model_params, self.params):
            m.grad = None if p.grad is None else p.grad.detach().float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the updated masters into the model's weights."""
        for p, m in zip(self.model_params, self.params):
            p.copy_(m)


class MasterWeightOptimizer:
    """An optimizer over fp32 masters of low-precision model parameters, stepped like the optimizer itself:
    ``step()`` copies the model's gradients into the masters, steps, and rounds the masters into the model."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], model_params: Sequence[nn.Parameter],
                 **kwargs: object) -> None:
        self.masters = MasterWeights(model_params)
        self.inner = optimizer_class(self.masters.params, **kwargs)  # type: ignore[arg-type]
        self.param_groups = self.inner.param_groups

    def step(self) -> None:
        self.masters.grads_to_master()
        self.inner.step()
        self.masters.master_to_model()

    def state_dict(self) -> dict[str, object]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.inner.load_state_dict(state)
