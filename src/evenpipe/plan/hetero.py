"""Planning on a cluster of uneven devices: which devices run which pipeline rank, and how many layers each takes.

A plan on a cluster (:mod:`evenpipe.cost.cluster`) is a parallel configuration plus a *placement*: the devices
(``tp·dp`` of them, a *group*) that run each pipeline rank. Every configuration of every placement is estimated
by the one estimate over the one search (:meth:`~evenpipe.plan.search.Searcher.over` on the placement's
:func:`~evenpipe.cost.cluster_source.cluster_source`), so a cluster adds no second planner: it only chooses the
sources and the layouts the search is run with.

Two searches:

- **treating all devices alike** (``aware=False``): the runtime's rank order (global rank
  ``t + tp·(r + pp·d)``) and the planner's usual layouts (even, or end-lighter), evaluated on the real cluster;
- **heterogeneity-aware** (``aware=True``): that, plus placements that sort the devices by speed and give each
  pipeline rank a block of like devices, plus layouts sized to the groups' speeds.

How it stays fast (what it prunes):

- placements: not the N! orders of the devices but three -- rank order, fastest first and slowest first (devices
  of equal speed are interchangeable, so only the order of speed classes matters; fastest first puts the fast
  devices on the first stages, which hold the most activations in flight, slowest first the other way) -- and a
  placement is dropped when it would split a tensor-parallel group over two nodes;
- layouts: not every composition of the layers but the balanced one (:func:`speed_layout`: layers handed out
  one at a time to the group whose compute grows least, the embedding and the head counted as a layer each on
  the end ranks, each group's pace measured from its source's own layer times, no group given more layers than
  its memory holds the model states of), the same pulled halfway toward even (``alpha`` 0.5: room for the
  activations the fast groups' first stages keep), and the planner's even split; the search's fit check then
  drops a layout whose activations overflow a rank;
- each (tp, pp, dp) and placement is one branch-and-bound search of the one planner restricted to that shape,
  so its step-time bound and memory pruning apply inside; on a cluster of alike devices only the rank-order
  placement is tried, and a placement whose groups keep one pace gets only the planner's own layouts (the others
  would coincide with them).

Replicas of unequal speed taking unequal shares of the batch are :mod:`evenpipe.plan.replicas`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from evenpipe.cost import ParallelConfig
from evenpipe.cost.cluster import Cluster
from evenpipe.cost.cluster_source import cluster_source
from evenpipe.cost.hardware import GIB
from evenpipe.cost.rank_sources import RankSources
from evenpipe.cost.runtime_memory import RuntimeConventions
from evenpipe.cost.source import shape_of
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import Efficiency
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan.search import Candidate, Searcher, SearchSpace
from evenpipe.plan.slow_rank import balanced_blocks

__all__ = ["DeviceOrder", "PlacedCandidate", "ClusterPlan", "place", "speed_layout", "search_cluster",
           "placed_source", "SourceOf", "cluster_shapes", "balanced_layouts", "group_paces", "cluster_space", "layer_caps", "LAYOUT_ALPHAS"]

LAYOUT_ALPHAS: tuple[float, ...] = (1.0, 0.5)
"""Exponents on the groups' speeds of the balanced layouts tried (1: fully balanced; 0.5: halfway to even)."""


class DeviceOrder(enum.Enum):
    """How a placement orders the cluster's devices over the pipeline ranks."""

    RANK_ORDER = "rank-order"
    """The runtime's order: pipeline rank r of replica d, tensor rank t is cluster rank ``t + tp·(r + pp·d)``."""
    FAST_FIRST = "fast-first"
    """Devices sorted fastest first (then by memory, then rank); pipeline rank r takes the r-th block of tp·dp."""
    SLOW_FIRST = "slow-first"
    """As fast-first, slowest first."""

    @classmethod
    def parse(cls, text: str) -> "DeviceOrder":
        from evenpipe.errors import parse_choice
        return parse_choice(cls, text, "placement")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedCandidate:
    """A planned configuration on a cluster: which devices run each pipeline rank, and its estimate there."""

    candidate: Candidate
    order: DeviceOrder
    groups: tuple[tuple[int, ...], ...]
    """``groups[r]``: the cluster ranks running pipeline rank r, replica-major (index ``d·tp + t``)."""

    @property
    def config(self) -> ParallelConfig:
        return self.candidate.config

    @property
    def step_time_s(self) -> float:
        return self.candidate.step_time_s

    def to_dict(self) -> dict[str, object]:
        return {**self.candidate.to_dict(), "placement": self.order.value, "groups": [list(g) for g in self.groups]}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterPlan:
    """The outcome of one cluster search."""

    candidates: tuple[PlacedCandidate, ...]
    """The best plans, fastest first."""
    num_searches: int
    """Searches of the one planner run (one per shape, placement and layout family)."""
    num_estimated: int
    """Configurations simulated over all of them."""
    best_by_shape: dict[tuple[int, int, int], PlacedCandidate] = dataclasses.field(default_factory=dict)
    """The fastest plan of each (tp, pp, dp) that has one."""

    @property
    def best(self) -> PlacedCandidate:
        return self.candidates[0]


