"""The planner's search space and its step-time lower bound (no simulation needed)."""

from __future__ import annotations

import pytest

from evenpipe.cost import ParallelConfig, Recompute, hardware_preset, model_preset
from evenpipe.errors import ConfigError
from evenpipe.plan.search import SearchSpace, enumerate_configs, step_time_lower_bound
from evenpipe.schedule import ScheduleFamily
from evenpipe.sim.costs import SimCosts, StageCosts

A100 = hardware_preset("a100-80gb")


def _configs(name: str = "gpt-1.7b", gpus: int = 32, batch: int = 64, **space: object) -> list[ParallelConfig]:
    return list(enumerate_configs(model_preset(name), A100, num_gpus=gpus, global_batch=batch,
                                  space=SearchSpace(**space)))  # type: ignore[arg-type]


def test_every_config_uses_all_gpus_and_divides_the_batch() -> None:
    cfgs = _configs()
    assert cfgs
    for c in cfgs:
        assert c.tp * c.pp * c.dp == 32
        assert 64 % (c.dp * c.microbatch_size) == 0
        assert c.tp <= A100.gpus_per_node and 24 % c.tp == 0
        assert c.microbatch_size <= 16


def test_no_duplicates_and_known_configs_present() -> None:
    cfgs = _configs()
    assert len(cfgs) == len(set(cfgs))
    keys = {(c.tp, c.pp, c.dp, c.chunks, c.microbatch_size, c.recompute, c.schedule) for c in cfgs}
    assert (8, 4, 1, 1, 2, Recompute.FULL, ScheduleFamily.BPIPE) in keys
    assert (2, 4, 4, 3, 1, Recompute.NONE, ScheduleFamily.INTERLEAVED) in keys  # 24 layers / 4 = 6, v=3
    assert (1, 1, 32, 1, 2, Recompute.SELECTIVE, ScheduleFamily.ONE_F_ONE_B) in keys


def test_schedule_rules() -> None:
    for c in _configs():
        if c.pp == 1:
            assert c.schedule is ScheduleFamily.ONE_F_ONE_B
        if c.schedule is ScheduleFamily.BPIPE:
            assert c.pp >= 3 and c.chunks == 1
        if c.schedule is ScheduleFamily.INTERLEAVED:
            assert c.chunks >= 2 and (24 // c.pp) % c.chunks == 0
        else:
            assert c.chunks == 1


def test_space_restrictions_are_honoured() -> None:
    cfgs = _configs(schedules=(ScheduleFamily.ZB_H1,), recomputes=(Recompute.NONE,), max_microbatch_size=2,
                    max_tp=2)
    assert cfgs
    assert {c.schedule for c in cfgs} <= {ScheduleFamily.ZB_H1, ScheduleFamily.ONE_F_ONE_B}
    assert all(c.recompute is Recompute.NONE and c.microbatch_size <= 2 and c.tp <= 2 for c in cfgs)
    assert all(c.schedule is ScheduleFamily.ONE_F_ONE_B for c in cfgs if c.pp == 1)


def test_sequence_parallel_only_with_tp() -> None:
    for c in _configs():
        assert c.sequence_parallel == (c.tp > 1)


@pytest.mark.parametrize("bad", [dict(schedules=()), dict(recomputes=()), dict(max_microbatch_size=0),
                                 dict(max_chunks=1), dict(max_tp=0)])
def test_bad_space_is_a_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SearchSpace(**bad)  # type: ignore[arg-type]


def test_lower_bound_is_exact_for_uniform_1f1b() -> None:
    p, m = 4, 8
    costs = SimCosts.uniform(num_stages=p, forward=1.0, backward=2.0)
    lb = step_time_lower_bound(costs, tuple(range(p)), m, recompute=False)
    assert lb == pytest.approx((m + p - 1) * 3.0)


def test_lower_bound_counts_recompute_and_weight_grad_and_chunks() -> None:
    p, v, m = 2, 2, 4
    costs = SimCosts.uniform(num_stages=p * v, num_chunks=v, forward=1.0, backward=2.0, weight=1.0)
    layout = tuple(s % p for s in range(p * v))
    # last rank: stage 0's forward (0.5) and input-gradient (1.0) bracket m * (F + B + W) = 4 * 4
    assert step_time_lower_bound(costs, layout, m, recompute=False) == pytest.approx(0.5 + 16 + 1.0)
    # recomputation adds one forward per micro-batch and stage
    assert step_time_lower_bound(costs, layout, m, recompute=True) == pytest.approx(0.5 + 20 + 1.0)


def test_lower_bound_takes_the_slowest_rank() -> None:
    slow = StageCosts(forward=5.0, backward_input=5.0)
    fast = StageCosts(forward=1.0, backward_input=1.0)
    costs = SimCosts.from_stages([fast, slow, fast])
    # rank 1: stage 0 forward 1 + 3 * 10 + stage 0 input-grad 1
    assert step_time_lower_bound(costs, (0, 1, 2), 3, recompute=False) == pytest.approx(32.0)
