"""The cost source: the analytic and the profiled implementation answer the same questions, and the one estimate
over a source reproduces what each planner computed before (the analytic estimate, the profile's step)."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import ParallelConfig, Recompute, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.category_memory import with_conventions
from evenpipe.cost.profile import LayerKind
from evenpipe.cost.runtime_memory import RuntimeConventions
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
    """Selective recomputation keeps what the profiled (fused-kernel) blocks keep but the kernel's fp32
    log-sum-exp, and re-runs each block's attention core, its FLOP share of the profiled forward, in the
    input-gradient part of the backward."""
    source = ProfiledSource(ProfileModel(make_profile(layers=8)))
    none, sel = (ParallelConfig(pp=2, global_batch=8, recompute=r) for r in (Recompute.NONE, Recompute.SELECTIVE))
    source.check(sel)
    shape = shape_of(source.model, sel)
    kept, whole = source.layer_bytes(sel, 0, shape), source.layer_bytes(none, 0, shape)
    assert whole.layer_saved - kept.layer_saved == 4 * source.model.num_heads * shape.seq_len * shape.size
    assert (kept.head, kept.embedding, kept.sent) == (whole.head, whole.embedding, whole.sent)
    core = source.layer_times(sel, 0, shape).selective_recompute
    assert 0 < core < source.layer_times(none, 0, shape).forward_compute
    assert source.layer_times(none, 0, shape).selective_recompute == 0
    blocks = stage_layers(source.model, sel)
    for s, (a, b) in enumerate(zip(source.stage_costs(none, shape).stages, source.stage_costs(sel, shape).stages)):
        assert b.backward_input == pytest.approx(a.backward_input + blocks[s] * core)


def _gpt_tiny_measured() -> ProfiledSource:
    """A gpt-tiny profile whose float32 block saves what train measured at b = 1: 247808 B and its 16384 B input."""
    p = make_profile(sizes=(1, 2))
    layers = {k: tuple(dataclasses.replace(x, seq_len=64) for x in v) for k, v in p.layers.items()}
    layers[LayerKind.BLOCK] = tuple(dataclasses.replace(x, saved_bytes=247808.0 * x.microbatch_size,
                                                        input_saved_bytes=16384.0 * x.microbatch_size,
                                                        weight_grad_bytes=247808.0 * x.microbatch_size)
                                    for x in layers[LayerKind.BLOCK])
    return ProfiledSource(ProfileModel(dataclasses.replace(p, layers=layers)))


def test_profiled_source_divides_the_split_activations_and_parameters_over_tp() -> None:
    """At tp 2 a gpt-tiny block keeps 165376 B for one micro-batch (train --tp 2 measures it: pipeline rank 0 of
    1F1B at pp 2 holds 2·(2 blocks + 1024 B of tokens) + a 16384 B output = 679936 B), the split q/k/v, attention
    output, MLP and log-sum-exp halved; its parameters are the analytic evenpipe source's (embedding and head
    whole on every tensor-parallel rank)."""
    source = _gpt_tiny_measured()
    cfg = ParallelConfig(tp=2, pp=2, global_batch=8)
    source.check(cfg)
    shape = shape_of(source.model, cfg)
    assert source.layer_bytes(cfg, 0, shape).layer_saved == 165376
    assert source.layer_bytes(dataclasses.replace(cfg, tp=1), 0, shape).layer_saved == 264192
    evenpipe = with_conventions(AnalyticSource(model_preset("gpt-tiny"), A100), RuntimeConventions())
    for tp in (1, 2, 4):
        c = dataclasses.replace(cfg, tp=tp)
        assert source.param_counts(c).per_layer - evenpipe.param_counts(c).per_layer == \
            source.param_counts(cfg).per_layer - evenpipe.param_counts(cfg).per_layer
        assert (source.param_counts(c).embedding, source.param_counts(c).head) == (10, 20)


def test_profiled_source_refuses_what_a_profile_cannot_answer() -> None:
    source = ProfiledSource(ProfileModel(make_profile(layers=8)))
    with pytest.raises(ConfigError, match="tp 2: the profiled model gpt-tiny is no preset"):
        source.check(ParallelConfig(tp=2, pp=2, global_batch=8))
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        _gpt_tiny_measured().check(ParallelConfig(tp=2, pp=2, global_batch=8, sequence_parallel=True))
    with pytest.raises(ConfigError, match="tp 8 does not divide the 4 attention heads"):
        _gpt_tiny_measured().check(ParallelConfig(tp=8, pp=2, global_batch=8))
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


def test_analytic_source_hash_taken_once_follows_its_fields() -> None:
    """The source keeps its hash (every memo of the planner keys by it): equal sources hash alike, and a
    replaced field gives another key."""
    a, b = AnalyticSource(GPT, A100), AnalyticSource(GPT, A100)
    keys = {a: "a"}
    assert a == b and hash(a) == hash(b) and keys[b] == "a"
    other = dataclasses.replace(a, efficiency=dataclasses.replace(a.efficiency, dp_overlap=False))
    assert other != a and other not in keys
    assert with_conventions(a, RuntimeConventions()) not in keys
