"""Work split between data-parallel replicas of unequal speed.

With data parallelism over uneven devices, a placement may give each replica devices of one kind (the replicas
are then unequal) instead of mixing kinds inside every pipeline rank (:mod:`evenpipe.plan.hetero`). Then the
fast replicas should take more of the global batch: replica ``d`` runs ``m_d`` micro-batches, the ``m_d`` summing
to the configuration's ``B / b``, and the step is the slowest replica's, since the gradient reduction waits for
every replica (each replica's estimate includes the reduction and the optimizer step).

Each replica is estimated by the one estimate (:func:`~evenpipe.cost.estimate.estimate_with`) over its own
cluster source, its configuration the common one with ``global_batch = m_d·dp·b`` (so its micro-batch count is
``m_d`` while the reduction and the optimizer's sharding still see ``dp`` replicas) and its layers balanced to
its own devices. A replica's step is about linear in its micro-batches: two estimates (at the even split and half
of it) give each replica's line, the split that levels the lines is rounded, and then one micro-batch at a time
moves from the slowest replica to the one that takes it best while that shortens the slowest (at most ``B / b``
moves of a few remembered estimates each), so a split costs tens of estimates, not ``dp·B/b``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from evenpipe.cost import ParallelConfig
from evenpipe.cost.cluster import Cluster
from evenpipe.cost.estimate import Estimate, estimate_with
from evenpipe.errors import EvenpipeError
from evenpipe.plan.hetero import ClusterPlan, DeviceOrder, SourceOf, balanced_layouts, place

__all__ = ["ReplicaShare", "ReplicaSplit", "replica_groups", "split_replicas", "best_split", "SPLIT_WITHIN",
           "plan_replicas", "peers_of"]

SPLIT_WITHIN = 1.25
"""A (tp, pp, dp) gets a split tried when its best plan is within this factor of the best plan overall."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaShare:
    """One replica's devices, micro-batches and estimate."""

    groups: tuple[tuple[int, ...], ...]
    """The cluster ranks of each of its pipeline ranks (tp each)."""
    num_microbatches: int
    estimate: Estimate
    """Its step under its share (its configuration: the common one with ``num_microbatches`` micro-batches)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSplit:
    """A configuration whose replicas take unequal shares of the global batch."""

    config: ParallelConfig
    """The common configuration (its own ``num_microbatches`` is the even split)."""
    replicas: tuple[ReplicaShare, ...]

    @property
    def step_time_s(self) -> float:
        return max(r.estimate.step_time_s for r in self.replicas)

    def to_dict(self) -> dict[str, object]:
        return {"schedule": self.config.schedule_name, "tp": self.config.tp, "pp": self.config.pp,
                "dp": self.config.dp, "microbatch_size": self.config.microbatch_size,
                "recompute": self.config.recompute.value, "step_time_s": self.step_time_s,
                "replicas": [{"groups": [list(g) for g in r.groups], "num_microbatches": r.num_microbatches,
                              "layout": list(r.estimate.layout), "step_time_s": r.estimate.step_time_s}
                             for r in self.replicas]}


def replica_groups(cluster: Cluster, tp: int, pp: int, dp: int) -> list[tuple[tuple[int, ...], ...]] | None:
    """Each replica's pipeline when the devices, fastest first, fill replica 0, then replica 1, ... (None when a
    tensor-parallel group would straddle two nodes)."""
    whole = place(cluster, tp, pp * dp, 1, DeviceOrder.FAST_FIRST)  # one long pipeline: blocks of tp, fastest first
    if whole is None:
        return None
    return [whole[d * pp:(d + 1) * pp] for d in range(dp)]


def plan_replicas(groups: tuple[tuple[int, ...], ...], tp: int, dp: int) -> list[tuple[tuple[int, ...], ...]]:
    """The replicas of a placement (``groups[r]`` replica-major): replica d's devices of each pipeline rank."""
    return [tuple(group[d * tp:(d + 1) * tp] for group in groups) for d in range(dp)]


def peers_of(replicas: Sequence[tuple[tuple[int, ...], ...]]) -> list[tuple[int, ...]]:
    """Per pipeline rank, every replica's devices, replica-major: what its data-parallel reduction spans."""
    return [tuple(g for rep in replicas for g in rep[r]) for r in range(len(replicas[0]))]


