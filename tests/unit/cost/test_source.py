"""The cost source: the analytic and the profiled implementation answer the same questions, and the one estimate
over a source reproduces what each planner computed before (the analytic estimate, the profile's step)."""

from __future__ import annotations

import pytest

from evenpipe.cost import ParallelConfig, Recompute, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate, estimate_with
from evenpipe.cost.memory import stage_memory
from evenpipe.cost.profile_fit import ProfileModel, predict_step
from evenpipe.cost.profiled_source import ProfiledSource
from evenpipe.cost.parallel import stage_layers
from evenpipe.cost.source import CostSource, Holding, MicrobatchShape, shape_of
from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule

from test_profile_fit import make_profile

A100 = hardware_preset("a100-80gb")
GPT = model_preset("gpt-1.7b")
PROTOCOL = [n for n in dir(CostSource) if not n.startswith("_")]


def _sources() -> list[CostSource]:
    return [AnalyticSource(GPT, A100), ProfiledSource(ProfileModel(make_profile(layers=8)), memory_budget_gib=1.0)]


@pytest.mark.parametrize("source", _sources(), ids=["analytic", "profiled"])
def test_both_sources_answer_every_question(source: CostSource) -> None:
    assert len(PROTOCOL) >= 15
    cfg = ParallelConfig(pp=4, microbatch_size=2, global_batch=16)
    source.check(cfg)
    shape = MicrobatchShape(size=2, seq_len=source.model.seq_len)
    lt = source.layer_times(cfg, 1, shape)
    assert lt.forward > 0 and lt.backward_input > 0 and lt.recompute > 0
    act = source.layer_bytes(cfg, 1, shape)
    assert act.layer_saved > 0 and act.sent > 0
    states = source.state_bytes(cfg, 1)
    assert states.parameters > 0 and states.gradients > 0 and states.optimizer > 0
    held = Holding(layers=2, embedding=True)
    assert source.optimizer_time(cfg, 0, held) > source.optimizer_time(cfg, 0, Holding(layers=1))
    assert source.reduce_time(cfg, 0, held) == 0.0  # one replica
    assert source.link(cfg, 0, 1).transfer_time(1e6) > 0
    assert len(source.stage_costs(cfg, shape).stages) == 4
    assert source.layer_flop_rate(cfg, 0, shape) > 0
    assert len(stage_memory(source, cfg)) == 4


def test_state_bytes_by_category() -> None:
    analytic = AnalyticSource(GPT, A100)
    plain = analytic.state_bytes(ParallelConfig(dp=4, global_batch=16), 0)
    assert (plain.parameters, plain.gradients, plain.master, plain.optimizer) == (2, 4, 4, 8)  # Megatron's 18
    sharded = analytic.state_bytes(ParallelConfig(dp=4, global_batch=16, distributed_optimizer=True), 0)
    assert (sharded.master, sharded.optimizer) == (1, 2)
    profiled = ProfiledSource(ProfileModel(make_profile())).state_bytes(ParallelConfig(global_batch=4), 0)
    assert (profiled.parameters, profiled.gradients, profiled.master, profiled.optimizer) == (4, 4, 0, 8)


def test_analytic_estimate_is_the_estimate_over_its_source() -> None:
    cfg = ParallelConfig(tp=2, pp=4, dp=2, microbatch_size=2, global_batch=64, recompute=Recompute.SELECTIVE,
                         schedule=ScheduleFamily.ZB_H1, sequence_parallel=True)
    old, new = estimate(GPT, A100, cfg), estimate_with(AnalyticSource(GPT, A100), cfg)
    assert new.step_time_s == old.step_time_s and new.memory_per_stage_gib == old.memory_per_stage_gib
    assert new.hardware is A100 and new.source_name == A100.name and new.usable_memory_gib == A100.usable_memory_gib


@pytest.mark.parametrize("family,chunks", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1),
                                           ("bpipe", 1)])
