"""The planner's search space and its step-time lower bound (no simulation needed)."""

from __future__ import annotations

import pytest

from evenpipe.cost import ParallelConfig, Recompute, hardware_preset, model_preset
from evenpipe.errors import ConfigError
from evenpipe.plan.bounds import PipelineBounds, pipeline_bounds, stage_layout
from evenpipe.plan.search import SearchSpace, enumerate_configs
from evenpipe.schedule import ScheduleFamily
from evenpipe.sim.costs import Link, SimCosts, StageCosts

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


def _bounds(costs: SimCosts, layout: tuple[int, ...], m: int, *, recompute: bool = False,
            split: bool = False) -> PipelineBounds:
    return pipeline_bounds(costs, layout, m, recompute=recompute, split_backward=split)


def test_makespan_bound_is_exact_for_uniform_1f1b() -> None:
    p, m = 4, 8
    b = _bounds(SimCosts.uniform(num_stages=p, forward=1.0, backward=2.0), tuple(range(p)), m)
    assert b.makespan == pytest.approx((m + p - 1) * 3.0)
    assert b.first_rank_end == pytest.approx(b.makespan)  # rank 0 finishes last in 1F1B
    assert b.rank_hideable == pytest.approx((2.0,) * p)


def test_bounds_count_recompute_weight_grad_and_chunks() -> None:
    p, v, m = 2, 2, 4
    costs = SimCosts.uniform(num_stages=p * v, num_chunks=v, forward=1.0, backward=2.0, weight=1.0)
    layout = stage_layout(ScheduleFamily.INTERLEAVED, p, v)
    assert layout == (0, 1, 0, 1)
    # last rank: stage 0's forward (0.5) and input-gradient (1.0) bracket m * (F + B + W) = 4 * 4
    assert _bounds(costs, layout, m).makespan == pytest.approx(0.5 + 16 + 1.0)
    # recomputation adds one forward per micro-batch and stage
    assert _bounds(costs, layout, m, recompute=True).makespan == pytest.approx(0.5 + 20 + 1.0)
    # split backward: rank 0 may run its trailing W after the last input gradient, so rank 1's W do not count
    split = _bounds(costs, layout, m, split=True)
    assert split.first_rank_end == pytest.approx(max(16.0, 0.5 + 4 * 3 + 1.0))
    assert split.makespan == pytest.approx(max(0.5 + 16.0, split.first_rank_end))


def test_bounds_take_the_slowest_rank() -> None:
    slow = StageCosts(forward=5.0, backward_input=5.0)
    fast = StageCosts(forward=1.0, backward_input=1.0)
    costs = SimCosts.from_stages([fast, slow, fast])
    # rank 1: stage 0 forward 1 + 3 * 10 + stage 0 input-grad 1
    assert _bounds(costs, (0, 1, 2), 3).makespan == pytest.approx(32.0)


def test_bounds_count_the_messages_on_the_chain() -> None:
    p, m = 3, 4
    link = Link(latency_s=0.25, bandwidth_bytes_per_s=4.0)
    costs = SimCosts.uniform(num_stages=p, forward=1.0, backward=2.0, output_bytes=2.0, link=link)
    # two hops of 0.25 + 2/4 = 0.75 s each way, on top of (m + p - 1)(F + B)
    assert _bounds(costs, tuple(range(p)), m).makespan == pytest.approx((m + p - 1) * 3.0 + 4 * 0.75)
    # stages on one rank exchange no messages
    one_rank = SimCosts.uniform(num_stages=1, forward=1.0, backward=2.0, output_bytes=2.0, link=link)
    assert _bounds(one_rank, (0,), m).makespan == pytest.approx(m * 3.0)
