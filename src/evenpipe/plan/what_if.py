"""What-ifs on a cluster: what a slower rank or a slower link costs a plan, and the best response.

A what-if (``plan --cluster FILE --what-if "rank 5 x1.5"`` or ``--what-if "link 3-4 +5ms"``) changes the cluster:
one rank computes ``x`` times slower, or one link between two ranks gets that much more latency per message. The
answer estimates the plan (the best on the unchanged cluster) before and after the change, and the responses on
the changed cluster, each by the one estimate and the one search:

- **re-partition**: the same configuration with its layers re-sized to the changed paces and its devices
  re-placed (every placement of :class:`~evenpipe.plan.hetero.DeviceOrder`, the balanced layouts and the plan's own);
- **another schedule**: the same devices and layers, any schedule family, micro-batch size and recomputation
  (one search restricted to the plan's tp, pp, dp and layout);
- **re-splitting the batch** (with data parallelism): the plan's replicas keep their devices and each takes
  micro-batches in proportion to its speed (:mod:`evenpipe.plan.replicas`);
- **leaving the rank out**: the heterogeneity-aware search on the cluster without the slowed rank (for a link,
  without its second end).

The best response is the fastest; how much of the loss it recovers is ``(after - response) / (after - before)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Sequence

from evenpipe.cost.cluster import Cluster
from evenpipe.cost.rank_sources import RankSources
from evenpipe.cost.runtime_memory import RuntimeConventions
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import Efficiency
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan.hetero import (DeviceOrder, PlacedCandidate, SourceOf, balanced_layouts, cluster_space,
                                  place, placed_source, search_cluster)
from evenpipe.plan.replicas import ReplicaSplit, plan_replicas, split_replicas
from evenpipe.plan.search import Candidate, Searcher, SearchSpace

__all__ = ["WhatIf", "Response", "WhatIfAnswer", "parse_what_if", "answer_what_if"]

_FORMS = 'allowed: "rank N xFACTOR" (e.g. "rank 5 x1.5") or "link A-B +DELAY" in s, ms or us (e.g. "link 3-4 +5ms")'
_RANK = re.compile(r"rank\s+(\d+)\s+x\s*([0-9.eE+-]+)")
_LINK = re.compile(r"link\s+(\d+)\s*-\s*(\d+)\s+\+\s*([0-9.eE+-]+)\s*(s|ms|us)")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIf:
    """One change to a cluster: a rank ``factor`` times slower, or ``delay_s`` more latency on a link."""

    text: str
    """As the user wrote it."""
    rank: int | None = None
    factor: float = 1.0
    link: tuple[int, int] | None = None
    delay_s: float = 0.0

    def apply(self, cluster: Cluster) -> Cluster:
        """The changed cluster."""
        if self.rank is not None:
            return cluster.slowed(self.rank, self.factor)
        assert self.link is not None
        return cluster.delayed(*self.link, self.delay_s)

    @property
    def left_out(self) -> int:
        """The rank the "leave it out" response drops: the slowed rank, or the link's second end."""
        return self.rank if self.rank is not None else max(self.link or (0, 0))

    def describe(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank} computes {self.factor:g}x slower"
        assert self.link is not None
        return f"the link between ranks {self.link[0]} and {self.link[1]} takes {self.delay_s * 1e3:g} ms longer"


def parse_what_if(text: str, num_ranks: int) -> WhatIf:
    """``"rank 5 x1.5"`` or ``"link 3-4 +5ms"`` on a cluster of ``num_ranks``; one-line ConfigError otherwise."""
    spec = text.strip().lower()
    where = f"--what-if {text!r}"
    if m := _RANK.fullmatch(spec):
        rank, factor = int(m.group(1)), _number(m.group(2), where, "the factor")
        if not factor > 0:
            raise ConfigError(f"{where}: the factor must be a number > 0 (1.5: 1.5x slower), got {m.group(2)}")
        _check_rank(rank, num_ranks, where)
        return WhatIf(text=text, rank=rank, factor=factor)
    if m := _LINK.fullmatch(spec):
        a, b = int(m.group(1)), int(m.group(2))
        delay = _number(m.group(3), where, "the delay") * _UNITS[m.group(4)]
        if delay < 0:
            raise ConfigError(f"{where}: the delay must be >= 0, got {m.group(3)}{m.group(4)}")
        for r in (a, b):
            _check_rank(r, num_ranks, where)
        if a == b:
            raise ConfigError(f"{where}: a link joins two different ranks, got {a} twice")
        return WhatIf(text=text, link=(min(a, b), max(a, b)), delay_s=delay)
    raise ConfigError(f"{where} is not a what-if; {_FORMS}")