@pytest.mark.parametrize("b", [1, 2, 4])
def test_profiled_estimate_is_the_profiles_prediction(family: str, chunks: int, b: int) -> None:
    """The profiled step is the profile's prediction of the schedule; the memory count matches the simulated
    activation peak plus the held output and the AdamW states, except where noted."""
    fits = ProfileModel(make_profile(layers=8))
    cfg = ParallelConfig(schedule=ScheduleFamily.parse(family), pp=4, chunks=chunks, microbatch_size=b,
                         global_batch=16)
    est = estimate_with(ProfiledSource(fits), cfg)
    pred = predict_step(fits, build_schedule(family, num_ranks=4, num_microbatches=16 // b, num_chunks=chunks),
                        microbatch_size=b)
    assert est.step_time_s == pytest.approx(pred.step_time, rel=1e-12)
    simulated = [s + a for s, a in zip(est.state_bytes, pred.peak_activation_bytes)]
    # ranks whose count differs: zb-h1's last (its head's weight-gradient bytes are not counted per layer) and
    # bpipe's last (the simulator holds an eviction in flight a little longer)
    exact = range(3) if family in ("zb-h1", "bpipe") else range(4)
    assert [est.peak_bytes[r] for r in exact] == pytest.approx([simulated[r] for r in exact], rel=1e-9)
    assert est.state_bytes[0] == pytest.approx((10 + 2 * 100) * 16)  # embedding + 2 blocks, 4 float32 copies
    assert est.mfu != est.mfu and est.to_dict()["mfu"] is None  # no peak FLOP rate known: NaN, null in JSON


def test_profiled_source_answers_selective_recomputation() -> None:
    """Selective recomputation keeps what the profiled (fused-kernel) blocks keep, and re-runs each block's
    attention core, its FLOP share of the profiled forward, in the input-gradient part of the backward."""
    source = ProfiledSource(ProfileModel(make_profile(layers=8)))
    none, sel = (ParallelConfig(pp=2, global_batch=8, recompute=r) for r in (Recompute.NONE, Recompute.SELECTIVE))
    source.check(sel)
    shape = shape_of(source.model, sel)
    assert source.layer_bytes(sel, 0, shape) == source.layer_bytes(none, 0, shape)
    core = source.layer_times(sel, 0, shape).selective_recompute
    assert 0 < core < source.layer_times(none, 0, shape).forward_compute
    assert source.layer_times(none, 0, shape).selective_recompute == 0
    blocks = stage_layers(source.model, sel)
    for s, (a, b) in enumerate(zip(source.stage_costs(none, shape).stages, source.stage_costs(sel, shape).stages)):
        assert b.backward_input == pytest.approx(a.backward_input + blocks[s] * core)


def test_profiled_source_refuses_what_a_profile_cannot_answer() -> None:
    source = ProfiledSource(ProfileModel(make_profile(layers=8)))
    with pytest.raises(ConfigError, match="tp 2"):
        source.check(ParallelConfig(tp=2, pp=2, global_batch=8))
    with pytest.raises(ConfigError, match="budget"):
        ProfiledSource(ProfileModel(make_profile()), memory_budget_gib=0.0)


def test_evenpipe_boundary_message_shrinks_by_tp_under_sequence_parallelism() -> None:
    """evenpipe's runtime sends the whole hidden state per tensor-parallel rank, or its 1/tp sequence slice under
    sequence parallelism (as measured in tests/distributed/test_tensor_parallel.py)."""
    from evenpipe.cost.runtime_memory import RuntimeConventions
    source = AnalyticSource(GPT, A100, conventions=RuntimeConventions())
    shape = MicrobatchShape(size=2, seq_len=GPT.seq_len)
    whole = 2 * GPT.seq_len * GPT.hidden * 4  # float32
    for tp, sp, want in ((1, False, whole), (2, False, whole), (2, True, whole / 2), (4, True, whole / 4)):
        cfg = ParallelConfig(pp=4, tp=tp, sequence_parallel=sp, microbatch_size=2, global_batch=16)
        assert source.layer_bytes(cfg, 1, shape).sent == want, (tp, sp)
