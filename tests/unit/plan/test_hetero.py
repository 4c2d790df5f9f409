"""Planning on uneven devices (plan/hetero.py): placements, balanced layouts, and the 1.2x claim of issue 35 on the
shipped mixed cluster (a simulated, deterministic figure)."""

from __future__ import annotations

import pathlib

import pytest

from evenpipe.cost import model_preset
from evenpipe.cost.cluster import Cluster, load_cluster, parse_cluster
from evenpipe.cost.estimate import estimate_with
from evenpipe.errors import ConfigError
from evenpipe.plan.hetero import DeviceOrder, place, placed_source, search_cluster, speed_layout

MIXED = pathlib.Path(__file__).resolve().parents[3] / "examples" / "mixed_a100_h100.json"


def _two_nodes(fast: str = "h100-80gb", slow: str = "a100-80gb", per_node: int = 4) -> Cluster:
    return parse_cluster({"links": {"intra_node": {"latency_s": 5e-6}, "inter_node": {"latency_s": 1e-5}},
                          "nodes": [{"device": slow, "ranks": list(range(per_node))},
                                    {"device": fast, "ranks": list(range(per_node, 2 * per_node))}]})


def test_rank_order_is_the_runtimes_and_fast_first_gives_blocks_of_like_devices() -> None:
    c = _two_nodes()
    assert place(c, 1, 4, 2, DeviceOrder.RANK_ORDER) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert place(c, 1, 4, 2, DeviceOrder.FAST_FIRST) == ((4, 5), (6, 7), (0, 1), (2, 3))
    assert place(c, 1, 4, 2, DeviceOrder.SLOW_FIRST) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert place(c, 2, 2, 2, DeviceOrder.FAST_FIRST) == ((4, 5, 6, 7), (0, 1, 2, 3))
    with pytest.raises(ConfigError, match="tp·pp·dp"):
        place(c, 2, 2, 1, DeviceOrder.RANK_ORDER)


def test_a_placement_that_splits_a_tensor_parallel_group_over_nodes_is_dropped() -> None:
    c = parse_cluster({"links": {"intra_node": {"latency_s": 0}, "inter_node": {"latency_s": 0}},
                       "nodes": [{"device": "a100-80gb", "ranks": [0, 1, 2]},
                                 {"device": "h100-80gb", "ranks": [3]}]})
    assert place(c, 2, 2, 1, DeviceOrder.RANK_ORDER) is None  # (2, 3) straddles the nodes
    assert place(c, 1, 4, 1, DeviceOrder.FAST_FIRST) == ((3,), (0,), (1,), (2,))


def test_speed_layout_balances_compute_with_the_ends_counted() -> None:
    # rank 0 twice as fast: it takes about twice the layers, minus the embedding's place
    layout = speed_layout(30, (0, 1), (1.0, 2.0), end_layers=0.0)
    assert layout == (20, 10)
    n0, n1 = speed_layout(30, (0, 1), (1.0, 2.0), end_layers=1.0) or (0, 0)
    assert n0 + n1 == 30 and max(1.0 + n0, 2.0 * (1 + n1)) == 22.0  # the least largest load (21+1 or 2·(10+1))
    assert speed_layout(8, (0, 1, 2, 3), (1.0,) * 4, end_layers=0.0) == (2, 2, 2, 2)
    halfway = speed_layout(30, (0, 1), (1.0, 4.0), alpha=0.5, end_layers=0.0)
    assert halfway is not None and halfway[0] < speed_layout(30, (0, 1), (1.0, 4.0), end_layers=0.0)[0]
    assert speed_layout(3, (0, 1, 0, 1), (1.0, 1.0)) is None
    # interleaved: a rank's layers are spread over its stages
    assert speed_layout(12, (0, 1, 0, 1), (1.0, 2.0), end_layers=0.0) == (4, 2, 4, 2)


def test_the_source_of_a_placement_paces_each_rank_by_its_slowest_device_and_links_by_class() -> None:
    c = _two_nodes()
    model = model_preset("gpt3-1.3b")
    src = placed_source(model, c, place(c, 1, 4, 2, DeviceOrder.RANK_ORDER), tp=1)  # every group mixes a100 and h100
    assert {s.hardware.name for s in src.sources} == {"a100-80gb"}
    fast = placed_source(model, c, place(c, 1, 4, 2, DeviceOrder.FAST_FIRST), tp=1)
    assert [s.hardware.name for s in fast.sources] == ["h100-80gb", "h100-80gb", "a100-80gb", "a100-80gb"]
    cfg = __import__("evenpipe.cost", fromlist=["ParallelConfig"]).ParallelConfig(pp=4, dp=2, global_batch=16)
    assert fast.link(cfg, 0, 1).latency_s == 5e-6 and fast.link(cfg, 1, 2).latency_s == 1e-5
    slowed = placed_source(model, c.slowed(5, 2.0), place(c, 1, 4, 2, DeviceOrder.FAST_FIRST), tp=1)
    assert slowed.sources[0].hardware.name == "h100-80gb x0.5"


