"""Work split between data-parallel replicas of unequal speed (plan/replicas.py)."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import ParallelConfig, model_preset
from evenpipe.cost.cluster import parse_cluster
from evenpipe.cost.estimate import estimate_with
from evenpipe.plan.hetero import placed_source, search_cluster
from evenpipe.plan.replicas import best_split, peers_of, replica_groups, split_replicas
from evenpipe.schedule import ScheduleFamily

LINKS = {"intra_node": {"latency_s": 5e-6, "bandwidth_gb_per_s": 300},
         "inter_node": {"latency_s": 1e-5, "bandwidth_gb_per_s": 25}}
MODEL = model_preset("gpt3-1.3b")


def _source(cluster, groups, tp, peers=None):  # type: ignore[no-untyped-def]
    return placed_source(MODEL, cluster, groups, tp=tp, peers=peers)


def test_replicas_of_like_devices_and_the_fast_one_takes_more_micro_batches() -> None:
    cluster = parse_cluster({"links": LINKS, "nodes": [{"device": "a100-80gb", "ranks": [0, 1, 2, 3]},
                                                       {"device": "h100-80gb", "ranks": [4, 5, 6, 7]}]})
    assert replica_groups(cluster, 1, 4, 2) == [((4,), (5,), (6,), (7,)), ((0,), (1,), (2,), (3,))]
    cfg = ParallelConfig(pp=4, dp=2, global_batch=64, schedule=ScheduleFamily.ONE_F_ONE_B)
    split = split_replicas(cfg, cluster, _source)
    assert split is not None
    fast, slow = split.replicas
    assert fast.num_microbatches + slow.num_microbatches == 64 and fast.num_microbatches > slow.num_microbatches
    # each replica's step is the one estimate of its share on its devices
    for r in split.replicas:
        c = dataclasses.replace(cfg, global_batch=r.num_microbatches * 2, layout=r.estimate.layout)
        peers = peers_of([x.groups for x in split.replicas])
        assert estimate_with(_source(cluster, r.groups, 1, peers), c).step_time_s == pytest.approx(r.estimate.step_time_s)
    # an even split waits for the slow replica
    peers = peers_of([x.groups for x in split.replicas])
    even = max(estimate_with(_source(cluster, g, 1, peers), dataclasses.replace(cfg, layout=r.estimate.layout)).step_time_s
               for g, r in zip(replica_groups(cluster, 1, 4, 2) or [], split.replicas))
    assert split.step_time_s < 0.8 * even


def test_no_split_without_unequal_replicas() -> None:
    alike = parse_cluster({"links": LINKS, "nodes": [{"device": "a100-80gb", "ranks": list(range(8))}]})
    cfg = ParallelConfig(pp=4, dp=2, global_batch=64)
    assert split_replicas(cfg, alike, _source) is None
    assert split_replicas(dataclasses.replace(cfg, pp=8, dp=1), alike, _source) is None
    plan = search_cluster(MODEL, alike, global_batch=64, top_k=1)
    assert best_split(plan, alike, _source) is None
