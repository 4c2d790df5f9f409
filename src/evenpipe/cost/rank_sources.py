"""A cost source per pipeline rank (mixed devices): each rank's questions go to its own source.

Every rank answers its layer times and bytes, model-state bytes, optimizer and reduction times, memory budget and
peak FLOP rate from its source; a stage's costs are those of the rank that runs it; the link between two ranks is
the slower of the two sources' links between them, unless the links are given (a cluster's:
:mod:`evenpipe.cost.cluster_source`). The sources must describe one model and agree on the step's
conventions (whether the optimizer waits for all ranks, whether outputs are held until sent, the overlap of the
reduction); the fixed per-step cost is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from evenpipe.errors import ConfigError
from evenpipe.sim.costs import Link, SimCosts

from evenpipe.cost.activations import ActivationBytes
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.parallel import ParallelConfig, stage_layers
from evenpipe.cost.source import CostSource, Holding, MicrobatchShape, ParamCounts, StateBytes
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import LayerTimes

__all__ = ["RankSources"]


@dataclass(frozen=True, eq=False)
class RankSources:
    """``sources[r]`` answers for pipeline rank ``r`` (one entry per pipeline rank)."""

    sources: tuple[CostSource, ...]
    """One source per pipeline rank, in rank order."""
    pipeline_links: Mapping[tuple[int, int], Link] | None = None
    """The link from pipeline rank ``a`` to ``b`` when known (a cluster's); None: the slower of the two sources'."""
    _costs: dict[tuple[Any, ...], SimCosts] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("a source per rank needs at least one rank")
        first = self.sources[0]
        for r, s in enumerate(self.sources):
            if s.model != first.model:
                raise ConfigError(f"rank {r}'s costs are of model {s.model.name}, rank 0's of {first.model.name}")
            conventions = (s.optimizer_waits_for_all_ranks, s.holds_sent_output, s.reduction_overlaps_backward)
            if conventions != (first.optimizer_waits_for_all_ranks, first.holds_sent_output,
                               first.reduction_overlaps_backward):
                raise ConfigError(f"rank {r}'s source ({s.name}) follows other step conventions than rank 0's "
                                  f"({first.name})")

    def _of(self, rank: int) -> CostSource:
        return self.sources[rank]

    @property
    def name(self) -> str:
        runs: list[tuple[str, int, int]] = []
        for r, s in enumerate(self.sources):
            if runs and runs[-1][0] == s.name:
                runs[-1] = (s.name, runs[-1][1], r)
            else:
                runs.append((s.name, r, r))
        return ", ".join(f"rank {a}: {n}" if a == b else f"ranks {a}-{b}: {n}" for n, a, b in runs)

    @property
    def model(self) -> ModelSpec:
        return self.sources[0].model

    @property
    def hardware(self) -> Hardware | None:
        hws = {s.hardware for s in self.sources}
        return hws.pop() if len(hws) == 1 else None

    @property
    def uniform(self) -> bool:
        return False

    @property
    def reduction_overlaps_backward(self) -> bool:
        return self.sources[0].reduction_overlaps_backward

    @property
    def step_overhead_s(self) -> float:
        return max(s.step_overhead_s for s in self.sources)

    @property
    def optimizer_waits_for_all_ranks(self) -> bool:
        return self.sources[0].optimizer_waits_for_all_ranks

    @property
    def holds_sent_output(self) -> bool:
        return self.sources[0].holds_sent_output

    def check(self, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
        if cfg.pp != len(self.sources):
            raise ConfigError(f"pp {cfg.pp} != the {len(self.sources)} ranks given a source each")
        for s in self.sources:
            s.check(cfg, num_gpus)

    def memory_budget_gib(self, rank: int) -> float | None:
        return self._of(rank).memory_budget_gib(rank)

    def peak_flops(self, rank: int) -> float | None:
        return self._of(rank).peak_flops(rank)

    def layer_times(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> LayerTimes:
        return self._of(rank).layer_times(cfg, rank, shape)

    def layer_flop_rate(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> float:
        return self._of(rank).layer_flop_rate(cfg, rank, shape)

    def layer_bytes(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> ActivationBytes:
        return self._of(rank).layer_bytes(cfg, rank, shape)

    def param_counts(self, cfg: ParallelConfig) -> ParamCounts:
        return self.sources[0].param_counts(cfg)

    def state_bytes(self, cfg: ParallelConfig, rank: int) -> StateBytes:
        return self._of(rank).state_bytes(cfg, rank)

    def optimizer_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        return self._of(rank).optimizer_time(cfg, rank, held)

    def reduce_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        return self._of(rank).reduce_time(cfg, rank, held)

    def link(self, cfg: ParallelConfig, rank_a: int, rank_b: int) -> Link:
        if self.pipeline_links is not None:
            return self.pipeline_links[(rank_a, rank_b)]
        a, b = self._of(rank_a).link(cfg, rank_a, rank_b), self._of(rank_b).link(cfg, rank_a, rank_b)
        probe = 1 << 20  # the slower link for a MiB message
        return a if a.transfer_time(probe) >= b.transfer_time(probe) else b

    def stage_costs(self, cfg: ParallelConfig, shape: MicrobatchShape) -> SimCosts:
        """Each stage's costs from the source of the rank that runs it; links between every pair of ranks."""
        key = (cfg.schedule, cfg.pp, cfg.chunks, stage_layers(self.model, cfg), cfg.tp, cfg.sequence_parallel,
               cfg.attention, cfg.recompute, cfg.uses_bpipe, cfg.dp, shape)
        costs = self._costs.get(key)
        if costs is None:
            placement = cfg.schedule.traits.stage_to_rank(cfg.pp, cfg.chunks)
            per_rank = [s.stage_costs(cfg, shape) for s in self.sources]
            stages = [per_rank[r].stages[s] for s, r in enumerate(placement)]
            links = {(a, b): self.link(cfg, a, b) for a in range(cfg.pp) for b in range(cfg.pp) if a != b}
            costs = self._costs[key] = SimCosts.from_stages(stages, default_link=per_rank[0].default_link,
                                                            links=links)
        return costs

    def plan_durations(self, cfg: ParallelConfig) -> tuple[int, int, int] | None:
        return self.sources[0].plan_durations(cfg)
