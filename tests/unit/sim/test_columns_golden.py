"""Golden comparisons of the integer-column paths with the Action-object references.

- :func:`derive_communication` (columns) against :func:`derive_communication_actions` (the reference), on random
  compute orders of every family, with recomputation, host offload and BPipe markers;
- the validator's fast path (:func:`columns_valid`) against the reference scan (:func:`validate_rules`) on
  valid schedules and on random mutations of them: it never accepts what the reference rejects, it accepts every
  generated schedule, and it hands the dry run the same message keys;
- a schedule made from columns equals the one made from its actions, and round-trips.
"""

from __future__ import annotations

import random

import pytest

from evenpipe.errors import ConfigError, ScheduleFormatError, ScheduleValidationError
from evenpipe.schedule import build_schedule
from evenpipe.schedule.bpipe import bpipe_transform
from evenpipe.schedule.build import add_offload, add_recompute, compute_order
from evenpipe.schedule.columns import actions_of_columns, columns_of_actions
from evenpipe.schedule.comm import derive_communication, derive_communication_actions
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.validate import validate, validate_rules
from evenpipe.schedule.validate_columns import columns_valid

from .test_fast_golden import _schedule, _shape

def _compute(rng: random.Random) -> Schedule:
    """A random compute order (sometimes with recomputation, host offload, or BPipe's markers)."""
    while True:
        fam, p, m, v = _shape(rng)
        try:
            c = compute_order(fam, num_ranks=p, num_microbatches=m, num_chunks=v)
            if rng.random() < 0.3:
                c = add_recompute(c)
            if rng.random() < 0.2 and not fam.has_chunks:
                c = add_offload(c, ranks={0})
            if rng.random() < 0.3 and p >= 3:
                c = bpipe_transform(c)  # a full schedule: the derivation drops and re-derives its transfers
            return c
        except ConfigError:
            continue


def _mutate(rng: random.Random, s: Schedule) -> Schedule | None:
    """One random edit: swap neighbours, drop, duplicate, move, re-peer or re-kind an action."""
    acts = [list(a) for a in s.actions]
    r = rng.randrange(s.num_ranks)
    if not acts[r]:
        return None
    i = rng.randrange(len(acts[r]))
    a = acts[r][i]
    op = rng.randrange(6)
    try:
        if op == 0 and i + 1 < len(acts[r]):
            acts[r][i], acts[r][i + 1] = acts[r][i + 1], acts[r][i]
        elif op == 1:
            del acts[r][i]
        elif op == 2:
            acts[r].insert(rng.randrange(len(acts[r]) + 1), a)
        elif op == 3:
            acts[r][i] = Action(a.kind, a.stage, a.microbatch,
                                rng.randrange(s.num_ranks) if a.kind.is_transfer else None)
        elif op == 4:
            peer = a.peer if a.peer is not None else rng.randrange(s.num_ranks)
            acts[r][i] = Action(rng.choice(list(ActionKind)), a.stage, a.microbatch, peer)
        else:
            acts[r].insert(rng.randrange(len(acts[r])), acts[r].pop(i))
    except ScheduleFormatError:
        return None
    return s.with_actions(acts)


@pytest.mark.parametrize("seed", range(3))
def test_columns_derivation_equals_the_action_reference(seed: int) -> None:
    rng = random.Random(seed)
    for case in range(60):
        compute = _compute(rng)
        reference = derive_communication_actions(compute)
        derived = derive_communication(compute)
        assert derived == reference, f"case {case}: {compute.name} P={compute.num_ranks}"
        assert derived.actions == reference.actions and derived.columns == reference.columns


@pytest.mark.parametrize("seed", range(3))
def test_fast_validator_decides_like_the_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    rejected = 0
    for case in range(40):
        s = _schedule(rng, compute_only=False)
        keys = columns_valid(s)
        assert keys is not None, f"case {case}: a generated {s.name} schedule missed the fast path"
        assert keys == validate_rules(s)
        for _ in range(4):
            t = _mutate(rng, s)
            if t is None:
                continue
            fast = columns_valid(t)
            try:
                reference = validate_rules(t)
            except ScheduleValidationError:
                assert fast is None, f"case {case}: the fast path accepted what the reference rejects"
                rejected += 1
                continue
            assert fast == reference, f"case {case}: both accept, the message keys differ"
    assert rejected >= 50  # the mutations really produce invalid schedules


def test_mutated_schedules_raise_the_reference_error() -> None:
    # validate() words errors through the reference scan: same rule and message as before
    s = build_schedule("1f1b", num_ranks=3, num_microbatches=4)
    acts = [list(a) for a in s.actions]
    acts[1].pop(0)  # rank 1 loses its first receive
    with pytest.raises(ScheduleValidationError) as err:
        validate(s.with_actions(acts))
    assert err.value.rule in ("dependency", "matching")


def test_columns_and_actions_describe_the_same_schedule() -> None:
    s = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    from_actions = s.with_actions(s.actions)
    from_columns = s.with_columns(columns_of_actions(s.actions))
    assert from_actions == from_columns == s
    assert actions_of_columns(from_columns.columns) == s.actions
    assert Schedule.from_text(from_columns.to_text()) == s
    assert hash(from_actions) == hash(from_columns)


def test_a_trace_of_times_equals_its_records_form() -> None:
    from evenpipe.sim import SimCosts, Trace, simulate
    s = build_schedule("zb-h1", num_ranks=4, num_microbatches=8)
    lazy = simulate(s, SimCosts.uniform(num_stages=4, weight=1.0, output_bytes=1.0))
    eager = Trace(schedule=lazy.schedule, actions=lazy.actions, transfers=lazy.transfers, memory=lazy.memory,
                  unit_bytes=lazy.unit_bytes, step_time=lazy.step_time, source=lazy.source)
    fresh = simulate(s.with_actions(s.actions), SimCosts.uniform(num_stages=4, weight=1.0, output_bytes=1.0))
    assert eager == lazy == fresh
    for name in ("num_ranks", "num_actions", "bubble_fraction", "repeated_bubble_fraction", "peak_activations"):
        assert getattr(eager, name) == getattr(lazy, name), name
    assert [eager.busy_time(r) for r in range(4)] == [lazy.busy_time(r) for r in range(4)]
    assert [eager.action_times(r) for r in range(4)] == [lazy.action_times(r) for r in range(4)]
    assert Trace.from_json(lazy.to_json()) == lazy