def place(cluster: Cluster, tp: int, pp: int, dp: int, order: DeviceOrder) -> tuple[tuple[int, ...], ...] | None:
    """Each pipeline rank's devices under ``order`` (None when a tensor-parallel group would straddle nodes)."""
    n = cluster.num_ranks
    if tp * pp * dp != n:
        raise ConfigError(f"tp·pp·dp = {tp}·{pp}·{dp} = {tp * pp * dp} != the cluster's {n} ranks")
    if order is DeviceOrder.RANK_ORDER:
        groups = [[t + tp * (r + pp * d) for d in range(dp) for t in range(tp)] for r in range(pp)]
    else:
        sign = -1.0 if order is DeviceOrder.FAST_FIRST else 1.0
        seq = sorted(range(n), key=lambda g: (sign * cluster.speed(g), sign * cluster.ranks[g].memory_gib, g))
        groups = [[seq[t + tp * (d + dp * r)] for d in range(dp) for t in range(tp)] for r in range(pp)]
    nodes = cluster.nodes()
    for group in groups:
        for d in range(dp):
            if len({nodes[g] for g in group[d * tp:(d + 1) * tp]}) > 1:
                return None
    return tuple(tuple(g) for g in groups)


def speed_layout(num_layers: int, rank_of_stage: Sequence[int], seconds_per_layer: Sequence[float], *,
                 alpha: float = 1.0, end_layers: float = 1.0,
                 max_layers: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Layers per stage balancing each rank's compute (see the module docstring); None with too few layers, or
    when ``max_layers`` (per rank, what its memory holds) cannot hold them all.

    ``seconds_per_layer[r]``: rank r's time for one layer; ``alpha`` < 1 pulls the ranks' paces toward equal;
    the first and the last stage's ranks carry ``end_layers`` layers' worth of embedding and head."""
    if num_layers < len(rank_of_stage):
        return None
    slowest = max(seconds_per_layer)
    per_layer = [slowest * (t / slowest) ** alpha for t in seconds_per_layer]
    fixed = [0.0] * len(per_layer)
    fixed[rank_of_stage[0]] += end_layers * per_layer[rank_of_stage[0]]
    fixed[rank_of_stage[-1]] += end_layers * per_layer[rank_of_stage[-1]]
    return balanced_blocks(num_layers, rank_of_stage, per_layer, fixed, max_layers)


def cluster_shapes(model: ModelSpec, cluster: Cluster, global_batch: int,
                   space: SearchSpace) -> list[tuple[int, int, int]]:
    """The (tp, pp, dp) of the cluster's ranks the space allows: tp divides the heads and fits the smallest node."""
    n = cluster.num_ranks
    node_size = _node_size(cluster)
    max_tp = min(space.max_tp or node_size, node_size)
    out = []
    for tp in (d for d in range(1, n + 1) if n % d == 0 and d <= max_tp and model.num_heads % d == 0):
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0 and d <= model.num_layers):
            dp = n // (tp * pp)
            if global_batch % dp == 0 and (space.data_parallel or dp == 1):
                out.append((tp, pp, dp))
    return out


def cluster_space(space: SearchSpace | None, cluster: Cluster) -> SearchSpace:
    """``space`` (default the planner's) with tensor parallelism within the cluster's smallest node."""
    base = space or SearchSpace()
    node = _node_size(cluster)
    return dataclasses.replace(base, max_tp=min(base.max_tp or node, node))


def _node_size(cluster: Cluster) -> int:
    nodes = cluster.nodes()
    return min(nodes.count(name) for name in set(nodes))


def placed_source(model: ModelSpec, cluster: Cluster, groups: Sequence[Sequence[int]], *, tp: int,
                  peers: Sequence[Sequence[int]] | None = None, efficiency: Efficiency | None = None,
                  conventions: RuntimeConventions | None = None) -> RankSources:
    """The cost source of ``groups`` (``tp`` devices a replica; ``peers``: when the groups are one replica, every
    replica's) on ``cluster`` (:func:`~evenpipe.cost.cluster_source.cluster_source`)."""
    return cluster_source(model, cluster, groups, tp=tp, peers=peers, efficiency=efficiency,
                          conventions=conventions)


SourceOf = Callable[[Cluster, Sequence[Sequence[int]], int, "Sequence[Sequence[int]] | None"], RankSources]
"""The cost source of a placement (groups, ``tp`` devices a replica, the peers of one replica's groups) on a
cluster, the model, efficiency and conventions bound."""


