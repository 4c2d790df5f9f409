"""Costs per (stage, micro-batch) for unequal micro-batches (documents of varying length, issue 34).

:func:`microbatch_sim_costs` asks a :class:`~evenpipe.cost.source.CostSource` once per distinct micro-batch shape
and lays the answers out per micro-batch for the simulator (:attr:`evenpipe.sim.costs.SimCosts.microbatch_stages`);
micro-batches that are all alike give the source's own per-stage costs, the simulator's fast path.
"""

from __future__ import annotations

from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.sim.costs import SimCosts

from evenpipe.cost.parallel import ParallelConfig
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.source import CostSource, shape_of

__all__ = ["microbatch_sim_costs", "config_sim_costs", "bpipe_weights"]


def microbatch_sim_costs(source: CostSource, cfg: ParallelConfig, shapes: Sequence[MicrobatchShape]) -> SimCosts:
    """The simulator's costs of micro-batches of ``shapes`` (in the order they run) under ``cfg``: per stage and
    micro-batch durations, saved and sent bytes; the links of the source (a message's time follows its bytes)."""
    if len(shapes) != cfg.num_microbatches:
        raise ConfigError(f"{len(shapes)} micro-batch shapes for {cfg.num_microbatches} micro-batches; give one "
                          "per micro-batch")
    by_shape: dict[MicrobatchShape, SimCosts] = {}
    for sh in shapes:
        if sh not in by_shape:
            by_shape[sh] = source.stage_costs(cfg, sh)
    first = by_shape[shapes[0]]
    if len(by_shape) == 1:
        return first
    return SimCosts.per_microbatch([by_shape[sh].stages for sh in shapes], default_link=first.default_link,
                                   links=first.links)


def bpipe_weights(source: CostSource, cfg: ParallelConfig) -> tuple[float, ...] | None:
    """BPipe's activation units of each micro-batch of ``cfg``: its layer's saved bytes over the largest
    micro-batch's (so the budget counts units of the largest); None when ``cfg`` evicts nothing or its
    micro-batches are alike."""
    shapes = cfg.microbatch_shapes
    if not cfg.uses_bpipe or shapes is None or len(set(shapes)) == 1:
        return None
    saved = {sh: source.layer_bytes(cfg, 0, sh).layer_saved for sh in set(shapes)}
    top = max(saved.values())
    return tuple(saved[sh] / top for sh in shapes) if top > 0 else None


def config_sim_costs(source: CostSource, cfg: ParallelConfig) -> SimCosts:
    """The simulator's costs of ``cfg``: its micro-batch shapes when it has them, else its one padded shape."""
    if cfg.microbatch_shapes is None:
        return source.stage_costs(cfg, shape_of(source.model, cfg))
    return microbatch_sim_costs(source, cfg, cfg.microbatch_shapes)
