"""A cost source per pipeline rank (mixed devices) through the one estimate, bounds and search."""

from __future__ import annotations

import pytest

from evenpipe.cost import Attention, ParallelConfig, Recompute, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.rank_sources import RankSources
from evenpipe.errors import ConfigError
from evenpipe.plan import SearchSpace, Searcher, step_bound, work_bound

GPT = model_preset("gpt-1.7b")
A100, H100 = hardware_preset("a100-80gb"), hardware_preset("h100-80gb")
A100_40 = hardware_preset("a100-40gb")
CFG = ParallelConfig(tp=2, pp=4, dp=1, microbatch_size=2, global_batch=32, recompute=Recompute.SELECTIVE)


def _mixed(*hws: object) -> RankSources:
    return RankSources(tuple(AnalyticSource(GPT, hw) for hw in hws))  # type: ignore[arg-type]


def test_the_same_source_on_every_rank_is_that_source() -> None:
    for cfg in (CFG, ParallelConfig(pp=4, global_batch=16, schedule=ScheduleFamily.BPIPE),
                ParallelConfig(pp=4, chunks=2, global_batch=16, schedule=ScheduleFamily.INTERLEAVED)):
        plain, per_rank = estimate_with(AnalyticSource(GPT, A100), cfg), estimate_with(_mixed(*[A100] * 4), cfg)
        assert per_rank.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12)
        assert per_rank.memory_per_stage_gib == plain.memory_per_stage_gib
        assert per_rank.hardware is A100 and per_rank.source_name == "ranks 0-3: a100-80gb"


def test_mixed_devices_lie_between_the_uniform_ones() -> None:
    fast, slow = estimate_with(_mixed(*[H100] * 4), CFG), estimate_with(_mixed(*[A100] * 4), CFG)
    mixed = estimate_with(_mixed(H100, H100, A100, A100), CFG)
    assert fast.step_time_s < mixed.step_time_s < slow.step_time_s
    assert mixed.hardware is None and "ranks 2-3: a100-80gb" in mixed.source_name
    assert step_bound(_mixed(H100, H100, A100, A100), CFG) <= mixed.step_time_s
    assert work_bound(_mixed(A100, A100, H100, H100), CFG) <= step_bound(_mixed(A100, A100, H100, H100), CFG)


def test_each_rank_has_its_own_memory() -> None:
    big = ParallelConfig(pp=4, microbatch_size=4, global_batch=64, attention=Attention.EAGER)  # rank 0: 68 GiB
    est = estimate_with(_mixed(A100_40, A100, A100, A100), big)
    assert A100_40.usable_memory_gib < est.memory_per_stage_gib[0] < A100.usable_memory_gib
    assert not est.fits and est.limited_by == "memory"  # rank 0 overflows its smaller device
    assert estimate_with(_mixed(A100, A100, A100, A100_40), big).fits  # the last rank holds the least


def test_search_over_a_source_per_rank() -> None:
    source = _mixed(H100, H100, A100, A100)
    result = Searcher.over(source).search(num_gpus=8, global_batch=32, top_k=5,
                                          space=SearchSpace(schedules=(ScheduleFamily.ONE_F_ONE_B,),
                                                            max_microbatch_size=4))
    assert result.candidates and all(c.config.pp == 4 for c in result.candidates)
    for c in result.candidates:
        assert step_bound(source, c.config) <= c.step_time_s
        assert c.estimate.step_time_s == estimate_with(source, c.config).step_time_s


def test_one_model_and_one_set_of_conventions() -> None:
    with pytest.raises(ConfigError, match="model"):
        RankSources((AnalyticSource(GPT, A100), AnalyticSource(model_preset("gpt-3.6b"), A100)))
    with pytest.raises(ConfigError, match="pp 2"):
        _mixed(A100, A100, A100, A100).check(ParallelConfig(pp=2, global_batch=8))
