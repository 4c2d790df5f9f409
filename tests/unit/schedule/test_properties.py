"""Property tests: every generated schedule validates, is complete, and never holds negative memory."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenpipe.errors import ConfigError
from evenpipe.schedule import (ActionKind, Schedule, ScheduleFamily, build_schedule, held_units, held_units_trace,
                               validate)
from evenpipe.schedule.family import Transform
from evenpipe.schedule.generate.interleaved import interleaved_round_size

K = ActionKind


@st.composite
def configs(draw: st.DrawFn) -> tuple[ScheduleFamily, int, int, int, bool, bool]:
    family = draw(st.sampled_from(list(ScheduleFamily)))
    P = draw(st.integers(1, 16))
    if family is ScheduleFamily.INTERLEAVED and draw(st.booleans()):
        M = P * draw(st.integers(1, max(1, 64 // P)))  # Megatron's case
    else:
        M = draw(st.integers(1, 64))
    V = draw(st.integers(1, 4)) if family.has_chunks else family.traits.chunks.chunks(None)
    bpipe = P >= 2 and Transform.BPIPE in family.traits.transforms and draw(st.booleans())
    return family, P, M, V, draw(st.booleans()), bpipe


def check_complete(s: Schedule) -> None:
    counts = Counter((a.kind, a.stage, a.microbatch) for acts in s.actions for a in acts if a.kind.is_compute)
    for stage in range(s.num_stages):
        for m in range(s.num_microbatches):
            assert counts[(K.FORWARD, stage, m)] == 1
            split = counts[(K.BACKWARD_INPUT, stage, m)], counts[(K.BACKWARD_WEIGHT, stage, m)]
            assert (counts[(K.BACKWARD, stage, m)], split) in ((1, (0, 0)), (0, (1, 1)))


@settings(max_examples=120, deadline=None)
@given(configs())
def test_every_generated_schedule_validates(config: tuple[ScheduleFamily, int, int, int, bool, bool]) -> None:
    family, P, M, V, recompute, bpipe = config
    if family.traits.microbatch_error(P, M, V) is not None:
        assert family is not ScheduleFamily.INTERLEAVED or interleaved_round_size(P, M) is None
        with pytest.raises(ConfigError, match=f"M={M} for P={P}"):
            build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V)
        return
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V, recompute=recompute, bpipe=bpipe)
    validate(s)
    if bpipe:  # BPipe on any schedule: within its budget, never above the plain schedule's peak
        plain = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V, recompute=recompute)
        assert max(held_units(s)) <= s.meta["budget"] <= max(held_units(plain))
    check_complete(s)
    assert s.num_stages == P * V
    for acts in s.actions:
        trace = held_units_trace(acts)
        assert not trace or (min(trace) >= 0 and trace[-1] == 0)
    cap = family.traits.activation_cap
    if cap is not None:  # memory-capped families never exceed their cap (in chunk-activations)
        assert max(held_units(s)) <= cap(P)
    if family is ScheduleFamily.V_MIN:  # the paper's V-Min: (P + 4) // 3 micro-batches, two chunks each
        assert max(held_units(s)) <= 2 * ((P + 4) // 3)
    if family is ScheduleFamily.DUALPIPE_V:  # DualPipe's PP + 1 stage-activations per device, PP = 2P stages
        assert held_units(s) == [2 * P + 1] * P
    if family is ScheduleFamily.BPIPE:
        assert max(held_units(s)) <= math.ceil((P + 1) / 2)
        if M >= P:
            assert max(held_units(s)) == math.ceil((P + 1) / 2)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(1, 40), st.integers(1, 12))
def test_bpipe_any_budget_is_met_or_refused_with_a_working_one(P: int, M: int, budget: int) -> None:
    try:
        s = build_schedule("bpipe", num_ranks=P, num_microbatches=M, bpipe_budget=budget)
    except ValueError as e:
        smallest = int(str(e).rsplit(" ", 1)[-1])
        assert smallest > budget
        s = build_schedule("bpipe", num_ranks=P, num_microbatches=M, bpipe_budget=smallest)
        budget = smallest
    assert max(held_units(s)) <= budget
