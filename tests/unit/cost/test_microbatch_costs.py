"""Costs per micro-batch shape (issue 34): the sources answer for documents of varying length (tokens and squared
lengths), equal micro-batches stay on the padded fast path, and the estimate and memory walk take each one's."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import ParallelConfig, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.flops import layer_forward_flops
from evenpipe.cost.memory import build_cost_schedule, rank_activation_peaks, stage_memory
from evenpipe.cost.microbatch_costs import bpipe_weights, config_sim_costs, microbatch_sim_costs
from evenpipe.cost.profile_fit import ProfileModel
from evenpipe.cost.profiled_source import DTYPE_BYTES, ProfiledSource
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.source import shape_of
from evenpipe.errors import ConfigError

from test_profile_fit import make_profile

H100 = hardware_preset("h100-80gb")
LLAMA = dataclasses.replace(model_preset("llama2-7b"), seq_len=2048)


def _docs(*lengths: int, rows: int = 1) -> MicrobatchShape:
    return MicrobatchShape.of_documents(lengths, size=rows, seq_len=2048)


def test_shape_of_documents() -> None:
    assert _docs(2048).padded and _docs(1024, 1024, rows=2) == _docs(1024, 1024, rows=2)
    mixed = _docs(1000, 24)
    assert (mixed.num_tokens, mixed.sum_squares) == (1024, 1000 ** 2 + 24 ** 2) and not mixed.padded
    assert MicrobatchShape(size=2, seq_len=8).sum_squares == 128
    with pytest.raises(ConfigError, match="cannot compute 17 tokens"):
        MicrobatchShape(size=2, seq_len=8, tokens=17)


def test_flops_add_up_over_documents() -> None:
    # linear in tokens, quadratic only through the squared lengths: two micro-batches' FLOPs add up to the
    # FLOPs of one holding both, and a full row is the padded micro-batch
    a, b = _docs(700, 300), _docs(100, 900)
    both = MicrobatchShape(size=1, seq_len=2048, tokens=2000, squared_lengths=a.sum_squares + b.sum_squares)
    flops = [layer_forward_flops(LLAMA, shape=s) for s in (a, b, both)]
    assert flops[0] + flops[1] == pytest.approx(flops[2], rel=1e-12)
    full = MicrobatchShape(size=1, seq_len=2048, tokens=2048, squared_lengths=2048 ** 2)
    assert layer_forward_flops(LLAMA, shape=full) == layer_forward_flops(LLAMA)


def test_analytic_source_prices_each_shape() -> None:
    source = AnalyticSource(LLAMA, H100)
    cfg = ParallelConfig(pp=4, global_batch=8, schedule=ScheduleFamily.ONE_F_ONE_B)
    padded = shape_of(LLAMA, cfg)
    full = MicrobatchShape(size=1, seq_len=2048, tokens=2048, squared_lengths=2048 ** 2)
    for a, b in zip(source.stage_costs(cfg, full).stages, source.stage_costs(cfg, padded).stages):
        assert a.forward == pytest.approx(b.forward, rel=1e-12)
        assert a.activation_bytes == pytest.approx(b.activation_bytes, rel=1e-12)
    # flash attention saves no scores: a Llama layer's saved bytes are linear in tokens, so half the tokens save
    # half the bytes whatever the documents; the boundary message too
    half = source.layer_bytes(cfg, 0, _docs(512, 512))
    whole = source.layer_bytes(cfg, 0, padded)
    assert half.layer_saved == pytest.approx(whole.layer_saved / 2, rel=1e-12)
    assert source.stage_costs(cfg, _docs(512, 512)).stages[0].output_bytes == \
        source.stage_costs(cfg, padded).stages[0].output_bytes / 2
    # the same tokens in one long document cost more than in many short ones (attention)
    long_doc, short_docs = source.stage_costs(cfg, _docs(1024)), source.stage_costs(cfg, _docs(*[64] * 16))
    assert long_doc.stages[1].forward > short_docs.stages[1].forward


def test_profiled_source_prices_tokens_as_rows_of_a_one_length_profile() -> None:
    # make_profile measures b = 1, 2, 4 rows of 16 tokens: 16 tokens in documents are predicted as b = 1
    source = ProfiledSource(ProfileModel(make_profile(layers=4)))
    cfg = ParallelConfig(pp=2, microbatch_size=2, global_batch=4, schedule=ScheduleFamily.ONE_F_ONE_B)
    one_row = source.stage_costs(dataclasses.replace(cfg, microbatch_size=1, global_batch=2),
                                 MicrobatchShape(size=1, seq_len=16))
    docs = source.stage_costs(cfg, MicrobatchShape.of_documents([10, 6], size=2, seq_len=16))
    # a block of documents keeps one more [tokens, hidden] (attention per document, models.layers)
    profile = source.fits.profile
    extra = 16 * profile.model.hidden * DTYPE_BYTES[profile.machine.dtype]
    for a, b, blocks in zip(docs.stages, one_row.stages, (2, 2)):
        assert a.forward == pytest.approx(b.forward)
        assert a.activation_bytes == pytest.approx(b.activation_bytes + blocks * extra)
    whole = source.layer_bytes(cfg, 0, MicrobatchShape(size=1, seq_len=16))
    as_documents = source.layer_bytes(cfg, 0, MicrobatchShape(size=1, seq_len=16, tokens=16, squared_lengths=256))
    assert as_documents.layer_saved == pytest.approx(whole.layer_saved + extra)
    assert as_documents.layer_weight_grad == pytest.approx(whole.layer_weight_grad + extra)  # I frees none of it


def test_microbatch_costs_fast_path_and_rows() -> None:
    source = AnalyticSource(LLAMA, H100)
    cfg = ParallelConfig(pp=2, global_batch=3, schedule=ScheduleFamily.ONE_F_ONE_B)
    padded = shape_of(LLAMA, cfg)
    assert microbatch_sim_costs(source, cfg, [padded] * 3) is source.stage_costs(cfg, padded)
    shapes = [_docs(300), padded, _docs(100, 200)]
    costs = microbatch_sim_costs(source, cfg, shapes)
    assert costs.microbatch_stages is not None
    assert [row for row in costs.microbatch_stages] == [source.stage_costs(cfg, s).stages for s in shapes]
    with pytest.raises(ConfigError, match="2 micro-batch shapes for 3"):
        microbatch_sim_costs(source, cfg, shapes[:2])


def test_estimate_and_memory_walk_take_each_micro_batch() -> None:
    source = AnalyticSource(LLAMA, H100)
    base = ParallelConfig(pp=4, global_batch=8, schedule=ScheduleFamily.ONE_F_ONE_B)
    short, long_ = _docs(256, 256), _docs(1800)
    shapes = tuple([short, long_] * 4)
    mixed = dataclasses.replace(base, microbatch_shapes=shapes)
    every_short = estimate_with(source, dataclasses.replace(base, microbatch_shapes=(short,) * 8))
    every_long = estimate_with(source, dataclasses.replace(base, microbatch_shapes=(long_,) * 8))
    est = estimate_with(source, mixed)
    assert every_short.step_time_s < est.step_time_s < every_long.step_time_s
    # 1F1B holds its micro-batches in program order: the walk's peak is the simulated peak, rank by rank
    for (peak, _), simulated in zip(rank_activation_peaks(source, mixed), est.activation_peak_simulated_gib):
        walked = peak.own_layers + peak.own_extra_embedding + peak.own_extra_head + peak.hosted
        assert walked / 2 ** 30 == pytest.approx(simulated, rel=1e-9)
    # padded shapes given explicitly are the configuration without shapes
    same = dataclasses.replace(base, microbatch_shapes=(shape_of(LLAMA, base),) * 8)
    assert stage_memory(source, same) == stage_memory(source, base)
    assert estimate_with(source, same).step_time_s == estimate_with(source, base).step_time_s


def test_wrong_shapes_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="need 4 shapes") as err:
        ParallelConfig(pp=2, global_batch=4, microbatch_shapes=(_docs(10),))
    assert "\n" not in str(err.value)


def test_bpipe_plans_evictions_by_each_micro_batch_bytes() -> None:
    source = AnalyticSource(LLAMA, H100)
    short, long_ = _docs(256, 256), _docs(1800)
    cfg = ParallelConfig(pp=4, global_batch=8, schedule=ScheduleFamily.BPIPE,
                         microbatch_shapes=tuple([short, long_] * 4))
    weights = bpipe_weights(source, cfg)
    assert weights == pytest.approx((512 / 1800, 1.0) * 4)  # flash Llama: saved bytes are linear in tokens
    assert build_cost_schedule(cfg, source.plan_durations(cfg), weights).meta["weighted"]
    assert bpipe_weights(source, dataclasses.replace(cfg, schedule=ScheduleFamily.ONE_F_ONE_B)) is None
    # the budget counts units of the largest micro-batch: every rank's simulated bytes keep to it, with fewer
    # evictions than counting every micro-batch as a whole unit
    weighted = build_cost_schedule(cfg, source.plan_durations(cfg), weights)
    budget = weighted.meta["budget"]
    unweighted = build_cost_schedule(dataclasses.replace(cfg, bpipe_budget=budget), source.plan_durations(cfg))
    est = estimate_with(source, cfg)
    largest = config_sim_costs(source, cfg).stages  # per stage, the largest micro-batch's bytes
    for r, peak in enumerate(est.activation_peak_simulated_gib):
        assert peak * 2 ** 30 <= budget * largest[r].activation_bytes * (1 + 1e-9)

    def evictions(schedule) -> int:  # type: ignore[no-untyped-def]
        return sum(a.kind.name == "EVICT" for acts in schedule.actions for a in acts)
    assert evictions(weighted) < evictions(unweighted)


def test_search_bounds_hold_for_unequal_micro_batches() -> None:
    # the planner skips what its bounds say cannot win: under unequal micro-batches the work bound stays below
    # the step bound, and that below the simulated estimate, for every family and random documents
    import random

    from evenpipe.errors import EvenpipeError
    from evenpipe.plan.bounds import step_bound, work_bound
    from evenpipe.plan.search import enumerate_configs, SearchSpace

    rng = random.Random(34)
    source = AnalyticSource(LLAMA, H100)
    checked = 0
    for cfg in enumerate_configs(LLAMA, H100, num_gpus=8, global_batch=16,
                                 space=SearchSpace(max_microbatch_size=2, max_chunks=2)):
        shapes = tuple(MicrobatchShape.of_documents([rng.randint(1, 2048) for _ in range(cfg.microbatch_size)],
                                                    size=cfg.microbatch_size, seq_len=2048)
                       for _ in range(cfg.num_microbatches))
        shaped = dataclasses.replace(cfg, microbatch_shapes=shapes)
        try:
            source.check(shaped, 8)
            est = estimate_with(source, shaped)
        except EvenpipeError:
            continue
        bound = step_bound(source, shaped)
        assert 0.0 < work_bound(source, shaped) <= bound <= est.step_time_s * (1 + 1e-9), shaped.describe()
        assert bound < step_bound(source, cfg)  # documents shorter than full rows: less to do
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_step_flops_of_full_rows_are_the_padded_step(recompute: str) -> None:
    from evenpipe.cost import Recompute
    from evenpipe.cost.flops import executed_flops_per_step, model_flops_per_step, step_flops

    cfg = ParallelConfig(pp=2, dp=2, microbatch_size=2, global_batch=8, recompute=Recompute.parse(recompute))
    full = MicrobatchShape(size=2, seq_len=2048, tokens=4096, squared_lengths=2 * 2048 ** 2)
    shaped = dataclasses.replace(cfg, microbatch_shapes=(full,) * 2)
    useful, executed = step_flops(LLAMA, shaped)
    assert useful == pytest.approx(model_flops_per_step(LLAMA, 8), rel=1e-12)
    assert executed == pytest.approx(executed_flops_per_step(LLAMA, cfg), rel=1e-12)
    half = dataclasses.replace(cfg, microbatch_shapes=(_docs(1024, 1024, rows=2),) * 2)
    assert step_flops(LLAMA, half)[0] < useful / 2  # half the tokens, a quarter of the attention
    est = estimate_with(AnalyticSource(LLAMA, H100), half)
    assert est.mfu == pytest.approx(step_flops(LLAMA, half)[0] / (989e12 * 4 * est.step_time_s), rel=1e-9)


def test_estimate_reports_the_shapes_tokens() -> None:
    source = AnalyticSource(LLAMA, H100)
    cfg = ParallelConfig(pp=2, dp=2, global_batch=4, microbatch_shapes=(_docs(300, 700), _docs(2048)))
    est = estimate_with(source, cfg)
    assert est.tokens_per_s == pytest.approx(2 * (1000 + 2048) / est.step_time_s)
    assert est.to_dict()["config"]["microbatch_tokens"] == [1000, 2048]
    assert "microbatch_tokens" not in estimate_with(source, dataclasses.replace(
        cfg, microbatch_shapes=None)).to_dict()["config"]


def test_category_peaks_take_each_micro_batch() -> None:
    from evenpipe.cost.category_memory import peak_bytes_by_category

    source = AnalyticSource(LLAMA, H100)
    cfg = ParallelConfig(pp=2, global_batch=4, schedule=ScheduleFamily.ONE_F_ONE_B)
    shaped = dataclasses.replace(cfg, microbatch_shapes=(_docs(300), _docs(2048), _docs(100, 100), _docs(700)))
    full, varied = peak_bytes_by_category(source, cfg), peak_bytes_by_category(source, shaped)
    walked = rank_activation_peaks(source, shaped)
    for r, (f, v) in enumerate(zip(full, varied)):
        assert v["own_activations"] == round(walked[r][0].own_layers + walked[r][0].own_extra_embedding
                                         + walked[r][0].own_extra_head + walked[r][1])
        # rank 1 holds one micro-batch at a time, the largest a full row; rank 0 two, 300 + 2048 tokens
        assert v["own_activations"] <= f["own_activations"] and v["parameters"] == f["parameters"]
        assert v["communication_buffers"] <= f["communication_buffers"]
    assert varied[0]["own_activations"] < full[0]["own_activations"]
    # every micro-batch of one shape that is not the padded one: walked at that shape
    same = dataclasses.replace(cfg, microbatch_shapes=(_docs(300),) * 4)
    assert peak_bytes_by_category(source, same)[0]["own_activations"] < full[0]["own_activations"]
