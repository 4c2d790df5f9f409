"""The cost source: everything a plan needs to know about a model on its devices, in one protocol.

A :class:`CostSource` answers per pipeline rank and per micro-batch shape: the times of one layer (forward,
input gradient, weight gradient, recompute), the bytes one layer saves, keeps under recomputation and sends, the
model-state bytes per parameter by category (parameters, gradients, master weights, optimizer state), the
optimizer step and the data-parallel gradient reduction, and the link between any two pipeline ranks. The
estimate (:func:`evenpipe.cost.estimate.estimate_with`), the memory count (:func:`evenpipe.cost.memory.stage_memory`),
the bounds and the search read costs only through it.

Two sources: :class:`~evenpipe.cost.analytic_source.AnalyticSource` (GPU presets and the fitted model) and
:class:`~evenpipe.cost.profiled_source.ProfiledSource` (a profile measured by ``evenpipe profile``). Every
method takes the ``rank`` (pipeline rank) and, where costs depend on the micro-batch, its :class:`MicrobatchShape`,
so a source per rank (mixed devices) or costs per micro-batch (variable lengths) fit these signatures. A shape of
documents of varying length carries its tokens and squared lengths (:mod:`evenpipe.cost.shape`); a configuration
with ``microbatch_shapes`` is priced per (stage, micro-batch) by :mod:`evenpipe.cost.microbatch_costs`, one padded
shape otherwise (the fast path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from evenpipe.sim.costs import Link, SimCosts

from evenpipe.cost.activations import ActivationBytes
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.parallel import ParallelConfig
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import LayerTimes

__all__ = ["CostSource", "MicrobatchShape", "StateBytes", "ParamCounts", "Holding", "shape_of"]


def shape_of(model: ModelSpec, cfg: ParallelConfig) -> MicrobatchShape:
    """The one micro-batch shape of a configuration (every micro-batch alike)."""
    return MicrobatchShape(size=cfg.microbatch_size, seq_len=model.seq_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Model-state bytes per parameter, by category."""

    parameters: float
    """The weights the forward reads (bf16 under Megatron's mixed precision)."""
    gradients: float
    """The gradient buffers (fp32 ``main_grad`` under Megatron)."""
    master: float
    """Master copies of the weights (fp32 under mixed precision; 0 when the optimizer updates the weights)."""
    optimizer: float
    """Optimizer state (Adam's two moments), after any sharding over data parallelism."""
    gathered: float = 0.0
    """FSDP's whole weights and gradients during a step, besides the shards (not part of :attr:`total`, which
    counts what is held between steps)."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.master + self.optimizer


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamCounts:
    """Parameters held by one tensor-parallel rank."""

    per_layer: float
    """One transformer layer's."""
    embedding: float
    """The embedding's (first stage)."""
    head: float
    """The output layer's (last stage)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """What one pipeline rank holds of the model."""

    layers: int
    """Transformer layers (over all its stages)."""
    embedding: bool = False
    """Whether it holds the embedding."""
    head: bool = False
    """Whether it holds the output layer."""

    def params(self, counts: ParamCounts) -> float:
        """Its parameters (one tensor-parallel rank's share)."""
        n = counts.per_layer * self.layers
        if self.embedding:
            n += counts.embedding
        if self.head:
            n += counts.head
        return n


class CostSource(Protocol):
    """What a plan needs to know about the model on the devices (see the module docstring)."""

    @property
    def name(self) -> str:
        """The devices in words, e.g. ``a100-80gb`` or ``cpu (profiled)``."""
        ...

    @property
    def model(self) -> ModelSpec:
        """The model (layers, sizes) the costs are of."""
        ...

    @property
    def hardware(self) -> Hardware | None:
        """The GPU preset the costs come from (None for measured costs)."""
        ...

    @property
    def uniform(self) -> bool:
        """Whether every rank answers alike (then asking rank 0 stands for all)."""
        ...

    @property
    def reduction_overlaps_backward(self) -> bool:
        """Whether a rank's data-parallel reduction overlaps the backward of its last micro-batch."""
        ...

    @property
    def step_overhead_s(self) -> float:
        """Fixed seconds per step outside the schedule and the optimizer."""
        ...

    @property
    def optimizer_waits_for_all_ranks(self) -> bool:
        """Whether every rank's optimizer step starts after the last rank's reduction (a global gradient-norm
        clip, Megatron); otherwise each rank steps after its own last action."""
        ...

    @property
    def holds_sent_output(self) -> bool:
        """Whether a stage's output stays allocated on top of its saved activations until it is sent."""
        ...

    def check(self, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
        """ConfigError (one line) when ``cfg`` cannot run on these devices."""
        ...

    def memory_budget_gib(self, rank: int) -> float | None:
        """Memory the model may use on ``rank``, GiB (None: no limit known)."""
        ...

    def peak_flops(self, rank: int) -> float | None:
        """Dense peak FLOP/s of ``rank``'s device (None: unknown, and MFU with it)."""
        ...

    def layer_times(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> LayerTimes:
        """Seconds of one transformer layer for one micro-batch of ``shape`` on ``rank``."""
        ...

    def layer_flop_rate(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> float:
        """Achieved FLOP/s of one layer's forward on ``rank`` (what a larger micro-batch buys)."""
        ...

    def layer_bytes(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> ActivationBytes:
        """Bytes one layer of ``rank`` saves, keeps and sends for one micro-batch of ``shape``."""
        ...

    def param_counts(self, cfg: ParallelConfig) -> ParamCounts:
        """Parameters of one layer, the embedding and the head on one tensor-parallel rank."""
        ...

    def state_bytes(self, cfg: ParallelConfig, rank: int) -> StateBytes:
        """Model-state bytes per parameter on ``rank``, by category."""
        ...

    def optimizer_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        """Seconds of ``rank``'s optimizer step over the parameters it holds."""
        ...

    def reduce_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        """Seconds of the data-parallel gradient reduction of the parameters ``rank`` holds."""
        ...

    def link(self, cfg: ParallelConfig, rank_a: int, rank_b: int) -> Link:
        """The link from pipeline rank ``rank_a`` to ``rank_b``."""
        ...

    def stage_costs(self, cfg: ParallelConfig, shape: MicrobatchShape) -> SimCosts:
        """Per-stage durations and bytes and the links, for the simulator (built from the layer costs)."""
        ...

    def plan_durations(self, cfg: ParallelConfig) -> tuple[int, int, int] | None:
        """Integer F, I, W durations a memory-capped family plans its order with (None for the others)."""
        ...
