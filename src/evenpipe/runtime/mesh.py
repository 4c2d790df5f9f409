"""The device mesh of a job: data parallel x pipeline x tensor parallel, and the process groups each part uses.

Order of the mesh dimensions, outermost to innermost: ``dp``, ``pp``, ``tp``. Global rank
``base + (d * pp + r) * tp + t`` is tensor-parallel rank ``t`` of pipeline rank ``r`` of replica ``d``.

- **tp innermost**: tensor parallelism runs collectives inside every layer, forward and backward, so its ranks
  must be the closest ones (consecutive ranks are the GPUs of one node under torchrun); ``tp`` should divide the
  processes per node.
- **pp in the middle**: a replica's pipeline ranks are consecutive blocks of ``tp`` ranks; neighbouring stages
  exchange one activation per micro-batch, point to point.
- **dp outermost**: replicas reduce gradients once per step, the traffic that best tolerates the slowest links.
  With ``tp == 1`` this is exactly the earlier layout (rank ``d * pp + r``), so nothing changes for pipelines
  without tensor parallelism.

Groups (every one created with the job's timeout, so a dead peer fails a collective in ``timeout_s`` instead of
torch's default 30 minutes; this is why the mesh is assembled with ``DeviceMesh.from_group`` from our own groups
rather than by ``init_device_mesh``, which it otherwise equals):

- ``pp_group``: ranks with this rank's ``(dp, tp)`` coordinates -- activations and gradients between stages;
- ``bpipe_group``: the same ranks again, so BPipe's evictions never reorder with pipeline messages; an evictor's
  partner therefore has the same data- and tensor-parallel coordinates (each tensor-parallel rank moves its own
  shard);
- ``embedding_group``: the first and last rank of each pipeline -- gradients of weights tied between the first
  and the last stage (Megatron's embedding group);
- ``tp_group``: ranks with this rank's ``(dp, pp)`` -- the collectives of DTensor's tensor parallelism;
- ``dp_group``: ranks with this rank's ``(pp, tp)`` -- gradient reduction and sharded data parallelism.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MeshDim", "MESH_DIMS", "mesh_ranks", "build_parallel_groups", "ParallelGroups", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: the longest any rank waits for a peer before failing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    """This process's place in a ``dp x pp x tp`` layout and the process groups it talks through."""

    pp: int
    """Pipeline ranks per replica."""
    dp: int
    """Data-parallel replicas."""
    pp_rank: int
    """This process's rank inside its pipeline replica."""
    dp_rank: int
    """This process's replica index."""
    pp_ranks: tuple[int, ...]
    """Global ranks of this replica's pipeline ranks, indexed by pipeline rank."""
    dp_ranks: tuple[int, ...]
    """Global ranks of this pipeline rank in every replica, indexed by replica."""
    pp_group: Any = field(repr=False)
    """Process group of the replica: activations and gradients."""
    bpipe_group: Any = field(repr=False)
    """Second process group of the replica: BPipe evict/accept/return/load."""
    dp_group: Any = field(repr=False)
    """Process group across replicas for this pipeline rank (gradient all-reduce); ``None`` when dp == 1."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    tp_rank: int = 0
    """This process's tensor-parallel rank."""
    tp_ranks: tuple[int, ...] = ()
    """Global ranks of this stage's tensor-parallel ranks, indexed by tensor-parallel rank."""
    tp_group: Any = field(default=None, repr=False)
    """Process group of the tensor-parallel ranks (DTensor collectives); ``None`` when tp == 1."""
    mesh: Any = field(default=None, repr=False)
    """The ``torch.distributed.device_mesh.DeviceMesh`` ``[dp, pp, tp]`` this rank belongs to."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """How long any wait on these groups may take before it fails."""
    embedding_group: Any = field(default=None, repr=False)
    """Process group of the replica's first and last pipeline ranks (Megatron's embedding group): the gradients
    of weights tied between the first and the last stage are summed over it; ``None`` when pp == 1."""

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` of this replica."""
        return self.pp_ranks[pp_rank]

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp - 1


class MeshDim(enum.Enum):
    """A dimension of the device mesh (its value is the DeviceMesh dimension name)."""

    DP = "dp"
    """Data-parallel replicas."""
    PP = "pp"
    """Pipeline ranks."""
    TP = "tp"
    """Tensor-parallel ranks."""