def test_heterogeneity_aware_plan_is_at_least_1_2x_the_best_that_treats_devices_alike() -> None:
    """Issue 35's acceptance on examples/mixed_a100_h100.json (8 A100 + 8 H100, a 13B model), simulated."""
    model, cluster = model_preset("gpt3-13b"), load_cluster(MIXED)
    aware = search_cluster(model, cluster, global_batch=128, top_k=1).best
    alike = search_cluster(model, cluster, global_batch=128, top_k=1, aware=False).best
    assert alike.order is DeviceOrder.RANK_ORDER and alike.config.layout is None  # even layers, runtime order
    assert alike.step_time_s / aware.step_time_s >= 1.2
    # the figures are the one estimate's on the cluster, as `estimate --cluster` recomputes them
    for p in (aware, alike):
        again = estimate_with(placed_source(model, cluster, p.groups, tp=p.config.tp), p.config)
        assert again.step_time_s == pytest.approx(p.step_time_s, rel=1e-12) and again.fits


def test_on_a_cluster_of_alike_devices_the_aware_search_is_the_plain_one() -> None:
    c = parse_cluster({"links": {"intra_node": {"latency_s": 5e-6}},
                       "nodes": [{"device": "a100-80gb", "ranks": [0, 1, 2, 3]}]})
    model = model_preset("gpt3-1.3b")
    aware = search_cluster(model, c, global_batch=16, top_k=3)
    alike = search_cluster(model, c, global_batch=16, top_k=3, aware=False)
    assert [p.step_time_s for p in aware.candidates] == [p.step_time_s for p in alike.candidates]
    assert aware.num_searches == alike.num_searches


def test_a_rank_gets_no_more_layers_than_its_memory_holds_the_states_of() -> None:
    assert speed_layout(30, (0, 1), (1.0, 4.0), end_layers=0.0) == (24, 6)
    assert speed_layout(30, (0, 1), (1.0, 4.0), end_layers=0.0, max_layers=(20, 30)) == (20, 10)
    assert speed_layout(30, (0, 1), (1.0, 4.0), max_layers=(10, 10)) is None
    small = parse_cluster({"links": {"intra_node": {"latency_s": 0}, "inter_node": {"latency_s": 0}},
                           "nodes": [{"device": "h100-80gb", "memory_gib": 10, "ranks": [0]},
                                     {"device": "a100-80gb", "ranks": [1]}]})
    model = model_preset("gpt3-1.3b")  # 24 layers of ~0.85 GiB of states each (Megatron's 18 bytes a parameter)
    src = placed_source(model, small, place(small, 1, 2, 1, DeviceOrder.FAST_FIRST), tp=1)
    from evenpipe.cost import ParallelConfig
    from evenpipe.plan.hetero import balanced_layouts, layer_caps
    cfg = ParallelConfig(pp=2, global_batch=8)
    caps = layer_caps(src, cfg)
    assert caps[0] < 12 < caps[1]
    layouts = balanced_layouts(src, cfg)
    assert layouts and all(layout[0] == caps[0] for layout in layouts)  # it would take more; its memory holds fewer


def test_the_data_parallel_reduction_runs_over_the_slowest_link_between_the_replicas() -> None:
    from evenpipe.cost import ParallelConfig
    from evenpipe.cost.source import Holding
    c = parse_cluster({"links": {"intra_node": {"latency_s": 5e-6, "bandwidth_gb_per_s": 300},
                                 "inter_node": {"latency_s": 1e-5, "bandwidth_gb_per_s": 25}},
                       "nodes": [{"device": "a100-80gb", "ranks": list(range(8))},
                                 {"device": "a100-80gb", "ranks": list(range(8, 16))}]})
    model = model_preset("gpt3-1.3b")
    cfg = ParallelConfig(pp=8, dp=2, global_batch=16)
    within = placed_source(model, c, [(2 * r, 2 * r + 1) for r in range(8)], tp=1)  # both replicas in one node
    across = placed_source(model, c, place(c, 1, 8, 2, DeviceOrder.RANK_ORDER) or (), tp=1)  # r and r + 8
    held = Holding(layers=3)
    assert within.reduce_time(cfg, 0, held) < across.reduce_time(cfg, 0, held) / 5  # 300 against 25 GB/s
    # one replica's source reduces over the links to the other replicas' devices (its peers)
    one = placed_source(model, c, [(r,) for r in range(8)], tp=1, peers=[(r, r + 8) for r in range(8)])
    assert one.reduce_time(cfg, 0, held) == across.reduce_time(cfg, 0, held)