def split_replicas(cfg: ParallelConfig, cluster: Cluster, source_of: SourceOf,
                   replicas: list[tuple[tuple[int, ...], ...]] | None = None) -> ReplicaSplit | None:
    """The best split of ``cfg``'s micro-batches over ``replicas`` (default: replicas of like devices, see the
    module docstring); None without unequal replicas, or when some share does not run or fit."""
    reps = replicas if replicas is not None else replica_groups(cluster, cfg.tp, cfg.pp, cfg.dp) \
        if cfg.dp > 1 else None
    if reps is None:
        return None
    peers = peers_of(reps)
    sources = [source_of(cluster, g, cfg.tp, peers) for g in reps]
    layouts: list[tuple[int, ...] | None] = [[*balanced_layouts(s, cfg), cfg.layout][0] for s in sources]
    total = cfg.global_batch // cfg.microbatch_size
    memo: dict[tuple[int, int], Estimate | None] = {}

    def est(d: int, m: int) -> Estimate | None:
        if (d, m) not in memo:
            c = dataclasses.replace(cfg, global_batch=m * cfg.dp * cfg.microbatch_size, layout=layouts[d])
            try:
                e: Estimate | None = estimate_with(sources[d], c)
            except EvenpipeError:
                e = None
            memo[(d, m)] = e if e is not None and e.fits else None
        return memo[(d, m)]
    even = total // cfg.dp

    def step(d: int, m: int) -> float:
        return _step(est(d, m))
    lines = [_line(step, d, even) for d in range(cfg.dp)]
    known = [line for line in lines if line is not None]
    if len(known) < len(lines) or len(set(known)) == 1:
        return None  # a share that cannot run, or replicas alike
    shares = _improve(_balanced(total, known), step)
    if any(est(d, m) is None for d, m in enumerate(shares)):
        return None
    return ReplicaSplit(config=cfg, replicas=tuple(
        ReplicaShare(groups=reps[d], num_microbatches=m, estimate=est(d, m))  # type: ignore[arg-type]
        for d, m in enumerate(shares)))


def best_split(plan: ClusterPlan, cluster: Cluster, source_of: SourceOf) -> ReplicaSplit | None:
    """The fastest split over unequal replicas of the configurations of ``plan``: for each (tp, pp, dp) with
    dp > 1 whose best plan is within :data:`SPLIT_WITHIN` of the best, that plan's configuration split."""
    best: ReplicaSplit | None = None
    for (_, _, dp), p in plan.best_by_shape.items():
        if dp < 2 or p.step_time_s > SPLIT_WITHIN * plan.best.step_time_s:
            continue
        split = split_replicas(dataclasses.replace(p.config, layout=None), cluster, source_of)
        if split is not None and (best is None or split.step_time_s < best.step_time_s):
            best = split
    return best


def _line(step: Callable[[int, int], float], d: int, m: int) -> tuple[float, float] | None:
    """``(fixed, per micro-batch)`` seconds of replica ``d``'s step, from its steps at ``m`` and ``m // 2``
    micro-batches (a pipeline's step grows about linearly in them); None when either cannot run."""
    lo = max(1, m // 2)
    a, b = step(d, lo), step(d, m)
    if a == float("inf") or b == float("inf") or m == lo:
        return None
    slope = max((b - a) / (m - lo), 1e-12)
    return round(b - slope * m, 12), round(slope, 15)


def _balanced(total: int, lines: list[tuple[float, float]]) -> list[int]:
    """Micro-batches per replica equalising ``fixed + m·per`` (each at least 1), rounded by largest remainder."""
    inv = sum(1.0 / per for _, per in lines)
    level = (total + sum(fixed / per for fixed, per in lines)) / inv
    raw = [max(1.0, (level - fixed) / per) for fixed, per in lines]
    raw = [x * total / sum(raw) for x in raw]
    out = [max(1, int(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda d: raw[d] - int(raw[d]), reverse=True)
    for i in range(total - sum(out)):
        out[order[i % len(out)]] += 1
    while sum(out) > total:
        out[max(range(len(out)), key=lambda k: out[k])] -= 1
    return out


def _step(e: Estimate | None) -> float:
    return e.step_time_s if e is not None else float("inf")


def _improve(shares: list[int], step: Callable[[int, int], float]) -> list[int]:
    """Move one micro-batch at a time from the slowest replica to the one that takes it best, while the pair's
    slower step falls below the slowest replica's (ties among the slowest are then taken one by one)."""
    shares = list(shares)
    for _ in range(sum(shares)):
        times = [step(d, m) for d, m in enumerate(shares)]
        slow = max(range(len(shares)), key=lambda d: (times[d], d))
        if shares[slow] <= 1:
            break
        take = min((d for d in range(len(shares)) if d != slow), key=lambda d: step(d, shares[d] + 1))
        if max(step(slow, shares[slow] - 1), step(take, shares[take] + 1)) >= times[slow]:
            break
        shares[slow] -= 1
        shares[take] += 1
    return shares
