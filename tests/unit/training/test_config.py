"""The typed training config: each slice refuses bad values with one line, and the whole config survives its
one serialisation (JSON) unchanged."""

from __future__ import annotations

import json

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import ScheduleFamily
from evenpipe.training.config import (Backend, DataOptions, DataSource, ModelOptions, OptimizerOptions,
                                      OutputOptions, RuntimeOptions, ScheduleOptions, TrainConfig)


def _config() -> TrainConfig:
    return TrainConfig(
        model=ModelOptions(preset="llama-tiny", seq_len=16, init_seed=3),
        schedule=ScheduleOptions(family="bpipe", num_ranks=4, num_microbatches=4, layout=[1, 1, 1, 1]),
        data=DataOptions(source="random", seed=5, global_batch=8),
        optimizer=OptimizerOptions(lr=3e-4),
        runtime=RuntimeOptions(steps=2, dp=2, backend="gloo", timeout_s=12.5),
        output=OutputOptions(metrics="/tmp/m.jsonl"),
    )


def test_strings_are_parsed_once_into_enums_and_tuples() -> None:
    c = _config()
    assert c.schedule.family is ScheduleFamily.BPIPE and c.runtime.backend is Backend.GLOO
    assert c.data.source is DataSource.RANDOM and c.schedule.layout == (1, 1, 1, 1)
    assert c.world_size == 8 and c.seq_len == 16


def test_json_round_trip_is_exact() -> None:
    c = _config()
    text = c.to_json()
    assert json.loads(text)["schedule"]["family"] == "bpipe"
    assert TrainConfig.from_json(text) == c


BAD = {
    "negative lr": (lambda: OptimizerOptions(lr=-1.0), "--lr must be a finite number > 0"),
    "zero steps": (lambda: RuntimeOptions(steps=0), "--steps must be >= 1"),
    "infinite timeout": (lambda: RuntimeOptions(timeout_s=float("inf")), "--timeout"),
    "unknown backend": (lambda: RuntimeOptions(backend="mpi"), "unknown backend 'mpi'"),
    "unknown schedule": (lambda: ScheduleOptions(family="zigzag"), "unknown schedule 'zigzag'"),
    "bpipe on one rank": (lambda: ScheduleOptions(family="bpipe", num_ranks=1), "needs --stages >= 2"),
    "path with random data": (lambda: DataOptions(source="random", path="/x"), "drop one of them"),
    "unknown preset": (lambda: TrainConfig(model=ModelOptions(preset="nope")), "unknown model 'nope'"),
    "batch not divisible": (lambda: TrainConfig(data=DataOptions(global_batch=12)), "not divisible"),
    "unknown section": (lambda: TrainConfig.from_dict({"modle": {}}), "unknown training config section"),
}


@pytest.mark.parametrize("make,needle", list(BAD.values()), ids=list(BAD))
def test_bad_values_are_one_line_config_errors(make, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_plan_link_latency_orders_latency_aware_for_slow_links() -> None:
    """--plan-link-latency: latency-aware's order for every link that slow; a warning on another family, one line
    for a bad value."""
    import warnings

    from evenpipe.schedule import LinkPlan, build_schedule
    opts = ScheduleOptions(family="latency-aware", num_ranks=4, num_microbatches=8, link_latency=1.0)
    want = build_schedule("latency-aware", num_ranks=4, num_microbatches=8, num_chunks=1,
                          link_plan=LinkPlan.uniform(num_ranks=4, latency=1.0))
    assert opts.build().actions == want.actions
    assert opts.build().actions != ScheduleOptions(family="latency-aware", num_ranks=4, num_microbatches=8).build().actions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ScheduleOptions(family="1f1b", num_ranks=4, num_microbatches=8, link_latency=0.5)
    assert any("--plan-link-latency has no effect" in str(w.message) for w in caught)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--plan-link-latency must be a finite number >= 0"):
            ScheduleOptions(family="latency-aware", num_ranks=4, num_microbatches=8, link_latency=bad)
