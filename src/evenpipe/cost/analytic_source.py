"""The analytic cost source: a GPU preset and the fitted FLOP/bandwidth model (``timing``, ``activations``),
with Megatron's model-state layout (``memory``: bf16 weights, fp32 gradients, fp32 master weights and Adam
moments, the latter two sharded by the distributed optimizer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from evenpipe.schedule.memo import Memo
from evenpipe.sim.costs import Link, SimCosts

from evenpipe.cost.activations import ActivationBytes, activation_bytes
from evenpipe.cost.flops import layer_forward_flops
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.states import (BYTES_GRAD, BYTES_MASTER, BYTES_OPTIMIZER, BYTES_WEIGHT, embedding_params_per_rank,
                                  head_params, layer_params_per_rank)
from evenpipe.cost.parallel import ParallelConfig, check_config
from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions, scaled
from evenpipe.cost.source import Holding, MicrobatchShape, ParamCounts, StateBytes
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import (Efficiency, LayerTimes, cost_plan_durations, dp_allreduce_time, layer_times,
                                  optimizer_step_time, pipeline_link, stage_sim_costs)

__all__ = ["AnalyticSource"]

_param_counts: Memo[ParamCounts] = Memo(1 << 12)
""":meth:`AnalyticSource.param_counts` by source, tp and pp."""


def _check_shape(model: ModelSpec, shape: MicrobatchShape, cfg: ParallelConfig) -> MicrobatchShape | None:
    """``shape`` when its documents vary in length, None for the configuration's padded shape (the fast path)."""
    assert shape.size == cfg.microbatch_size and shape.seq_len == model.seq_len, \
        "the analytic source takes micro-batches of the configuration's rows and row length"
    return None if shape.padded else shape


@dataclass(frozen=True, slots=True)
class AnalyticSource:
    """Costs of ``model`` on ``hw`` GPUs under the fitted ``efficiency`` (uniform over ranks)."""

    model: ModelSpec
    """The model."""
    hw: Hardware
    """Every rank's GPU."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """Achieved fractions of the hardware peaks."""
    conventions: RuntimeConventions | None = None
    """Model-state bytes (and the activations' element size) of this runtime; None: Megatron's."""
    _hash: int = field(init=False, repr=False, compare=False)
    """The hash of the fields above, taken once: the planner's memos key by the source on every look-up."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.model, self.hw, self.efficiency, self.conventions)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def name(self) -> str:
        return self.hw.name

    @property
    def hardware(self) -> Hardware | None:
        return self.hw

    @property
    def uniform(self) -> bool:
        return True

    @property
    def reduction_overlaps_backward(self) -> bool:
        return self.efficiency.dp_overlap

    @property
    def step_overhead_s(self) -> float:
        return 0.0

    @property
    def optimizer_waits_for_all_ranks(self) -> bool:
        return True

    @property
    def holds_sent_output(self) -> bool:
        return False

    def check(self, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
        check_config(self.model, self.hw, cfg, num_gpus)

    def memory_budget_gib(self, rank: int) -> float | None:
        return self.hw.usable_memory_gib

    def peak_flops(self, rank: int) -> float | None:
        return self.hw.peak_tflops * 1e12

    def layer_times(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> LayerTimes:
        return layer_times(self.model, self.hw, cfg, self.efficiency, _check_shape(self.model, shape, cfg))

    def layer_flop_rate(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> float:
        compute = self.layer_times(cfg, rank, shape).forward_compute
        flops = layer_forward_flops(self.model, tp=cfg.tp, microbatch_size=shape.size,
                                    shape=_check_shape(self.model, shape, cfg))
        return flops / compute if compute > 0 else 0.0

    def layer_bytes(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> ActivationBytes:
        act = activation_bytes(self.model, cfg, _check_shape(self.model, shape, cfg))  # 2-byte elements (Korthikanti)
        c = self.conventions
        if c is None or c.runtime is Runtime.MEGATRON:
            return act
        # evenpipe: the training dtype's elements; every tensor-parallel rank sends the whole hidden state, or its
        # 1/tp slice of the sequence under sequence parallelism
        sent = float(shape.num_tokens * self.model.hidden * c.dtype.element_bytes)
        sent /= cfg.tp if cfg.sequence_parallel else 1
        return dataclasses.replace(scaled(act, c.dtype.element_bytes / 2), sent=sent)

    def param_counts(self, cfg: ParallelConfig) -> ParamCounts:
        tp, pp = cfg.tp, cfg.pp  # all the counts depend on (the bounds ask per rank, thousands of times a search)
        return _param_counts.get((self, tp, pp), lambda: self._param_counts(tp, pp))

    def _param_counts(self, tp: int, pp: int) -> ParamCounts:
        c = self.conventions
        if c is not None and c.runtime is Runtime.EVENPIPE:  # embedding and head replicated over tp
            return ParamCounts(per_layer=layer_params_per_rank(self.model, tp),
                               embedding=embedding_params_per_rank(self.model, 1),
                               head=head_params(self.model, tp=1, pp=pp))
        return ParamCounts(per_layer=layer_params_per_rank(self.model, tp),
                           embedding=embedding_params_per_rank(self.model, tp),
                           head=head_params(self.model, tp=tp, pp=pp))

    def state_bytes(self, cfg: ParallelConfig, rank: int) -> StateBytes:
        if self.conventions is not None:
            return self.conventions.state_bytes(cfg.dp, distributed_optimizer=cfg.distributed_optimizer)
        shards = cfg.dp if cfg.distributed_optimizer else 1
        return StateBytes(parameters=BYTES_WEIGHT, gradients=BYTES_GRAD, master=BYTES_MASTER / shards,
                          optimizer=(BYTES_OPTIMIZER - BYTES_MASTER) / shards)

    def optimizer_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        return optimizer_step_time(held.params(self.param_counts(cfg)), cfg, self.hw, self.efficiency)

    def reduce_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        return dp_allreduce_time(held.params(self.param_counts(cfg)), cfg, self.hw, self.efficiency)

    def link(self, cfg: ParallelConfig, rank_a: int, rank_b: int) -> Link:
        return pipeline_link(rank_a, rank_b, cfg, self.hw, self.efficiency)

    def stage_costs(self, cfg: ParallelConfig, shape: MicrobatchShape) -> SimCosts:
        return stage_sim_costs(self.model, self.hw, cfg, self.efficiency, _check_shape(self.model, shape, cfg))

    def plan_durations(self, cfg: ParallelConfig) -> tuple[int, int, int] | None:
        return cost_plan_durations(self.model, self.hw, cfg, self.efficiency)
