"""estimate(): conventions (MFU/HFU, breakdown), simulation-based step time, links and fit to Megatron 2021."""

from __future__ import annotations

import dataclasses
import json

import pytest

from evenpipe.cost import (Attention, Efficiency, ParallelConfig, Recompute, ScheduleFamily, estimate,
                           executed_flops_per_step, hardware_preset, model_flops_per_step, model_preset,
                           stage_sim_costs)
from evenpipe.cost.fit import load_megatron_rows, predict_tflops
from evenpipe.cost.memory import build_cost_schedule
from evenpipe.sim import simulate

from cost_reference import reference_path

A100 = hardware_preset("a100-80gb")
GPT3 = model_preset("gpt3-175b")
CFG = ParallelConfig(tp=8, pp=8, dp=2, global_batch=64, recompute=Recompute.FULL, attention=Attention.EAGER)


@pytest.fixture(scope="module")
def est():  # type: ignore[no-untyped-def]
    return estimate(GPT3, A100, CFG)


def test_breakdown_sums_to_step_time(est) -> None:  # type: ignore[no-untyped-def]
    assert est.breakdown.total == pytest.approx(est.step_time_s, rel=1e-9)
    assert est.breakdown.recompute > 0 and est.breakdown.tp_comm > 0 and est.breakdown.bubble > 0


def test_mfu_and_hfu_conventions(est) -> None:  # type: ignore[no-untyped-def]
    denom = est.step_time_s * CFG.num_gpus * A100.peak_tflops * 1e12
    assert est.mfu == pytest.approx(model_flops_per_step(GPT3, 64) / denom, rel=1e-12)
    assert est.hfu == pytest.approx(executed_flops_per_step(GPT3, CFG) / denom, rel=1e-12)
    assert est.hfu > est.mfu
    assert est.tflops_per_gpu == pytest.approx(est.hfu * A100.peak_tflops, rel=1e-12)
    plain = estimate(GPT3, A100, dataclasses.replace(CFG, recompute=Recompute.SELECTIVE, sequence_parallel=True))
    assert plain.hfu > plain.mfu


def test_step_time_comes_from_the_simulated_schedule(est) -> None:  # type: ignore[no-untyped-def]
    trace = simulate(build_cost_schedule(CFG), stage_sim_costs(GPT3, A100, CFG))
    assert est.step_time_s == pytest.approx(trace.step_time + est.breakdown.dp_comm + est.breakdown.optimizer,
                                            rel=1e-12)
    assert est.bubble_fraction == pytest.approx(trace.bubble_fraction, rel=1e-12)


def test_to_dict_is_json_with_the_promised_keys(est) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(json.dumps(est.to_dict()))
    for key in ("step_time_s", "mfu", "hfu", "tflops_per_gpu", "bubble_fraction", "memory_per_stage_gib",
                "peak_memory_gib", "fits", "limited_by", "time_breakdown_s", "stage_memory_gib"):
        assert key in d
    assert len(d["memory_per_stage_gib"]) == 8 and d["peak_memory_gib"] == max(d["memory_per_stage_gib"])


def test_configuration_that_cannot_fit_says_so() -> None:
    e = estimate(GPT3, A100, ParallelConfig(tp=8, pp=1, dp=1, global_batch=8))
    assert not e.fits and e.limited_by == "memory" and e.peak_memory_gib > A100.memory_gib


def test_more_microbatches_shrink_the_bubble() -> None:
    small = estimate(GPT3, A100, dataclasses.replace(CFG, global_batch=32))
    large = estimate(GPT3, A100, dataclasses.replace(CFG, global_batch=256))
    assert large.bubble_fraction < small.bubble_fraction and large.mfu > small.mfu


def test_interleaving_beats_one_f_one_b_with_few_microbatches() -> None:
    base = dataclasses.replace(CFG, global_batch=32)
    inter = dataclasses.replace(base, chunks=3, schedule=ScheduleFamily.INTERLEAVED)
    assert estimate(GPT3, A100, inter).bubble_fraction < estimate(GPT3, A100, base).bubble_fraction


