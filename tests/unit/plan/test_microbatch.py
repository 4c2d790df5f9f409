"""The micro-batch planner: every document placed exactly once, no budget exceeded, equal counts per replica,
``balance`` at least as even as ``pack``, LPT within Graham's bound of the brute-force optimum, and one-line errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenpipe.errors import ConfigError
from evenpipe.plan.microbatch import (
    MicrobatchBudget,
    MicrobatchCost,
    Policy,
    balance,
    first_fit_prefix,
    lpt_bound,
    pipeline_order,
    plan_microbatches,
)

ROW = 64
lengths_st = st.lists(st.integers(1, ROW), min_size=1, max_size=60)
budget_st = st.builds(lambda rows, mem: MicrobatchBudget(row_len=ROW, rows=rows, max_bytes=mem),
                      st.integers(1, 4), st.one_of(st.none(), st.integers(ROW, 4 * ROW).map(float)))
cost_st = st.builds(lambda a, c: MicrobatchCost(per_token=a, per_square=c), st.floats(0.1, 4.0),
                    st.floats(0.0, 0.5))


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, budget=budget_st, cost=cost_st, policy=st.sampled_from(list(Policy)),
       replicas=st.integers(1, 3))
def test_every_document_once_within_budgets_and_equal_counts(lengths: list[int], budget: MicrobatchBudget,
                                                             cost: MicrobatchCost, policy: Policy,
                                                             replicas: int) -> None:
    plan = plan_microbatches(lengths, policy=policy, budget=budget, cost=cost, num_replicas=replicas)
    placed = sorted(d for m in plan.microbatches for d in m.documents)
    assert placed == list(range(len(lengths)))
    assert len({len(rep) for rep in plan.replicas}) == 1
    for m in plan.microbatches:
        assert len(m.rows) <= budget.rows
        assert all(sum(lengths[d] for d in row) <= budget.row_len for row in m.rows)
        assert m.tokens == sum(lengths[d] for d in m.documents) <= m.computed_tokens
        if budget.max_bytes is not None:
            assert m.bytes <= budget.max_bytes
        if policy is Policy.PAD:
            assert all(len(row) == 1 for row in m.rows)
            assert m.computed_tokens == len(m.rows) * max([lengths[d] for d in m.documents], default=0)
        else:
            assert m.computed_tokens == m.tokens
            assert m.time == pytest.approx(sum(cost.doc_time(lengths[d]) for d in m.documents))
    empty = [m for m in plan.microbatches if not m.documents]
    if empty and policy is not Policy.BALANCE:  # only where no split could even out the replicas' counts
        assert len(empty) < replicas and all(len(m.documents) == 1 for m in plan.microbatches if m.documents)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, rows=st.integers(1, 4), multiple=st.sampled_from([1, 8, 16]),
       widest=st.integers(8, ROW), policy=st.sampled_from(list(Policy)), replicas=st.integers(1, 3))
def test_a_memory_budget_holds_for_the_runtime_shapes(lengths: list[int], rows: int, multiple: int, widest: int,
                                                     policy: Policy, replicas: int) -> None:
    """With ``length_multiple``, a micro-batch's bytes are those of the runtime's ``rows x T`` (``T`` its longest row
    rounded up): none exceeds ``max_bytes``, and a document that alone would is refused, named."""
    cost = MicrobatchCost(per_token=1.0, per_square=0.01, bytes_per_token=3.0)
    budget = MicrobatchBudget(row_len=ROW, rows=rows, max_bytes=3.0 * rows * widest, length_multiple=multiple)
    fitting = [n for n in lengths if n <= budget.widest_document(cost.bytes_per_token)]
    if len(fitting) < len(lengths):
        with pytest.raises(ConfigError, match=r"document \d+ of \d+ tokens needs"):
            plan_microbatches(lengths, policy=policy, budget=budget, cost=cost, num_replicas=replicas)
    if not fitting:
        return
    plan = plan_microbatches(fitting, policy=policy, budget=budget, cost=cost, num_replicas=replicas)
    assert sorted(d for m in plan.microbatches for d in m.documents) == list(range(len(fitting)))
    for m in plan.microbatches:
        longest = max((sum(fitting[d] for d in row) for row in m.rows), default=0)
        assert cost.bytes_per_token * budget.footprint(m.tokens, longest) <= budget.max_bytes
    assert budget.footprint(0, budget.widest_document(cost.bytes_per_token)) * 3.0 <= budget.max_bytes


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, budget=budget_st, cost=cost_st, replicas=st.integers(1, 3))
def test_balance_is_at_least_as_even_as_pack(lengths: list[int], budget: MicrobatchBudget, cost: MicrobatchCost,
                                             replicas: int) -> None:
    packed = plan_microbatches(lengths, policy="pack", budget=budget, cost=cost, num_replicas=replicas)
    balanced = plan_microbatches(lengths, policy="balance", budget=budget, cost=cost, num_replicas=replicas)
    assert len(balanced.microbatches) == len(packed.microbatches)
    assert balanced.imbalance <= packed.imbalance + 1e-9
    assert balanced.max_time <= packed.max_time + 1e-9


def _optimum(times: list[float], m: int) -> float:
    best = float("inf")
    for assign in itertools.product(range(m), repeat=len(times)):
        loads = [0.0] * m
        for t, b in zip(times, assign):
            loads[b] += t
        best = min(best, max(loads))
    return best


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7), m=st.integers(2, 3), cost=cost_st)
def test_balance_is_within_grahams_bound_of_the_optimum(lengths: list[int], m: int, cost: MicrobatchCost) -> None:
    budget = MicrobatchBudget(row_len=40, rows=len(lengths))  # the token budget never binds
    mbs = balance(lengths, budget, cost, count=m)
    opt = _optimum([cost.doc_time(n) for n in lengths], m)
    assert max(mb.time for mb in mbs) <= lpt_bound(m) * opt + 1e-9


def test_balance_evens_out_what_first_fit_leaves_uneven() -> None:
    # first fit in data order puts both long documents together: attention makes that micro-batch 3.7x the other
    lengths = [32, 32] + [8] * 8
    budget, cost = MicrobatchBudget(row_len=64, rows=1), MicrobatchCost(per_token=1.0, per_square=1.0)
    packed = plan_microbatches(lengths, policy="pack", budget=budget, cost=cost)
    balanced = plan_microbatches(lengths, policy="balance", budget=budget, cost=cost)
    assert [m.time for m in packed.microbatches] == [576, 2112]  # cheap one first (pipeline order)
    assert [m.time for m in balanced.microbatches] == [1344, 1344] and balanced.imbalance == 1.0
    assert sorted(m.documents[0] for m in balanced.microbatches) == [0, 1]


def test_the_order_puts_cheap_micro_batches_at_the_ends() -> None:
    lengths = [10, 50, 20, 40, 30]
    budget, cost = MicrobatchBudget(row_len=64), MicrobatchCost()
    plan = plan_microbatches(lengths, policy="pad", budget=budget, cost=cost)
    assert [m.tokens for m in plan.replicas[0]] == [10, 30, 50, 40, 20]
    assert [m.tokens for m in pipeline_order(plan.replicas[0])] == [10, 30, 50, 40, 20]


def test_pad_counts_padding_as_computed_time() -> None:
    plan = plan_microbatches([2, 8, 3], policy="pad", budget=MicrobatchBudget(row_len=8, rows=3),
                             cost=MicrobatchCost(per_token=1.0, per_square=0.0))
    assert plan.microbatches[0].computed_tokens == 24 and plan.microbatches[0].time == 24
    assert plan.padding_fraction == pytest.approx(1 - 13 / 24)


@pytest.mark.parametrize("kwargs,needle", [
    ({"lengths": [3, 70]}, "document 1 has 70 tokens, more than the row budget of 64"),
    ({"lengths": [3, 0]}, "document 1 has length 0"),
    ({"policy": "greedy"}, "unknown micro-batching policy 'greedy'; choose one of: pad, pack, balance"),
    ({"num_microbatches": 1, "lengths": [60, 60]}, "need at least 2 micro-batches"),
    ({"max_bytes": 4.0}, "document 1 of 5 tokens needs 5 bytes of activations, more than the micro-batch memory "
                          "budget of 4"),
])
def test_bad_input_is_one_line(kwargs: dict, needle: str) -> None:
    args = {"lengths": [3, 5], "policy": "balance", "num_microbatches": None, "max_bytes": None, **kwargs}
    with pytest.raises(ConfigError, match=needle) as err:
        plan_microbatches(args["lengths"], policy=args["policy"], num_microbatches=args["num_microbatches"],
                          budget=MicrobatchBudget(row_len=64, max_bytes=args["max_bytes"]))
    assert "\n" not in str(err.value)


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, budget=budget_st, policy=st.sampled_from(list(Policy)), replicas=st.integers(1, 3),
       per_replica=st.integers(1, 6))
def test_a_fixed_count_is_met_exactly_or_refused(lengths: list[int], budget: MicrobatchBudget, policy: Policy,
                                                 replicas: int, per_replica: int) -> None:
    cost = MicrobatchCost(per_token=1.0, per_square=0.1)
    try:
        plan = plan_microbatches(lengths, policy=policy, budget=budget, cost=cost, num_replicas=replicas,
                                 num_microbatches=per_replica)
    except ConfigError as err:
        assert "only" in str(err) or "need at least" in str(err)
        needed = len(plan_microbatches(lengths, policy=policy, budget=budget, cost=cost).microbatches)
        assert needed > per_replica * replicas
        return
    assert [len(rep) for rep in plan.replicas] == [per_replica] * replicas
    assert sorted(d for m in plan.microbatches for d in m.documents) == list(range(len(lengths)))


def test_first_fit_prefix_stops_where_one_more_micro_batch_would_open() -> None:
    budget = MicrobatchBudget(row_len=10, rows=2)
    assert first_fit_prefix([6, 6, 4, 4, 9, 3], budget, 1) == 4  # rows 6+4 and 6+4; the 9 opens a second
    assert first_fit_prefix([6, 6, 4, 4, 9, 3], budget, 2) == 6
    assert first_fit_prefix([11, 1], budget, 3) == 0


def test_balance_evens_each_micro_batchs_rows() -> None:
    """A micro-batch runs as long as its longest row: balance spreads its documents over its rows (the longest
    first into the emptiest), keeping the rows when that is no shorter."""
    from evenpipe.plan.microbatch import even_rows
    budget = MicrobatchBudget(row_len=10, rows=2)
    assert even_rows([[0, 1], [2]], [6, 3, 3], budget) == [[0], [1, 2]]  # longest row 9 -> 6
    assert even_rows([[0], [1]], [5, 5], budget) == [[0], [1]]  # already even
    assert even_rows([[0, 1, 2], [3, 4]], [4, 3, 3, 5, 5], budget) == [[0, 1, 2], [3, 4]]  # the last 3 finds no room
    plan = plan_microbatches([6, 3, 3], policy="balance", budget=budget, num_microbatches=1)
    assert plan.microbatches[0].rows == ((0,), (1, 2))  # first fit into the rows would make 6+3 and 3
