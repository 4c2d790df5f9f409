"""A cluster description: each rank's device, memory and speed, and the links between ranks by class.

Ranks sit in nodes, nodes in datacenters. A pair of ranks talks over one of three link classes: ``intra_node``
(the same node), ``inter_node`` (two nodes of one datacenter) and ``inter_datacenter``; each class has a latency
per message and a bandwidth. A rank's *speed* is how fast it computes relative to the nominal rank whose times
a cost source or the command line gives: its device's dense peak over the first rank's device's, times the
``speed`` factor given for it (default 1; 0.67 for a GPU running a third slow). Its memory defaults to the
device's.

The JSON form (``--cluster FILE``; docs/cluster.md; an example in examples/cluster.json)::

    {"links": {"intra_node": {"latency_s": 5e-6, "bandwidth_gb_per_s": 300},
               "inter_datacenter": {"latency_s": 0.005, "bandwidth_gb_per_s": 10}},
     "nodes": [{"name": "a", "datacenter": "east", "device": "h100-80gb", "ranks": [0, 1, 2, 3]},
               {"name": "b", "datacenter": "west", "device": "a100-80gb", "ranks": [4, 5, {"rank": 6, "speed": 0.5}, 7]}]}

A device is a GPU preset name or a hardware JSON file (as ``--gpu`` takes; relative to the cluster file).
Bandwidths are in GB/s (10^9 bytes); a class without one has infinite bandwidth. Every error is one line naming
the file, the bad value and what is allowed.
"""

from __future__ import annotations

import enum
import json
import math
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from evenpipe.cost.hardware import HARDWARE_PRESETS, Hardware, load_hardware
from evenpipe.errors import ConfigError
from evenpipe.sim.costs import Link, SimCosts

__all__ = ["Cluster", "LinkClass", "LinkSpec", "RankDevice", "cluster_sim_costs", "load_cluster", "parse_cluster"]


