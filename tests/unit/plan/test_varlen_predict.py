"""Predicted steps of document batches under each micro-batching policy, by the simulator (issue 34)."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import ParallelConfig, ScheduleFamily, hardware_preset, model_preset
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.errors import ConfigError
from evenpipe.plan.microbatch import MicrobatchBudget, Policy, plan_microbatches
from evenpipe.plan.varlen_predict import (microbatch_cost_of, microbatch_shapes, predict_batch, predict_policies,
                                          predict_throughput)

MODEL = dataclasses.replace(model_preset("llama2-7b"), seq_len=2048)
SOURCE = AnalyticSource(MODEL, hardware_preset("h100-80gb"))
CFG = ParallelConfig(pp=2, microbatch_size=2, global_batch=2, schedule=ScheduleFamily.ONE_F_ONE_B)


def test_cost_is_linear_in_tokens_and_squared_lengths() -> None:
    # at one row's tokens the matrices cost the same, so any squared length between the two probes is priced
    # exactly by the line; more tokens add the per-token slope (up to the GEMMs' efficiency)
    cost = microbatch_cost_of(SOURCE, CFG)
    assert cost.per_token > 0 and cost.per_square > 0
    s = 2048
    half = MicrobatchShape(size=2, seq_len=s, tokens=s, squared_lengths=s * s // 2)
    work = sum(st.forward + st.backward for st in SOURCE.stage_costs(CFG, half).stages)
    assert cost.per_token * s + cost.per_square * (s * s // 2) == pytest.approx(work, rel=1e-9)


def test_padding_is_computed_and_costs_time() -> None:
    # rows of 2048, two per micro-batch. pad: (2000, 10) and (2000, 10), each padded to 2 x 2000 tokens. pack:
    # first fit puts all four in one micro-batch (2000 + 10 + 10 in one row, 2000 in the other): 4020 tokens.
    lengths = [2000, 10, 2000, 10]
    out = predict_policies(lengths, source=SOURCE, cfg=CFG, policies=("pad", "pack"))
    assert out[Policy.PAD].computed_tokens == 8000 and out[Policy.PAD].num_microbatches == 2
    assert out[Policy.PACK].computed_tokens == 4020 and out[Policy.PACK].num_microbatches == 1
    assert out[Policy.PAD].real_tokens == out[Policy.PACK].real_tokens == 4020
    assert out[Policy.PAD].step_s > out[Policy.PACK].step_s
    assert out[Policy.PACK].tokens_per_s == pytest.approx(4020 / out[Policy.PACK].step_s)


def test_the_step_is_the_simulated_estimate_of_the_plans_shapes() -> None:
    lengths = [1500, 300, 40, 900, 1200, 700, 100, 2048, 60, 512]
    cost = microbatch_cost_of(SOURCE, CFG)
    plan = plan_microbatches(lengths, policy="balance", budget=MicrobatchBudget(row_len=2048, rows=2), cost=cost)
    (shapes,) = microbatch_shapes(plan, lengths, rows=2, seq_len=2048)
    want = estimate_with(SOURCE, dataclasses.replace(CFG, global_batch=2 * len(shapes), microbatch_shapes=shapes))
    got = predict_batch(lengths, source=SOURCE, cfg=CFG, policy="balance")
    assert got.step_s == want.step_time_s and got.peak_memory_gib == want.peak_memory_gib
    assert sum(sh.num_tokens for sh in shapes) == sum(lengths)  # packed: no padding computed


def test_replicas_take_the_slowest_and_batches_add_up() -> None:
    cfg = dataclasses.replace(CFG, dp=2, global_batch=4)
    batches = [[1500, 300, 40, 900, 1200, 700, 100, 2048], [64] * 40]
    result = predict_throughput(batches, source=SOURCE, cfg=cfg, policies=("pack", "balance"))
    for t in result.values():
        assert t.step_s == pytest.approx(sum(b.step_s for b in t.batches))
        assert t.tokens_per_s == pytest.approx(sum(map(sum, batches)) / t.step_s)


def test_too_long_a_document_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="3000 tokens") as err:
        predict_batch([3000], source=SOURCE, cfg=CFG, policy="pack")
    assert "\n" not in str(err.value)


def test_runtime_rows_price_whole_rows_of_the_longest_row() -> None:
    # two rows of 2048 per micro-batch; pack puts 100 and 30 in row 0: the runtime computes 2 rows of 136
    # (130 rounded up to 8), attention once per run: 100, 30 and 6 of padding in row 0, 136 of padding in row 1;
    # the documents alone are 130 tokens, 100² + 30²
    lengths = [100, 30]
    plan = plan_microbatches(lengths, policy="pack", budget=MicrobatchBudget(row_len=2048, rows=2),
                             cost=microbatch_cost_of(SOURCE, CFG))
    ((docs,),) = microbatch_shapes(plan, lengths, rows=2, seq_len=2048)
    ((rows,),) = microbatch_shapes(plan, lengths, rows=2, seq_len=2048, row_multiple=8)
    assert (docs.num_tokens, docs.sum_squares) == (130, 100 ** 2 + 30 ** 2)
    assert (rows.num_tokens, rows.sum_squares) == (2 * 136, 100 ** 2 + 30 ** 2 + 6 ** 2 + 136 ** 2)
    full = microbatch_shapes(plan_microbatches([2048, 2048], policy="pad", budget=MicrobatchBudget(
        row_len=2048, rows=2), cost=microbatch_cost_of(SOURCE, CFG)), [2048, 2048], rows=2, seq_len=2048,
        row_multiple=16)
    # whole rows of one document each: the padded shape's tokens, but run by document (not the padded fast path)
    assert not full[0][0].padded and full[0][0].num_tokens == 2 * 2048 and full[0][0].sum_squares == 2 * 2048 ** 2
    with pytest.raises(ConfigError, match="row_multiple"):
        microbatch_shapes(plan, lengths, rows=2, seq_len=2048, row_multiple=0)
    assert predict_batch(lengths, source=SOURCE, cfg=CFG, policy="pack", row_multiple=8).computed_tokens == 272