def _number(text: str, where: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {what} {text!r} is not a number; {_FORMS}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {what} must be finite, got {text}")
    return value


def _check_rank(rank: int, num_ranks: int, where: str) -> None:
    if not 0 <= rank < num_ranks:
        raise ConfigError(f"{where}: rank {rank} is not in the cluster; allowed: 0..{num_ranks - 1}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """One response to the change, and its plan on the changed cluster (None: nothing fits)."""

    name: str
    plan: PlacedCandidate | None
    note: str = ""
    split: ReplicaSplit | None = None
    """Instead of ``plan``: the plan's replicas with unequal shares of the batch."""

    @property
    def step_time_s(self) -> float:
        found = self.plan or self.split
        return found.step_time_s if found is not None else math.inf


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfAnswer:
    """What the change costs the plan, and the responses."""

    what_if: WhatIf
    before: PlacedCandidate
    """The plan on the unchanged cluster."""
    after: PlacedCandidate
    """The same plan on the changed cluster."""
    responses: tuple[Response, ...]

    @property
    def best(self) -> Response:
        return min(self.responses, key=lambda r: r.step_time_s)

    def recovered(self, response: Response) -> float:
        """The share of the slowdown ``response`` wins back (1: all of it; NaN when nothing was lost)."""
        lost = self.after.step_time_s - self.before.step_time_s
        return (self.after.step_time_s - response.step_time_s) / lost if lost > 0 else math.nan

    def to_dict(self) -> dict[str, object]:
        return {"what_if": self.what_if.text, "change": self.what_if.describe(),
                "before": self.before.to_dict(), "after": self.after.to_dict(),
                "responses": [{"name": r.name, "step_time_s": _json_number(r.step_time_s),
                               "recovered": _json_number(self.recovered(r)), "note": r.note,
                               "plan": r.plan.to_dict() if r.plan else None,
                               "split": r.split.to_dict() if r.split else None} for r in self.responses],
                "best_response": self.best.name}


def _json_number(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def _on(source_of: SourceOf, cluster: Cluster, plan: PlacedCandidate, groups: tuple[tuple[int, ...], ...],
        order: DeviceOrder, layout: tuple[int, ...] | None) -> PlacedCandidate | None:
    """``plan``'s configuration (with ``layout``) on ``groups`` of ``cluster``; None when it does not fit."""
    cfg = dataclasses.replace(plan.config, layout=layout)
    try:
        est = Searcher.over(source_of(cluster, groups, cfg.tp, None)).estimate(cfg)
    except EvenpipeError:
        return None
    return PlacedCandidate(candidate=Candidate(config=cfg, estimate=est), order=order, groups=groups) \
        if est.fits else None


def answer_what_if(model: ModelSpec, cluster: Cluster, plan: PlacedCandidate, what_if: WhatIf, *,
                   global_batch: int, space: SearchSpace | None = None, efficiency: Efficiency | None = None,
                   conventions: RuntimeConventions | None = None) -> WhatIfAnswer:
    """What ``what_if`` costs ``plan`` on ``cluster`` and the responses (see the module docstring)."""
    changed = what_if.apply(cluster)

    def source_of(on: Cluster, groups: Sequence[Sequence[int]], tp: int,
                  peers: Sequence[Sequence[int]] | None) -> RankSources:
        return placed_source(model, on, groups, tp=tp, peers=peers, efficiency=efficiency, conventions=conventions)
    after = _on(source_of, changed, plan, plan.groups, plan.order, plan.candidate.estimate.layout)
    if after is None:  # the same plan always fits: a change of speed or latency moves no bytes
        raise ConfigError(f"the plan does not run on the cluster where {what_if.describe()}")
    rank = what_if.left_out
    try:
        left = Response(name=f"leave rank {rank} out", note=f"{changed.num_ranks - 1} ranks, renumbered after {rank}",
                        plan=search_cluster(model, changed.without(rank), global_batch=global_batch, space=space,
                                            top_k=1, efficiency=efficiency, conventions=conventions).best)
    except EvenpipeError as e:
        left = Response(name=f"leave rank {rank} out", plan=None, note=str(e).splitlines()[0])
    responses = [_repartition(source_of, changed, plan), _reschedule(source_of, changed, plan, global_batch, space)]
    if plan.config.dp > 1:
        split = split_replicas(dataclasses.replace(plan.config, layout=None), changed, source_of,
                               plan_replicas(plan.groups, plan.config.tp, plan.config.dp))
        responses.append(Response(name="re-split the batch", plan=None, split=split,
                                  note="same devices; each replica's micro-batches sized to its speed"
                                  if split is not None else "the replicas keep one pace"))
    return WhatIfAnswer(what_if=what_if, before=plan, after=after, responses=(*responses, left))


def _repartition(source_of: SourceOf, changed: Cluster, plan: PlacedCandidate) -> Response:
    cfg = plan.config
    options: list[PlacedCandidate] = []
    for order in DeviceOrder:
        groups = place(changed, cfg.tp, cfg.pp, cfg.dp, order)
        if groups is None:
            continue
        for layout in [plan.candidate.estimate.layout, *balanced_layouts(source_of(changed, groups, cfg.tp, None), cfg)]:
            found = _on(source_of, changed, plan, groups, order, layout)
            if found is not None:
                options.append(found)
    best = min(options, key=lambda p: p.step_time_s, default=None)
    return Response(name="re-partition", plan=best, note="same configuration; layers and devices re-placed")


def _reschedule(source_of: SourceOf, changed: Cluster, plan: PlacedCandidate, global_batch: int,
                space: SearchSpace | None) -> Response:
    cfg = plan.config
    restricted = dataclasses.replace(cluster_space(space, changed), layout=plan.candidate.estimate.layout)
    shape = (cfg.tp, cfg.pp, cfg.dp)
    try:
        result = Searcher.over(source_of(changed, plan.groups, cfg.tp, None)).search(
            num_gpus=changed.num_ranks, global_batch=global_batch, space=restricted, top_k=1,
            where=lambda c: (c.tp, c.pp, c.dp) == shape)
    except EvenpipeError:
        return Response(name="another schedule", plan=None, note="nothing else fits")
    found = PlacedCandidate(candidate=result.best, order=plan.order, groups=plan.groups)
    return Response(name="another schedule", plan=found, note="same devices and layers; any schedule, "
                    "micro-batch size and recomputation")
