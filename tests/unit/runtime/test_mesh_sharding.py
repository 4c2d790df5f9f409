"""Pure parts of the device mesh and the distributed optimizer."""

from __future__ import annotations

from evenpipe.runtime.mesh import MESH_DIMS, MeshDim, mesh_ranks
from evenpipe.runtime.sharding import deal_parameters


def test_tensor_parallel_is_innermost_and_tp1_keeps_the_old_layout() -> None:
    assert MESH_DIMS == (MeshDim.DP, MeshDim.PP, MeshDim.TP)
    ranks = mesh_ranks(dp=2, pp=2, tp=2)
    assert ranks[0, 0].tolist() == [0, 1]  # a stage's tensor-parallel ranks are neighbours (one node)
    assert ranks[1, 1, 0].item() == 6
    old = mesh_ranks(dp=3, pp=4, tp=1)  # rank d * pp + r, as before the mesh
    assert all(old[d, r, 0].item() == d * 4 + r for d in range(3) for r in range(4))


def test_parameters_are_dealt_largest_first_to_the_least_loaded_owner() -> None:
    owners = deal_parameters([10, 1, 7, 3, 3], 2)
    assert owners == [0, 1, 1, 1, 0]  # 10 -> 0, 7 -> 1, 3 -> 1, 3 -> 0 (tie: lowest), 1 -> 1
    load = [sum(s for s, o in zip([10, 1, 7, 3, 3], owners) if o == k) for k in range(2)]
    assert max(load) - min(load) <= 3
    assert deal_parameters([5], 4) == [0]
