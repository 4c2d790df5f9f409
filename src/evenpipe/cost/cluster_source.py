"""The cost source of a cluster: one analytic source per pipeline rank, sized to the devices that run it.

A pipeline rank is run by ``tp·dp`` devices of the cluster (its *group*: one per tensor rank and data-parallel
replica). Data-parallel replicas step together, so the group computes at the pace of its slowest device and fits
in the smallest memory: the rank's source is the analytic source of that device's preset with its peak and memory
bandwidth scaled by the device's ``speed`` factor and its memory as the cluster gives it. The link from pipeline
rank ``a`` to ``b`` is the slowest of the cluster links between the devices of the two groups that talk (the
``i``-th device of each group, replica by replica): the largest latency and the smallest bandwidth.

The data-parallel reduction of a group spanning nodes runs over the slowest cluster link between its replicas
(the device preset's network is replaced by it); within one node it runs over the preset's NVLink, as do the
tensor-parallel collectives (a tensor-parallel group never leaves its node).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.sim.costs import Link

from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.cluster import Cluster, LinkClass, LinkSpec, RankDevice
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.rank_sources import RankSources
from evenpipe.cost.runtime_memory import RuntimeConventions
from evenpipe.cost.specs import ModelSpec
from evenpipe.cost.timing import Efficiency

__all__ = ["cluster_source", "device_hardware", "group_link", "uniform_cluster"]


def device_hardware(cluster: Cluster, rank: int) -> Hardware:
    """The hardware of one cluster rank: its device with peak and memory bandwidth times its speed factor, and
    its memory."""
    r = cluster.ranks[rank]
    hw = r.hardware
    name = hw.name if r.speed == 1.0 else f"{hw.name} x{r.speed:.3g}"
    return dataclasses.replace(hw, name=name, peak_tflops=hw.peak_tflops * r.speed,
                               hbm_bandwidth_gbps=hw.hbm_bandwidth_gbps * r.speed, memory_gib=r.memory_gib)


def _slowest(cluster: Cluster, group: Sequence[int], tp: int, peers: Sequence[int]) -> Hardware:
    """The group's pace-setting device (lowest compute speed), with the group's smallest memory and, between
    nodes, the slowest cluster link its data-parallel reduction over ``peers`` crosses (the ``i``-th tensor rank
    of every replica reduce together)."""
    slowest = min(group, key=lambda g: (cluster.speed(g), g))
    hw = dataclasses.replace(device_hardware(cluster, slowest), memory_gib=min(cluster.ranks[g].memory_gib
                                                                               for g in group))
    ring = [cluster.link(peers[i], peers[j]) for i in range(len(peers)) for j in range(i + tp, len(peers), tp)]
    if not ring:
        return hw
    return dataclasses.replace(hw, internode_gbps=min(s.bandwidth_bytes_per_s for s in ring) / 1e9,
                               internode_latency_s=max(s.latency_s for s in ring))


def group_link(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> Link:
    """The link between two groups: the largest latency and the smallest bandwidth of the pairs that talk."""
    specs = [cluster.link(x, y) for x, y in zip(a, b)]
    return Link(latency_s=max(s.latency_s for s in specs),
                bandwidth_bytes_per_s=min(s.bandwidth_bytes_per_s for s in specs))


def cluster_source(model: ModelSpec, cluster: Cluster, groups: Sequence[Sequence[int]], *, tp: int = 1,
                   peers: Sequence[Sequence[int]] | None = None, efficiency: Efficiency | None = None,
                   conventions: RuntimeConventions | None = None) -> RankSources:
    """The source of a pipeline whose rank ``r`` is run by the cluster ranks ``groups[r]``, replica-major with
    ``tp`` devices a replica (see the module doc); the groups may leave ranks out (one replica of several: then
    ``peers[r]``, all replicas' devices of pipeline rank r, price its data-parallel reduction)."""
    used = [g for group in groups for g in group]
    if len(set(used)) != len(used) or not all(0 <= g < cluster.num_ranks for g in used):
        raise ConfigError(f"a placement must use distinct ranks of the cluster's {cluster.num_ranks}, got "
                          f"{sorted(used)}")
    if len({len(group) for group in groups}) != 1:
        raise ConfigError("every pipeline rank needs as many devices (tp·dp) as the others")
    eff = efficiency or Efficiency()
    rings = peers if peers is not None else groups
    sources = tuple(AnalyticSource(model, _slowest(cluster, group, tp, ring), eff, conventions)
                    for group, ring in zip(groups, rings))
    links = {(a, b): group_link(cluster, groups[a], groups[b])
             for a in range(len(groups)) for b in range(len(groups)) if a != b}
    return RankSources(sources, pipeline_links=links)


def uniform_cluster(hw: Hardware, num_ranks: int, efficiency: Efficiency | None = None) -> Cluster:
    """``num_ranks`` devices of ``hw`` in nodes of ``hw.gpus_per_node``, linked as the analytic source prices
    pipeline messages (NVLink within a node, the network between nodes, at the efficiency's achieved fractions):
    what ``plan --gpu --what-if`` changes."""
    eff = efficiency or Efficiency()
    per = hw.gpus_per_node
    ranks = tuple(RankDevice(rank=g, node=f"node-{g // per}", datacenter="default", device=hw.name, hardware=hw,
                             memory_gib=hw.memory_gib) for g in range(num_ranks))
    links = {LinkClass.INTRA_NODE: LinkSpec(latency_s=hw.nvlink_latency_s,
                                            bandwidth_bytes_per_s=hw.nvlink_gbps * 1e9 * eff.nvlink_fraction),
             LinkClass.INTER_NODE: LinkSpec(latency_s=hw.internode_latency_s,
                                            bandwidth_bytes_per_s=hw.internode_gbps * 1e9 * eff.network_fraction)}
    return Cluster(ranks=ranks, links=links)
