"""Stage partitioning: explicit and balanced layouts, refused layouts, interleaved chunks, stage modules."""

from __future__ import annotations

import itertools

import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.models import build_model, model_config
from evenpipe.runtime.stages import build_stage_modules, param_count, partition_layers


def test_explicit_layout() -> None:
    assert partition_layers(22, 4, layout=[5, 6, 6, 5]) == (range(0, 5), range(5, 11), range(11, 17), range(17, 22))


def test_interleaved_layout_is_per_chunk() -> None:
    # 2 ranks x 2 virtual chunks = 4 stages in pipeline order; rank placement is the schedule's business
    ranges = partition_layers(8, 4, layout=[1, 3, 3, 1])
    assert ranges == (range(0, 1), range(1, 4), range(4, 7), range(7, 8))
    with pytest.raises(ConfigError, match="has 2 entries but there are 4 stages"):
        partition_layers(8, 4, layout=[4, 4])


@pytest.mark.parametrize(("layout", "match"), [
    ([2, 2, 2], "places 6 layers but the model has 8 \\(it drops 2\\)"),
    ([3, 3, 3], "places 9 layers but the model has 8 \\(it duplicates 1\\)"),
    ([4, 0, 4], "has a stage with 0 layers"),
    ([5, -1, 4], "has a stage with -1 layers"),
    ([4, 4], "has 2 entries but there are 3 stages"),
])
def test_bad_layouts_are_refused(layout: list[int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        partition_layers(8, 3, layout=layout)


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ConfigError, match="5 stages need at least 5 blocks"):
        partition_layers(4, 5)
    with pytest.raises(ConfigError, match="num_stages must be a positive integer"):
        partition_layers(4, 0)


@pytest.mark.parametrize(("blocks", "stages"), [(8, 4), (10, 4), (7, 3), (5, 5), (9, 1)])
def test_balanced_uniform_covers_every_block_once_and_evenly(blocks: int, stages: int) -> None:
    ranges = partition_layers(blocks, stages)
    assert [i for r in ranges for i in r] == list(range(blocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _max_weight_brute_force(weights: list[float], stages: int, first: float, last: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(weights)), stages - 1):
        bounds = (0, *cuts, len(weights))
        loads = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_by_weights_minimises_the_heaviest_stage(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.rand(9, generator=gen) * 10).tolist()
    first, last = float(torch.rand(1, generator=gen) * 10), float(torch.rand(1, generator=gen) * 10)
    ranges = partition_layers(9, 4, block_weights=weights, first_weight=first, last_weight=last)
    loads = [sum(weights[i] for i in r) for r in ranges]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_max_weight_brute_force(weights, 4, first, last))


def test_heavy_ends_get_fewer_blocks() -> None:
    ranges = partition_layers(12, 4, block_weights=[1.0] * 12, first_weight=2.0, last_weight=2.0)
    assert [len(r) for r in ranges][0] < 4 and [len(r) for r in ranges][-1] < 4


def test_bad_weights() -> None:
    with pytest.raises(ConfigError, match="block_weights has 3 entries for 4 blocks"):
        partition_layers(4, 2, block_weights=[1, 1, 1])
    with pytest.raises(ConfigError, match="must be >= 0"):
        partition_layers(4, 2, block_weights=[1, -1, 1, 1])


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize(("num_stages", "layout"), [(2, None), (4, None), (4, [1, 3, 3, 1]), (3, [2, 3, 3])])
def test_stage_modules_compose_to_the_full_model(name: str, num_stages: int, layout: list[int] | None) -> None:
    model = build_model(model_config(name, num_layers=8), seed=0)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=num_stages, stages=range(num_stages),
                                 layout=layout)
    assert sorted(stages) == list(range(num_stages))
    assert stages[0].is_first and not stages[0].is_last
    assert stages[num_stages - 1].is_last and not stages[num_stages - 1].is_first
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = tokens
        for s in range(num_stages):
            x = stages[s](x)
        torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)
    # parameters are shared with the model and every parameter is in exactly one stage (a tied embedding is
    # in the first and the last)
    stage_params = [id(p) for s in stages.values() for p in s.parameters()]
    tied = 1 if model.cfg.tied_embeddings else 0
    assert len(stage_params) == len(set(stage_params)) + tied
    assert set(stage_params) == {id(p) for p in model.parameters()}
    if layout is not None:
        assert [len(stages[s].layers) for s in range(num_stages)] == layout


def test_only_requested_stages_are_built() -> None:
    model = build_model(model_config("gpt-tiny", num_layers=8), seed=0)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=4, stages=[1, 3])
    assert sorted(stages) == [1, 3]
    assert stages[1].first is None and stages[1].last is None and stages[3].last is model.last
    with pytest.raises(ConfigError, match="stage id 4 is out of range"):
        build_stage_modules(model.pipeline_parts(), num_stages=4, stages=[4])


def test_default_split_balances_parameters() -> None:
    # a big vocabulary makes the embedding and head heavy: the end stages get fewer blocks
    model = build_model(model_config("gpt-tiny", num_layers=12, vocab=4096), seed=0)
    parts = model.pipeline_parts()
    stages = build_stage_modules(parts, num_stages=4, stages=range(4))
    sizes = [len(stages[s].layers) for s in range(4)]
    assert sum(sizes) == 12 and sizes[0] < sizes[1] and sizes[3] < sizes[2]
    loads = [param_count(stages[s]) for s in range(4)]
    even = build_stage_modules(parts, num_stages=4, stages=range(4), layout=[3, 3, 3, 3])
    assert max(loads) < max(param_count(even[s]) for s in range(4))