def test_data_parallel_reduction_is_partly_hidden() -> None:
    one = estimate(GPT3, A100, dataclasses.replace(CFG, dp=1, global_batch=32))
    many = estimate(GPT3, A100, dataclasses.replace(CFG, dp=16, global_batch=512))
    assert one.breakdown.dp_comm == 0 and many.breakdown.dp_comm > 0
    exposed = estimate(GPT3, A100, dataclasses.replace(CFG, dp=16, global_batch=512),
                       efficiency=Efficiency(dp_overlap=False))
    assert exposed.breakdown.dp_comm > many.breakdown.dp_comm


def test_bpipe_transfers_use_the_pair_link() -> None:
    m = model_preset("gpt-7.5b")
    # tp=1, pp=8: the whole pipeline sits in one node (NVLink); tp=8, pp=8: every pair crosses nodes.
    intra = ParallelConfig(tp=1, pp=4, global_batch=32, schedule=ScheduleFamily.BPIPE, attention=Attention.EAGER)
    inter = dataclasses.replace(intra, tp=8)
    ci, ce = stage_sim_costs(m, A100, intra), stage_sim_costs(m, A100, inter)
    assert ci.link(0, 3).bandwidth_bytes_per_s > ce.link(0, 3).bandwidth_bytes_per_s
    assert ci.link(0, 3).bandwidth_bytes_per_s == pytest.approx(A100.nvlink_gbps * 1e9 * Efficiency().nvlink_fraction)
    slow_hw = dataclasses.replace(A100, internode_gbps=1.0)
    slow = estimate(m, slow_hw, inter)
    assert slow.breakdown.bpipe_transfer > 0
    assert slow.step_time_s > estimate(m, slow_hw, dataclasses.replace(inter, schedule=ScheduleFamily.ONE_F_ONE_B)
                                       ).step_time_s


def test_last_stage_carries_the_head() -> None:
    costs = stage_sim_costs(GPT3, A100, CFG)
    assert len(costs.stages) == 8
    assert costs.stages[-1].forward > costs.stages[0].forward == costs.stages[3].forward
    assert costs.stages[0].checkpoint_bytes > 0 and costs.stages[0].activation_bytes > costs.stages[0].checkpoint_bytes


def test_faster_hardware_is_faster() -> None:
    h100 = hardware_preset("h100-80gb")
    assert estimate(GPT3, h100, CFG).step_time_s < estimate(GPT3, A100, CFG).step_time_s


def test_default_efficiency_reproduces_megatron_2021_within_five_percent() -> None:
    rows = load_megatron_rows(reference_path("megatron2021_weak_scaling.csv"))
    errors = [abs(predict_tflops(r, Efficiency()) / r.tflops_per_gpu - 1) for r in rows]
    assert sum(errors) / len(errors) <= 0.05
    assert max(errors) <= 0.15


@pytest.mark.parametrize("schedule,bpipe", [(ScheduleFamily.ONE_F_ONE_B, False), (ScheduleFamily.INTERLEAVED, True)])
def test_configurations_sharing_a_pipeline_simulate_it_once(monkeypatch: pytest.MonkeyPatch, schedule: ScheduleFamily,
                                                            bpipe: bool) -> None:
    """Twins differing in data parallelism's optimizer sharding run one schedule on one set of stage costs: the
    second estimate reuses the first one's simulated step, and equals its own estimate from scratch."""
    import importlib
    module = importlib.import_module("evenpipe.cost.estimate")
    base = ParallelConfig(tp=8, pp=4, dp=4, global_batch=64, chunks=2 if schedule is ScheduleFamily.INTERLEAVED else 1,
                          schedule=schedule, bpipe=bpipe, recompute=Recompute.SELECTIVE, distributed_optimizer=True)
    twin = dataclasses.replace(base, distributed_optimizer=False)
    runs = []
    real = module.simulate
    monkeypatch.setattr(module, "simulate", lambda *a, **k: runs.append(1) or real(*a, **k))
    module._pipelines.values.clear()
    first = estimate(GPT3, A100, base)
    shared = estimate(GPT3, A100, twin)
    assert len(runs) == 1
    module._pipelines.values.clear()
    fresh = estimate(GPT3, A100, twin)
    assert len(runs) == 2
    assert shared == fresh
    assert first.step_time_s != shared.step_time_s  # the twins do differ, in their data-parallel terms
