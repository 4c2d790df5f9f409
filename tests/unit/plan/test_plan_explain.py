"""``explain_bpipe``: different, reasoned answers for a GPT-3-like model with eager attention under tight memory
and for a LLaMA model with flash attention; the numbers behind each answer are consistent."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import Attention, Hardware, Recompute, hardware_preset, model_preset
from evenpipe.plan import (
    TIME_COMPONENTS,
    BPipeExplanation,
    Eater,
    Lever,
    Searcher,
    SearchSpace,
    Verdict,
    explain_bpipe,
)

A100 = hardware_preset("a100-80gb")
A100_6 = dataclasses.replace(A100, gpus_per_node=6)
"""A100s in 6-GPU nodes (as Summit's 6-GPU nodes): with even stages the only splits of 48 GPUs over gpt-145.6b's 96
heads and 80 layers are tp 3 (pp 16) and tp 6 (pp 8), and a tensor-parallel group must divide a node."""


def _explain(name: str, gpus: int, batch: int, attention: Attention, hw: Hardware = A100) -> BPipeExplanation:
    searcher = Searcher(model_preset(name), hw)
    # the memory-tight scenario: optimizer state replicated (the distributed optimizer would make room), even stages
    space = SearchSpace(attention=attention, sequence_parallel=False, distributed_optimizer=False,
                        uneven_stages=False)
    return explain_bpipe(searcher, num_gpus=gpus, global_batch=batch, space=space)


@pytest.fixture(scope="module")
def gpt() -> BPipeExplanation:
    # GPT-3-width 145.6B (Megatron 2021) on 48 GPUs: model states take ~55 of 78 usable GiB per GPU
    return _explain("gpt-145.6b", 48, 128, Attention.EAGER, A100_6)


@pytest.fixture(scope="module")
def llama() -> BPipeExplanation:
    return _explain("llama-65b", 64, 128, Attention.FLASH)


def test_answers_differ(gpt: BPipeExplanation, llama: BPipeExplanation) -> None:
    assert gpt.verdict is Verdict.PAYS and gpt.gain > gpt.margin
    assert llama.verdict is Verdict.DOES_NOT_PAY and llama.gain < -llama.margin


def test_gpt_lever_is_dropping_recomputation_that_only_bpipe_makes_fit(gpt: BPipeExplanation) -> None:
    assert gpt.bpipe is not None
    assert Lever.LESS_RECOMPUTE in gpt.levers
    assert gpt.baseline.config.recompute is Recompute.FULL
    assert gpt.twin_fits is False and gpt.twin is None
    assert gpt.twin_peak_memory_gib is not None and gpt.twin_peak_memory_gib > gpt.usable_memory_gib
    assert gpt.bpipe.peak_memory_gib <= gpt.usable_memory_gib
    saved = {c.name for c in gpt.savings}
    assert "recompute" in saved
    assert gpt.component("recompute").delta_s < -0.1 * gpt.baseline.step_time_s  # the lever is big
    # and something still eats part of it
    assert gpt.costs and (Eater.BUBBLE in gpt.eaters or Eater.TRANSFER in gpt.eaters)


def test_llama_gets_nothing_from_balancing(llama: BPipeExplanation) -> None:
    assert llama.bpipe is not None
    # flash attention keeps activations small: the best BPipe configuration fits as plain 1F1B too
    assert llama.twin_fits is True and llama.twin is not None
    assert llama.levers == ()
    assert llama.twin.step_time_s <= llama.bpipe.step_time_s  # BPipe only adds to its own twin
    assert Eater.BUBBLE in llama.eaters or Eater.TRANSFER in llama.eaters
    assert llama.baseline.config.recompute is Recompute.NONE


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_components_add_up_to_the_step_difference(which: str, request: pytest.FixtureRequest) -> None:
    e: BPipeExplanation = request.getfixturevalue(which)
    assert e.bpipe is not None
    assert [c.name for c in e.components] == list(TIME_COMPONENTS)
    assert sum(c.baseline_s for c in e.components) == pytest.approx(e.baseline.step_time_s, rel=1e-9)
    assert sum(c.bpipe_s for c in e.components) == pytest.approx(e.bpipe.step_time_s, rel=1e-9)
    assert e.gain == pytest.approx(e.baseline.step_time_s / e.bpipe.step_time_s - 1)
    assert e.bpipe.config.uses_bpipe  # schedule bpipe, or another family with --bpipe (interleaved)
    assert not e.baseline.config.uses_bpipe
    assert e.hosted_gib > 0 and Eater.ACCEPTOR_MEMORY in e.eaters
    d = e.to_dict()
    components = d["components_s"]
    assert d["verdict"] == e.verdict.value and isinstance(components, dict)
    assert set(components) == set(TIME_COMPONENTS)


def test_not_applicable_without_three_pipeline_ranks() -> None:
    # 2 GPUs: pp <= 2, and BPipe needs a partner rank
    e = explain_bpipe(Searcher(model_preset("gpt-1.7b"), A100), num_gpus=2, global_batch=8)
    assert e.verdict is Verdict.NOT_APPLICABLE and e.bpipe is None and e.levers == ()
