"""Memory by category as a runtime keeps it: each precision's and sharding mode's model-state bytes, and the
predicted peak of every category per pipeline rank (:data:`~evenpipe.cost.categories.MEMORY_CATEGORIES`).

Two runtimes' conventions, bytes per parameter (``s`` = dp when the mode shards the category, else 1):

- **evenpipe** (``evenpipe train``, read from the runtime and checked against its measurement): float32 keeps
  fp32 weights 4, fp32 gradients 4, no master copy, AdamW's two fp32 moments 8/s; bfloat16 keeps bf16 weights 2,
  bf16 gradients 2 plus the fp32 gradient of each owned master 4/s, fp32 masters 4/s and two fp32 moments 8/s.
  ``--sharding optimizer`` shards masters, their gradients and the moments (s = dp); ``--sharding full`` (FSDP)
  shards every category between steps; during a step FSDP also holds every stage's gathered weights and their
  unsharded gradients, 2·(4 or 2) bytes per parameter (the ``gathered_states`` category).
  Activations and messages are in the training dtype.
- **megatron** (the published tables the fit is measured on): bf16 weights 2, fp32 ``main_grad`` 4, fp32 masters
  4/s and moments 8/s, s = dp with the distributed optimizer (Rajbhandari et al. 2020).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from evenpipe.errors import ConfigError

from evenpipe.cost.activations import ActivationBytes
from evenpipe.cost.source import StateBytes
from evenpipe.cost.states import BYTES_GRAD, BYTES_MASTER, BYTES_OPTIMIZER, BYTES_WEIGHT

__all__ = ["Runtime", "TrainPrecision", "StateSharding", "RuntimeConventions", "scaled"]


class Runtime(enum.Enum):
    """Whose model-state conventions a prediction follows."""

    EVENPIPE = "evenpipe"
    """``evenpipe train``'s."""
    MEGATRON = "megatron"
    """Megatron-LM's mixed precision (the published tables)."""


class TrainPrecision(enum.Enum):
    """Training dtype (``train --dtype``)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def element_bytes(self) -> int:
        return 4 if self is TrainPrecision.FLOAT32 else 2


class StateSharding(enum.Enum):
    """How data-parallel replicas share the model state (``train --sharding``; the runtime's
    ``evenpipe.training.config.Sharding`` is this enum)."""

    NONE = "none"
    """Every replica holds all parameters, gradients and optimizer state; gradients are all-reduced."""
    OPTIMIZER = "optimizer"
    """Distributed optimizer: optimizer state sharded over replicas (ZeRO-1)."""
    FULL = "full"
    """FSDP2 per stage module: parameters, gradients and optimizer state sharded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConventions:
    """A runtime, its training dtype and sharding mode: how many bytes each model-state category takes."""

    runtime: Runtime = Runtime.EVENPIPE
    dtype: TrainPrecision = TrainPrecision.FLOAT32
    sharding: StateSharding = StateSharding.NONE

    def __post_init__(self) -> None:
        if self.runtime is Runtime.MEGATRON and self.sharding is StateSharding.FULL:
            raise ConfigError("--sharding full: Megatron's conventions have no fully sharded mode (none or "
                              "optimizer, its distributed optimizer); use --runtime evenpipe")

    def to_dict(self) -> dict[str, str]:
        return {"runtime": self.runtime.value, "dtype": self.dtype.value, "sharding": self.sharding.value}

    @property
    def shards_optimizer(self) -> bool:
        return self.sharding is not StateSharding.NONE

    def state_bytes(self, dp: int, *, distributed_optimizer: bool = False) -> StateBytes:
        """Bytes per parameter by category on a rank of ``dp`` replicas (``distributed_optimizer``: a
        configuration's optimizer sharding, on top of this sharding mode's)."""
        s = dp if self.shards_optimizer or distributed_optimizer else 1
        if self.runtime is Runtime.MEGATRON:
            return StateBytes(parameters=BYTES_WEIGHT, gradients=BYTES_GRAD, master=BYTES_MASTER / s,
                              optimizer=(BYTES_OPTIMIZER - BYTES_MASTER) / s)
        full = dp if self.sharding is StateSharding.FULL else 1
        gathered = 2.0 * self.dtype.element_bytes if full > 1 else 0.0  # whole weights and gradients in a step
        if self.dtype is TrainPrecision.FLOAT32:
            return StateBytes(parameters=4 / full, gradients=4 / full, master=0.0, optimizer=8 / s,
                              gathered=gathered)
        return StateBytes(parameters=2 / full, gradients=2 / full + 4 / s, master=4 / s, optimizer=8 / s,
                          gathered=gathered)


def scaled(act: ActivationBytes, k: float) -> ActivationBytes:
    """Every byte count of ``act`` times ``k`` (activations in another element size)."""
    if k == 1.0:
        return act
    return ActivationBytes(layer_full=k * act.layer_full, layer_saved=k * act.layer_saved,
                           layer_weight_grad=k * act.layer_weight_grad, embedding=k * act.embedding,
                           head=k * act.head, sent=k * act.sent, boundary=k * act.boundary)