class LinkClass(enum.Enum):
    """Which link joins two ranks."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"
    INTER_DATACENTER = "inter_datacenter"


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One link class: a fixed latency per message plus bytes over bandwidth."""

    latency_s: float
    """Seconds before a message's first byte arrives."""
    bandwidth_bytes_per_s: float = math.inf
    """Bytes per second, one direction."""

    def link(self) -> Link:
        return Link(latency_s=self.latency_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankDevice:
    """One rank: where it sits and what it computes on."""

    rank: int
    node: str
    datacenter: str
    device: str
    """The preset name or hardware file as written."""
    hardware: Hardware
    memory_gib: float
    """Device memory (default the device's)."""
    speed: float = 1.0
    """Factor on the device's peak (1: as the device; 0.5: half as fast)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Ranks ``0 .. N-1`` and the link classes between them."""

    ranks: tuple[RankDevice, ...]
    links: Mapping[LinkClass, LinkSpec]
    link_delays: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """Extra seconds of latency on the link between two ranks ``(a, b)``, a < b (a what-if: ``link 3-4 +5ms``)."""

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def link_class(self, a: int, b: int) -> LinkClass:
        ra, rb = self.ranks[a], self.ranks[b]
        if ra.datacenter != rb.datacenter:
            return LinkClass.INTER_DATACENTER
        return LinkClass.INTRA_NODE if ra.node == rb.node else LinkClass.INTER_NODE

    def link(self, a: int, b: int) -> LinkSpec:
        spec = self.links[self.link_class(a, b)]
        delay = self.link_delays.get((min(a, b), max(a, b)), 0.0)
        return replace(spec, latency_s=spec.latency_s + delay) if delay else spec

    def nodes(self) -> tuple[str, ...]:
        """Each rank's node, rank order (a node name is unique within its datacenter)."""
        return tuple(f"{r.datacenter}/{r.node}" for r in self.ranks)

    def slowed(self, rank: int, factor: float) -> "Cluster":
        """This cluster with ``rank`` computing ``factor`` times slower."""
        r = self.ranks[rank]
        ranks = self.ranks[:rank] + (replace(r, speed=r.speed / factor),) + self.ranks[rank + 1:]
        return replace(self, ranks=ranks)

    def delayed(self, a: int, b: int, delay_s: float) -> "Cluster":
        """This cluster with ``delay_s`` more latency on the link between ranks ``a`` and ``b``."""
        key = (min(a, b), max(a, b))
        return replace(self, link_delays={**self.link_delays, key: self.link_delays.get(key, 0.0) + delay_s})

    def without(self, rank: int) -> "Cluster":
        """This cluster with ``rank`` left out (the ranks after it renumbered one down; link delays kept)."""
        ranks = tuple(replace(r, rank=i) for i, r in enumerate(self.ranks[:rank] + self.ranks[rank + 1:]))
        def moved(k: int) -> int:
            return k - 1 if k > rank else k
        delays = {(moved(a), moved(b)): d for (a, b), d in self.link_delays.items() if rank not in (a, b)}
        return replace(self, ranks=ranks, link_delays=delays)

    def speed(self, rank: int) -> float:
        """Compute speed of ``rank`` relative to a rank with the first rank's device at factor 1."""
        r = self.ranks[rank]
        return r.speed * r.hardware.peak_tflops / self.ranks[0].hardware.peak_tflops


def cluster_sim_costs(costs: SimCosts, cluster: Cluster, stage_to_rank: tuple[int, ...]) -> SimCosts:
    """``costs`` on ``cluster``: every stage's durations divided by its rank's speed, every rank pair's link from
    its class (the cluster's ranks are the schedule's ranks)."""
    P = max(stage_to_rank) + 1
    if cluster.num_ranks != P:
        raise ConfigError(f"the cluster has {cluster.num_ranks} ranks, the schedule {P}; allowed: a cluster "
                          f"with exactly {P} ranks")
    stages = []
    for st, r in zip(costs.stages, stage_to_rank):
        k = 1.0 / cluster.speed(r)
        stages.append(replace(st, forward=st.forward * k, backward_input=st.backward_input * k,
                              backward_weight=st.backward_weight * k,
                              recompute=None if st.recompute is None else st.recompute * k))
    links = {(a, b): cluster.link(a, b).link() for a in range(P) for b in range(P) if a != b}
    return SimCosts.from_stages(stages, default_link=costs.default_link, links=links)


def load_cluster(path: str | pathlib.Path) -> Cluster:
    """Read and check a cluster file (``ConfigError``, one line, for anything wrong)."""
    p = pathlib.Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read cluster file {str(p)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"cluster file {str(p)!r} is not JSON: {e.msg} at line {e.lineno}") from None
    return parse_cluster(doc, where=f"cluster file {str(p)!r}", base_dir=p.parent)


def parse_cluster(doc: Any, *, where: str = "cluster", base_dir: pathlib.Path | None = None) -> Cluster:
    """A :class:`Cluster` from its JSON form (see the module docstring)."""
    _keys(doc, {"links", "nodes"}, where, required={"links", "nodes"})
    links = {_link_class(name, where): _link_spec(spec, f"{where}: link {name!r}")
             for name, spec in _object(doc["links"], f"{where}: links").items()}
    nodes = doc["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise ConfigError(f"{where}: nodes must be a non-empty list of node objects")
    ranks: dict[int, RankDevice] = {}
    for i, node in enumerate(nodes):
        for rd in _node(node, f"{where}: node {i}", base_dir):
            if rd.rank in ranks:
                raise ConfigError(f"{where}: rank {rd.rank} is listed twice; allowed: each rank once")
            ranks[rd.rank] = rd
    missing = sorted(set(range(len(ranks))) - set(ranks))
    if missing:
        raise ConfigError(f"{where}: ranks {', '.join(map(str, missing))} missing; the ranks must be "
                          f"0..{len(ranks) - 1} with none left out (got {', '.join(map(str, sorted(ranks)))})")
    cluster = Cluster(ranks=tuple(ranks[r] for r in range(len(ranks))), links=links)
    for a in range(cluster.num_ranks):
        for b in range(a + 1, cluster.num_ranks):
            if cluster.link_class(a, b) not in links:
                need = cluster.link_class(a, b).value
                raise ConfigError(f"{where}: ranks {a} and {b} need link class {need!r}, which links does not "
                                  f"give; allowed: add links.{need}")
    return cluster


_NODE_KEYS = {"name", "datacenter", "device", "memory_gib", "speed", "ranks"}
_RANK_KEYS = {"rank", "device", "memory_gib", "speed"}


def _node(node: Any, where: str, base_dir: pathlib.Path | None) -> list[RankDevice]:
    _keys(node, _NODE_KEYS, where, required={"device", "ranks"})
    name = str(node.get("name", where.rsplit(" ", 1)[-1]))
    datacenter = str(node.get("datacenter", "default"))
    entries = node["ranks"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: ranks must be a non-empty list of rank numbers or rank objects")
    out = []
    for entry in entries:
        spec = dict(node)
        if isinstance(entry, dict):
            _keys(entry, _RANK_KEYS, f"{where}: rank entry", required={"rank"})
            spec.update(entry)
            rank = entry["rank"]
        else:
            rank = entry
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"{where}: rank {rank!r} is not a rank number; allowed: integers >= 0")
        hw = _device(spec["device"], f"{where}: rank {rank}", base_dir)
        memory = _number(spec.get("memory_gib", hw.memory_gib), f"{where}: rank {rank} memory_gib", positive=True)
        speed = _number(spec.get("speed", 1.0), f"{where}: rank {rank} speed", positive=True)
        out.append(RankDevice(rank=rank, node=name, datacenter=datacenter, device=str(spec["device"]), hardware=hw,
                              memory_gib=memory, speed=speed))
    return out


def _device(device: Any, where: str, base_dir: pathlib.Path | None) -> Hardware:
    text = str(device)
    if text.lower() in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[text.lower()]
    if text.endswith(".json"):
        path = pathlib.Path(text) if base_dir is None or pathlib.Path(text).is_absolute() else base_dir / text
        if path.is_file():
            try:
                return load_hardware(path)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(f"{where}: unknown device {text!r}; allowed: {', '.join(HARDWARE_PRESETS)} or an existing "
                      "hardware FILE.json")


def _link_class(name: str, where: str) -> LinkClass:
    try:
        return LinkClass(name)
    except ValueError:
        raise ConfigError(f"{where}: unknown link class {name!r}; allowed: "
                          f"{', '.join(c.value for c in LinkClass)}") from None


def _link_spec(spec: Any, where: str) -> LinkSpec:
    _keys(spec, {"latency_s", "bandwidth_gb_per_s"}, where, required={"latency_s"})
    latency = _number(spec["latency_s"], f"{where} latency_s", positive=False)
    if "bandwidth_gb_per_s" not in spec:
        return LinkSpec(latency_s=latency)
    gbps = _number(spec["bandwidth_gb_per_s"], f"{where} bandwidth_gb_per_s", positive=True)
    return LinkSpec(latency_s=latency, bandwidth_bytes_per_s=gbps * 1e9)


def _number(value: Any, where: str, *, positive: bool) -> float:
    """A finite number, > 0 (``positive``) or >= 0."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ConfigError(f"{where} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _keys(value: Any, allowed: set[str], where: str, *, required: set[str]) -> None:
    """``value`` is an object with only ``allowed`` keys and every ``required`` one."""
    obj = _object(value, where)
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    absent = sorted(required - set(obj))
    if absent:
        raise ConfigError(f"{where}: missing {', '.join(absent)}")