MESH_DIMS = (MeshDim.DP, MeshDim.PP, MeshDim.TP)
"""Mesh dimensions, outermost to innermost (see the module docstring for why)."""


def mesh_ranks(*, dp: int, pp: int, tp: int, base: int = 0) -> torch.Tensor:
    """Global ranks as an ``int`` tensor ``[dp, pp, tp]`` laid out as described in the module docstring."""
    return torch.arange(base, base + dp * pp * tp, dtype=torch.int).view(dp, pp, tp)


_CACHE: dict[tuple[int, int, int, int, float], ParallelGroups | None] = {}


def build_parallel_groups(pp: int, dp: int, tp: int = 1, *, base: int = 0,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelGroups | None:
    """Create (or reuse) the mesh and groups of a ``dp x pp x tp`` layout on global ranks from ``base``.

    Collective over the whole world: every process calls it with the same arguments, including those outside
    the layout, which get ``None``. Results are cached, so tests can run many cases in one world.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if pp < 1 or dp < 1 or tp < 1 or base < 0 or base + pp * dp * tp > world:
        raise ValueError(f"layout pp={pp} x dp={dp} x tp={tp} from rank {base} does not fit a world of {world}")
    key = (pp, dp, tp, base, timeout_s)
    if key not in _CACHE:
        _CACHE[key] = _build(pp, dp, tp, base, me, datetime.timedelta(seconds=timeout_s), timeout_s)
    return _CACHE[key]


def _groups_along(ranks: torch.Tensor, dim: int, me: int, timeout: datetime.timedelta) -> tuple[Any, list[int]]:
    """One group per line of ``ranks`` along ``dim`` (all processes create all); this rank's group and ranks."""
    lines = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    mine: tuple[Any, list[int]] = (None, [])
    for line in lines:
        group = dist.new_group(line, timeout=timeout)
        if me in line:
            mine = (group, line)
    return mine


def _build(pp: int, dp: int, tp: int, base: int, me: int, timeout: datetime.timedelta,
           timeout_s: float) -> ParallelGroups | None:
    ranks = mesh_ranks(dp=dp, pp=pp, tp=tp, base=base)
    by_dim = {d: _groups_along(ranks, i, me, timeout) for i, d in enumerate(MESH_DIMS)}
    bpipe_group, _ = _groups_along(ranks, MESH_DIMS.index(MeshDim.PP), me, timeout)
    embedding_group = _embedding_groups(ranks, me, timeout)
    if not base <= me < base + ranks.numel():
        return None
    d, r, t = (int(c) for c in (ranks == me).nonzero()[0])
    from torch.distributed.device_mesh import DeviceMesh
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = DeviceMesh.from_group([by_dim[x][0] for x in MESH_DIMS], device, mesh=ranks,
                                 mesh_dim_names=tuple(x.value for x in MESH_DIMS))
    (dp_group, dp_ranks), (pp_group, pp_ranks), (tp_group, tp_ranks) = (by_dim[x] for x in MESH_DIMS)
    return ParallelGroups(pp=pp, dp=dp, tp=tp, pp_rank=r, dp_rank=d, tp_rank=t, pp_ranks=tuple(pp_ranks),
                          dp_ranks=tuple(dp_ranks), tp_ranks=tuple(tp_ranks), pp_group=pp_group,
                          bpipe_group=bpipe_group, dp_group=dp_group if dp > 1 else None,
                          tp_group=tp_group if tp > 1 else None, mesh=mesh, timeout_s=timeout_s,
                          embedding_group=embedding_group if r in (0, pp - 1) else None)


def _embedding_groups(ranks: torch.Tensor, me: int, timeout: datetime.timedelta) -> Any:
    """Per pipeline, the group of its first and last rank (weights tied between the first and last stage);
    this rank's, or None (also when pp == 1)."""
    if ranks.shape[1] == 1:
        return None
    mine = None
    for line in ranks.movedim(1, -1).reshape(-1, ranks.shape[1]).tolist():
        group = dist.new_group([line[0], line[-1]], timeout=timeout)
        if me in (line[0], line[-1]):
            mine = group
    return mine
