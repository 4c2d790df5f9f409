"""Memory per pipeline rank: in-flight counts come from the schedule, components land on the right ranks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from evenpipe.cost import (GIB, Arch, Attention, ModelSpec, ParallelConfig, Recompute, ScheduleFamily,
                           activation_bytes, hardware_preset, memory_per_stage, model_preset)
from evenpipe.cost.memory import ActivationBytes, _Units, _peak_activations, _rank_peak, counting_schedule
from evenpipe.schedule import bpipe_transform, compute_order

A100 = hardware_preset("a100-80gb")
GPT3 = model_preset("gpt3-175b")


def _cfg(**kw: object) -> ParallelConfig:
    base: dict[str, object] = dict(tp=8, pp=8, dp=1, global_batch=64, attention=Attention.EAGER)
    base.update(kw)
    return ParallelConfig(**base)  # type: ignore[arg-type]


def _acts(cfg: ParallelConfig, model: ModelSpec = GPT3) -> list[float]:
    return [m.activations + m.hosted for m in memory_per_stage(model, A100, cfg)]


def _unit(cfg: ParallelConfig, model: ModelSpec = GPT3) -> float:
    """Saved activations of one micro-batch on one whole stage (p stages), GiB."""
    return activation_bytes(model, cfg).layer_saved * model.num_layers / cfg.pp / GIB


def test_one_f_one_b_first_stage_largest_and_linear() -> None:
    cfg = _cfg()
    acts, unit = _acts(cfg), _unit(cfg)
    assert acts == pytest.approx([(8 - r) * unit for r in range(8)], rel=1e-12)


def test_gpipe_holds_every_microbatch() -> None:
    cfg = _cfg(schedule=ScheduleFamily.GPIPE, global_batch=12)
    assert _acts(cfg) == pytest.approx([12 * _unit(cfg)] * 8, rel=1e-12)


def test_bpipe_balances_to_the_budget() -> None:
    one = _acts(_cfg())
    bp = memory_per_stage(GPT3, A100, _cfg(schedule=ScheduleFamily.BPIPE))
    unit = _unit(_cfg())
    totals = [m.activations + m.hosted for m in bp]
    assert max(totals) == pytest.approx(5 * unit, rel=1e-12)  # ceil((8 + 1) / 2)
    assert max(totals) < one[0]
    assert all(m.hosted > 0 for m in bp[5:]) and all(m.hosted == 0 for m in bp[:4])
    assert max(totals) - min(totals) <= unit * (1 + 1e-12)


def test_bpipe_budget_option_is_respected() -> None:
    unit = _unit(_cfg())
    totals = _acts(_cfg(schedule=ScheduleFamily.BPIPE, bpipe_budget=6))
    assert max(totals) == pytest.approx(6 * unit, rel=1e-12)


@pytest.mark.parametrize("p,v,layers", [(8, 3, 96), (4, 2, 32), (6, 2, 24)])
def test_interleaved_first_rank_gets_megatrons_factor(p: int, v: int, layers: int) -> None:
    model = dataclasses.replace(GPT3, num_layers=layers)
    base = _cfg(pp=p, global_batch=8 * p)
    inter = _cfg(pp=p, chunks=v, schedule=ScheduleFamily.INTERLEAVED, global_batch=8 * p)
    assert _acts(inter, model)[0] == pytest.approx(_acts(base, model)[0] * (1 + (p - 1) / (p * v)), rel=1e-12)


def test_zero_bubble_keeps_one_f_one_b_peak() -> None:
    assert max(_acts(_cfg(schedule=ScheduleFamily.ZB_H1))) <= max(_acts(_cfg())) * (1 + 1e-12)


def test_embedding_first_head_last() -> None:
    mem = memory_per_stage(GPT3, A100, _cfg())
    assert mem[0].embedding > 0 and all(m.embedding == 0 for m in mem[1:])
    assert mem[-1].head > 0 and all(m.head == 0 for m in mem[:-1])
    # tied embeddings with pp > 1: the last stage holds Megatron's copy of the word embeddings
    assert mem[-1].head * GIB >= GPT3.vocab * GPT3.hidden / 8 * 18


def test_untied_head_single_stage() -> None:
    llama = model_preset("llama-7b")
    mem = memory_per_stage(llama, A100, ParallelConfig(global_batch=8))
    assert len(mem) == 1 and mem[0].embedding > 0 and mem[0].head > 0


def test_distributed_optimizer_shards_optimizer_state_only() -> None:
    plain = memory_per_stage(GPT3, A100, _cfg(dp=16, global_batch=256))[3]
    dist = memory_per_stage(GPT3, A100, _cfg(dp=16, global_batch=256, distributed_optimizer=True))[3]
    assert dist.optimizer == pytest.approx(plain.optimizer / 16, rel=1e-12)
    assert (dist.weights, dist.grads) == (plain.weights, plain.grads)
    assert plain.model_states / (plain.weights / 2) == pytest.approx(18, rel=1e-3)  # 18 bytes per parameter


def test_full_recompute_keeps_layer_inputs_plus_one_layer() -> None:
    cfg = _cfg(recompute=Recompute.FULL)
    s, h = GPT3.seq_len, GPT3.hidden
    inputs = 8 * (96 // 8) * 2 * s * h  # p micro-batches in flight x L/p layers x 2sbh (not split without sp)
    full_layer = activation_bytes(GPT3, _cfg()).layer_full
    assert memory_per_stage(GPT3, A100, cfg)[0].activations * GIB == pytest.approx(inputs + full_layer, rel=1e-12)


def test_flash_and_selective_drop_the_score_terms() -> None:
    eager = activation_bytes(GPT3, _cfg()).layer_saved
    flash = activation_bytes(GPT3, _cfg(attention=Attention.FLASH)).layer_saved
    sel = activation_bytes(GPT3, _cfg(recompute=Recompute.SELECTIVE)).layer_saved
    s, h, a = GPT3.seq_len, GPT3.hidden, GPT3.num_heads
    assert flash == sel == s * h * (10 + 24 / 8)
    assert eager - flash == 5 * a * s * s / 8


def test_llama_block_derivation() -> None:
    m = model_preset("llama2-70b")  # h 8192, 64 heads, 8 KV heads (h_kv 1024), f 28672, s 4096
    flash = activation_bytes(m, ParallelConfig(tp=8, global_batch=8)).layer_saved
    assert flash == 4096 * (8 * 8192 + (4 * 8192 + 6 * 28672) / 8 + 4 * 1024 / 8)
    eager = activation_bytes(m, ParallelConfig(tp=8, global_batch=8, attention=Attention.EAGER)).layer_saved
    assert eager - flash == 2 * 64 * 4096 ** 2 / 8  # softmax output only: LLaMA has no attention dropout
    sp = activation_bytes(m, ParallelConfig(tp=8, global_batch=8, sequence_parallel=True)).layer_saved
    assert sp == 4096 * (8 * 8192 + 4 * 8192 + 6 * 28672 + 4 * 1024) / 8


@pytest.mark.parametrize("family,v,bpipe", [
    (ScheduleFamily.ONE_F_ONE_B, 1, False), (ScheduleFamily.INTERLEAVED, 2, False), (ScheduleFamily.ZB_H1, 1, False),
    (ScheduleFamily.BPIPE, 1, False), (ScheduleFamily.INTERLEAVED, 2, True), (ScheduleFamily.ZB_H1, 1, True),
    (ScheduleFamily.ZB_H2, 1, False), (ScheduleFamily.ZB_V, 2, False), (ScheduleFamily.V_HALF, 2, False),
    (ScheduleFamily.V_MIN, 2, False), (ScheduleFamily.DUALPIPE_V, 2, False)])
@pytest.mark.parametrize("p", [2, 4, 5, 6])
def test_truncated_counting_matches_the_full_schedule(family: ScheduleFamily, v: int, bpipe: bool, p: int) -> None:
    m = 12 * p
    cfg = ParallelConfig(pp=p, chunks=v, global_batch=m, schedule=family, bpipe=bpipe)
    plan = (2, 2, 1) if family.traits.plans_with_durations else None  # the family's order for those durations
    short = counting_schedule(cfg, plan)
    assert short.num_microbatches < m
    full = compute_order(family, num_ranks=p, num_microbatches=m, num_chunks=v, plan_durations=plan)
    if cfg.uses_bpipe:
        full = bpipe_transform(full)
    unit = [1.0] * (p * v)
    wg = [0.25] * (p * v)
    for r in range(p):
        units = [_Units(unit, wg, 0.1, 0.2, 0.05)]
        assert _peak_activations(short, r, units) == _peak_activations(full, r, units)


def test_gpt_model_with_gqa_is_allowed() -> None:
    m = ModelSpec(name="g", arch=Arch.GPT, num_layers=8, hidden=1024, num_heads=16, num_kv_heads=4,
                  ffn_hidden=4096, vocab=1000, seq_len=512, tied_embeddings=True)
    cfg = ParallelConfig(tp=8, pp=2, global_batch=16)
    mem = memory_per_stage(m, A100, cfg)
    # 1F1B on 2 ranks: rank 0 holds 2 micro-batches of its 4 layers, rank 1 one; GQA shrinks K and V from
    # 4·s·b·h/t to 4·s·b·h_kv/min(t, kv_heads) bytes per layer (h_kv = 256, split over 4 ranks, not 8)
    act = activation_bytes(m, cfg)
    per_mb = 4 * act.layer_saved
    assert mem[0].activations == pytest.approx(2 * per_mb / GIB)
    assert mem[1].activations == pytest.approx(per_mb / GIB)
    s, b, h = m.seq_len, cfg.microbatch_size, m.hidden
    mha = dataclasses.replace(m, num_kv_heads=16)
    assert act.layer_saved == pytest.approx(activation_bytes(mha, cfg).layer_saved
                                            - 4 * s * b * (h / 8 - m.kv_hidden / 4))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(schedule=ScheduleFamily.ZB_H1),
    dict(schedule=ScheduleFamily.INTERLEAVED, chunks=3),
    dict(recompute=Recompute.FULL),
    dict(recompute=Recompute.FULL, schedule=ScheduleFamily.INTERLEAVED, chunks=2),
    dict(schedule=ScheduleFamily.GPIPE, global_batch=12),
    dict(schedule=ScheduleFamily.BPIPE),
    dict(schedule=ScheduleFamily.BPIPE, recompute=Recompute.FULL),
])
def test_program_order_count_agrees_with_the_simulator(kw: dict[str, object]) -> None:
    """memory_per_stage counts in program order on a truncated schedule; the simulator tracks bytes in time on
    the full one with the same per-stage bytes (stage_sim_costs). Their per-rank peaks must agree, BPipe's evictors
    included (in the simulator a forward waits for its rank's evictions to land, as in the runtime); an acceptor may
    go above the count by at most its hosted peak."""
    from evenpipe.cost import stage_sim_costs
    from evenpipe.cost.memory import build_cost_schedule
    from evenpipe.sim import simulate

    cfg = _cfg(**kw)
    trace = simulate(build_cost_schedule(cfg), stage_sim_costs(GPT3, A100, cfg))
    mem = memory_per_stage(GPT3, A100, cfg)
    emb_state = mem[0].embedding * GIB - trace_free_embedding_state(cfg)
    for r, m in enumerate(mem):
        ours = (m.activations + m.hosted) * GIB
        ours += emb_state if r == 0 else 0.0
        ours += (m.head * GIB - head_state(cfg)) if r == cfg.pp - 1 else 0.0
        simulated = trace.peak_activation_bytes[r]
        if m.hosted > 0:
            # an acceptor's forward may run while a RETURN is still in flight, so in time it can hold up to its own
            # program-order peak plus its hosted peak, never less than the program-order count
            assert ours * (1 - 1e-9) <= simulated <= ours + m.hosted * GIB * (1 + 1e-9), r
        else:
            assert ours == pytest.approx(simulated, rel=1e-9), r


def trace_free_embedding_state(cfg: ParallelConfig) -> float:
    params = GPT3.vocab // cfg.tp * GPT3.hidden + (GPT3.vocab % cfg.tp > 0) * GPT3.hidden + GPT3.seq_len * GPT3.hidden
    return params * 18.0


def head_state(cfg: ParallelConfig) -> float:
    return (-(-GPT3.vocab // cfg.tp) * GPT3.hidden + 2 * GPT3.hidden) * 18.0


@pytest.mark.parametrize("family,v,bpipe", [
    (ScheduleFamily.ONE_F_ONE_B, 1, False), (ScheduleFamily.INTERLEAVED, 3, True), (ScheduleFamily.ZB_H1, 1, True),
    (ScheduleFamily.BPIPE, 1, False), (ScheduleFamily.ZB_V, 2, False), (ScheduleFamily.GPIPE, 1, False)])
def test_counted_peak_is_the_walk_exactly(family: ScheduleFamily, v: int, bpipe: bool) -> None:
    # the peak from counted states is the program-order walk's, float for float and component by component:
    # whole byte counts, eighths, tiny integers (many equal totals: the first maximum must win) and arbitrary
    # floats (inexact sums: the walk itself answers)
    rng = random.Random(7)
    draws = [lambda: float(rng.randint(0, 10 ** 10)), lambda: rng.randint(0, 10 ** 6) / 8,
             lambda: float(rng.choice([0, 1, 2])), lambda: rng.uniform(0.0, 1e9)]
    for p in (3, 4, 6):
        cfg = ParallelConfig(pp=p, chunks=v, global_batch=p * rng.randint(1, 4), schedule=family, bpipe=bpipe)
        sched = counting_schedule(cfg, (2, 2, 1) if family.traits.plans_with_durations else None)
        for trial in range(12):
            draw = draws[trial % len(draws)]
            layers = tuple(rng.randint(1, 4) for _ in range(p * v))
            saved = draw()
            act = ActivationBytes(layer_full=saved + draw(), layer_saved=saved, layer_weight_grad=min(saved, draw()),
                                  embedding=draw(), head=draw())
            transient = draw() if trial % 2 else 0.0
            for r in range(p):
                walked = _peak_activations(sched, r, [_Units([n * act.layer_saved for n in layers],
                                                             [n * act.layer_weight_grad for n in layers],
                                                             act.embedding, act.head, transient)])
                assert _rank_peak(sched, r, layers, act, transient) == walked, (p, r, trial)
