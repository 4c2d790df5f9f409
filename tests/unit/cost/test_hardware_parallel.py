"""Hardware presets, ParallelConfig and check_config's one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import (HARDWARE_PRESETS, Attention, ParallelConfig, Recompute, ScheduleFamily, check_config,
                           hardware_preset, model_preset)
from evenpipe.errors import ConfigError

A100 = hardware_preset("a100-80gb")
GPT3 = model_preset("gpt3-175b")


def test_hardware_presets_and_override() -> None:
    assert set(HARDWARE_PRESETS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200"}
    assert A100.peak_tflops == 312.0 and hardware_preset("h100-80gb").peak_tflops == 989.0
    slow = dataclasses.replace(A100, internode_gbps=12.5)
    assert slow.internode_gbps == 12.5 and slow.memory_gib == 80.0
    with pytest.raises(ConfigError, match="tpu-v5"):
        hardware_preset("tpu-v5")
    with pytest.raises(ConfigError, match="peak_tflops"):
        dataclasses.replace(A100, peak_tflops=0.0)


def test_enums_parse_at_the_edge() -> None:
    assert Recompute.parse("FULL") is Recompute.FULL
    assert Attention.parse("eager") is Attention.EAGER
    with pytest.raises(ConfigError, match="none, selective, full"):
        Recompute.parse("some")


def test_derived_counts() -> None:
    cfg = ParallelConfig(tp=8, pp=8, dp=16, microbatch_size=2, global_batch=1536)
    assert cfg.num_microbatches == 48 and cfg.num_gpus == 1024 and cfg.num_stages == 8


def _cfg(**kw: object) -> ParallelConfig:
    base: dict[str, object] = dict(tp=8, pp=8, dp=16, global_batch=1536)
    base.update(kw)
    return ParallelConfig(**base)  # type: ignore[arg-type]


def test_valid_config_passes() -> None:
    check_config(GPT3, A100, _cfg(), num_gpus=1024)
    check_config(GPT3, A100, _cfg(chunks=3, schedule=ScheduleFamily.INTERLEAVED), num_gpus=1024)


@pytest.mark.parametrize("cfg,gpus,needle", [
    (_cfg(), 512, "--gpus 512"),
    (_cfg(tp=5, dp=16), None, "tp 5"),
    (_cfg(layout=(12,) * 7 + (11,)), None, "places 95 layers but the model has 96 (it drops 1)"),
    (_cfg(chunks=13, schedule=ScheduleFamily.INTERLEAVED), None, "pp·chunks"),
    (_cfg(chunks=2), None, "chunks 2 is not allowed for schedule 1f1b"),
    (_cfg(global_batch=1000), None, "global batch 1000"),
    (_cfg(tp=16, dp=8), None, "tp 16"),
    (_cfg(pp=1, dp=128, schedule=ScheduleFamily.BPIPE), None, "bpipe needs pp >= 2"),
])
def test_bad_configs_raise_one_line(cfg: ParallelConfig, gpus: int | None, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_config(GPT3, A100, cfg, num_gpus=gpus)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parallel_config_rejects_non_positive() -> None:
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        ParallelConfig(tp=0, global_batch=8)


def test_load_hardware_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from evenpipe.cost import load_hardware

    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "h100-80gb", "name": "lab-h100", "internode_gbps": 40.0}))
    hw = load_hardware(path)
    assert (hw.name, hw.internode_gbps, hw.peak_tflops) == ("lab-h100", 40.0, 989.0)
    path.write_text(json.dumps({"base": "h100-80gb", "nvlink": 1}))
    with pytest.raises(ConfigError, match="unknown field"):
        load_hardware(path)
    path.write_text(json.dumps({"name": "x", "memory_gib": 16.0}))
    with pytest.raises(ConfigError, match="hardware profile"):
        load_hardware(path)


def test_default_layouts() -> None:
    from evenpipe.cost import end_lighter_layout, stage_layers
    from evenpipe.cost.parallel import balanced_layout, candidate_layouts
    assert end_lighter_layout(126, 16) == (7,) + (8,) * 14 + (7,)
    assert end_lighter_layout(96, 16) == (5, 7, 7) + (6,) * 12 + (5,)
    assert end_lighter_layout(4, 4) is None  # a stage would be empty
    assert balanced_layout(10, 4) == (2, 3, 3, 2)
    assert stage_layers(GPT3, _cfg()) == (12,) * 8
    assert stage_layers(GPT3, _cfg(pp=7, dp=16, tp=8)) == (13,) + (14,) * 5 + (13,)
    assert candidate_layouts(96, 8) == (None, (11, 13, 13, 12, 12, 12, 12, 11))
    assert candidate_layouts(126, 16) == (None,)
    for layers in range(2, 40):
        for stages in range(1, layers + 1):
            for layout in (end_lighter_layout(layers, stages), balanced_layout(layers, stages)):
                assert layout is None or (sum(layout) == layers and min(layout) >= 1), (layers, stages)
