"""Host offload's exposed reloads (:mod:`evenpipe.plan.reload_bound`): which reloads the bound counts, and that the
step-time bound with them stays below the estimate while closing most of the gap offload opens."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import Attention, ParallelConfig, Recompute, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions, TrainPrecision
from evenpipe.cost.timing import Efficiency
from evenpipe.plan.bounds import offload_bound, step_bound
from evenpipe.plan.reload_bound import exposed_reloads
from evenpipe.schedule import ActionKind, ScheduleFamily, add_offload, add_recompute, compute_order

A100 = hardware_preset("a100-80gb")


@pytest.mark.parametrize("m", [8, 16])
@pytest.mark.parametrize("family", [ScheduleFamily.ONE_F_ONE_B, ScheduleFamily.ZB_H1])
def test_one_f_one_b_exposes_its_cool_down(family: ScheduleFamily, m: int) -> None:
    """In 1F1B's steady state each reload hides behind a forward; in the cool-down rank r runs p-1-r backwards
    with no forward between them, whatever m: those reloads are exposed (the last rank offloads nothing)."""
    for recompute in (False, True):
        assert [len(row) for row in exposed_reloads(family, 4, m, 1, None, recompute)] == [3, 2, 1, 0]


def _placed(family: ScheduleFamily, p: int, m: int, v: int, plan: tuple[int, int, int] | None,
            recompute: bool) -> list[list[int]]:
    """The reloads ``add_offload`` places right before their use (no compute between), per rank."""
    compute = compute_order(family, num_ranks=p, num_microbatches=m, num_chunks=v, plan_durations=plan)
    if recompute:
        compute = add_recompute(compute)
    out = []
    for row in add_offload(compute, prefetch=True).actions:
        stages, pending = [], set()
        for a in row:
            if a.kind is ActionKind.RELOAD:
                pending.add(a.key)
            elif a.kind.is_compute:
                if a.key in pending:
                    stages.append(a.stage)
                pending = set()
        out.append(stages)
    return out


@pytest.mark.parametrize("family,v,plan", [
    (ScheduleFamily.ONE_F_ONE_B, 1, None), (ScheduleFamily.INTERLEAVED, 2, None),
    (ScheduleFamily.INTERLEAVED, 3, None), (ScheduleFamily.ZB_H1, 1, None), (ScheduleFamily.ZB_V, 2, None),
    (ScheduleFamily.V_HALF, 2, (2, 2, 1)), (ScheduleFamily.V_MIN, 2, (2, 3, 1)), (ScheduleFamily.GPIPE, 1, None)])
def test_the_count_follows_add_offload(family: ScheduleFamily, v: int, plan: tuple[int, int, int] | None) -> None:
    """The bound counts on the action columns what ``add_offload`` places in the actions: the same reloads."""
    for p, m in ((4, 8), (4, 12), (3, 6)):
        for recompute in (False, True):
            got = [list(row) for row in exposed_reloads(family, p, m, v, plan, recompute)]
            assert got == _placed(family, p, m, v, plan, recompute), (p, m, recompute)
            assert any(got)


def test_the_bound_prices_the_exposed_reloads() -> None:
    """gpt3-175b, interleaved with 4 micro-batches of 6 over 4 ranks: every backward after the first waits for its
    reload; the step bound without them is 18% below the estimate, the offload bound within 8% and still below."""
    model = model_preset("gpt3-175b")
    source = AnalyticSource(model, A100, Efficiency(),
                            conventions=RuntimeConventions(runtime=Runtime.EVENPIPE, dtype=TrainPrecision.BFLOAT16))
    plain = ParallelConfig(tp=4, pp=4, dp=64, chunks=8, microbatch_size=6, global_batch=1536,
                           recompute=Recompute.NONE, sequence_parallel=True, attention=Attention.FLASH,
                           schedule=ScheduleFamily.INTERLEAVED, distributed_optimizer=True)
    for k in range(1, 5):
        cfg = dataclasses.replace(plain, offload_ranks=k)
        bound, est = offload_bound(source, cfg), estimate_with(source, cfg).step_time_s
        assert step_bound(source, cfg) == step_bound(source, plain) < 0.85 * est
        assert 0.92 * est < bound <= est