def group_paces(source: RankSources, cfg: ParallelConfig) -> list[float]:
    """Each pipeline rank's seconds per layer (forward and backward) of one micro-batch of ``cfg``."""
    shape = shape_of(source.model, cfg)
    out = []
    for r in range(cfg.pp):
        lt = source.layer_times(cfg, r, shape)
        out.append(lt.forward + lt.backward_input + lt.backward_weight_compute)
    return out


def layer_caps(source: RankSources, cfg: ParallelConfig) -> list[int]:
    """Per pipeline rank, the most layers whose model states (weights, gradients, optimizer state under ``cfg``'s
    sharding) its memory holds; activations are left to the search's fit check."""
    per_layer = source.param_counts(cfg).per_layer
    caps = []
    for r in range(cfg.pp):
        budget = source.memory_budget_gib(r)
        state = per_layer * source.state_bytes(cfg, r).total / GIB
        caps.append(source.model.num_layers if budget is None or state <= 0 else int(budget // state))
    return caps


def balanced_layouts(source: RankSources, cfg: ParallelConfig) -> list[tuple[int, ...]]:
    """The balanced layouts of ``cfg``'s stages on ``source``'s ranks (see :data:`LAYOUT_ALPHAS`); none when
    every rank keeps the same pace (the planner's own layouts balance those)."""
    paces = group_paces(source, cfg)
    out: list[tuple[int, ...]] = []
    if max(paces) == min(paces):
        return out
    rank_of_stage = cfg.schedule.traits.stage_to_rank(cfg.pp, cfg.chunks)
    caps = layer_caps(source, cfg)
    for alpha in LAYOUT_ALPHAS:
        layout = speed_layout(source.model.num_layers, rank_of_stage, paces, alpha=alpha, max_layers=caps)
        if layout is not None and layout not in out:
            out.append(layout)
    return out


def search_cluster(model: ModelSpec, cluster: Cluster, *, global_batch: int, space: SearchSpace | None = None,
                   top_k: int = 10, aware: bool = True, efficiency: Efficiency | None = None,
                   conventions: RuntimeConventions | None = None) -> ClusterPlan:
    """The ``top_k`` fastest fitting plans on ``cluster`` (see the module docstring); ConfigError if none fits."""
    space = cluster_space(space, cluster)
    found: list[PlacedCandidate] = []
    searches = estimated = 0
    alike = len({(cluster.speed(g), r.memory_gib) for g, r in enumerate(cluster.ranks)}) == 1
    orders = tuple(DeviceOrder) if aware and not alike else (DeviceOrder.RANK_ORDER,)
    for tp, pp, dp in cluster_shapes(model, cluster, global_batch, space):
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for order in orders:
            groups = place(cluster, tp, pp, dp, order)
            if groups is None or groups in seen:
                continue
            seen.add(groups)
            source = placed_source(model, cluster, groups, tp=tp, efficiency=efficiency, conventions=conventions)
            searcher = Searcher.over(source)
            layouts: list[tuple[int, ...] | None] = [space.layout]
            if aware and pp > 1 and space.layout is None:
                probe = ParallelConfig(tp=tp, pp=pp, dp=dp, global_batch=global_batch, distributed_optimizer=dp > 1)
                layouts += balanced_layouts(source, probe)
            for layout in layouts:
                searches += 1
                found += [PlacedCandidate(candidate=c, order=order, groups=groups)
                          for c in _search(searcher, cluster.num_ranks, global_batch,
                                           dataclasses.replace(space, layout=layout), top_k, (tp, pp, dp))]
            estimated += searcher.num_estimated
    if not found:
        raise ConfigError(f"no configuration of {model.name} fits on the cluster's {cluster.num_ranks} ranks "
                          f"with global batch {global_batch}")
    found.sort(key=lambda p: p.step_time_s)
    by_shape: dict[tuple[int, int, int], PlacedCandidate] = {}
    for p in found:
        by_shape.setdefault((p.config.tp, p.config.pp, p.config.dp), p)
    return ClusterPlan(candidates=tuple(found[:top_k]), num_searches=searches, num_estimated=estimated,
                       best_by_shape=by_shape)


def _search(searcher: Searcher, num_gpus: int, global_batch: int, space: SearchSpace, top_k: int,
            shape: tuple[int, int, int]) -> tuple[Candidate, ...]:
    """One search restricted to one (tp, pp, dp); nothing when none of it fits."""
    try:
        result = searcher.search(num_gpus=num_gpus, global_batch=global_batch, space=space, top_k=top_k,
                                 where=lambda c: (c.tp, c.pp, c.dp) == shape)
    except EvenpipeError:
        return ()
    return result.candidates
