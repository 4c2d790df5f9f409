"""Predicted step and real tokens per second of global batches of documents under each micro-batching policy, by
the simulator (issue 34).

For one global batch of document lengths, each policy (:mod:`evenpipe.plan.microbatch`) groups the documents into
micro-batches of ``cfg.microbatch_size`` rows of ``seq_len`` tokens (the source's model's), every data-parallel
replica the same count; each micro-batch becomes a :class:`~evenpipe.cost.shape.MicrobatchShape` (its computed
tokens and squared lengths: a padded row counts its padding), and each replica's micro-batches are estimated as
one step of ``cfg`` by :func:`~evenpipe.cost.estimate.estimate_with`, which simulates the schedule with each
micro-batch's own durations and bytes (no closed formula). The batch's step is its slowest replica's; its real
tokens are the documents' (padding excluded). The policies balance with a :class:`MicrobatchCost` read off the
same source (:func:`microbatch_cost_of`).

What a micro-batch computes: by default its documents only, each attending to itself (a per-document attention
kernel: tokens = the documents', squared lengths = theirs; a padded row counts its padding). ``row_multiple=m``
prices it as evenpipe's runtime runs it (:mod:`evenpipe.runtime.document_batches`, ``models.layers``): ``b`` rows
each as long as the longest row rounded up to a multiple of ``m`` (at most ``seq_len``), so ``b·T`` tokens, and
attention once per run of a row (each document, and the row's padding as one more run), so the squared lengths
of the documents plus each row's padding squared.

Public API (for benchmarks and the runtime's measured comparison): :func:`predict_policies` (one batch),
:func:`predict_throughput` (several batches, summed), :func:`microbatch_shapes` (a plan's shapes) and
:func:`microbatch_cost_of`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from evenpipe.cost.estimate import Estimate, estimate_with
from evenpipe.cost.parallel import stage_layers
from evenpipe.cost.parallel import ParallelConfig
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.source import CostSource, shape_of
from evenpipe.errors import ConfigError
from evenpipe.plan.microbatch import (Microbatch, MicrobatchBudget, MicrobatchCost, MicrobatchPlan, Policy,
                                     parse_policy, plan_microbatches)

__all__ = ["BatchPrediction", "Throughput", "microbatch_cost_of", "microbatch_shapes", "predict_batch",
           "predict_policies", "predict_throughput", "stage_bytes_per_token", "larger_peaks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPrediction:
    """One global batch under one policy."""

    policy: Policy
    step_s: float
    """Predicted step (the slowest replica's estimate: pipeline, reduction, optimizer)."""
    real_tokens: int
    """The documents' tokens."""
    computed_tokens: int
    """Tokens computed, padding included."""
    num_microbatches: int
    """Micro-batches per replica."""
    imbalance: float
    """The plan's slowest over mean micro-batch time (its own cost model)."""
    peak_memory_gib: float
    """The largest rank's predicted peak over the replicas."""
    fits: bool
    """Whether every replica fits the source's memory budget."""

    @property
    def tokens_per_s(self) -> float:
        """Real tokens per second."""
        return self.real_tokens / self.step_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """Several global batches under one policy, summed."""

    policy: Policy
    batches: tuple[BatchPrediction, ...]

    @property
    def step_s(self) -> float:
        """Predicted seconds of every batch."""
        return sum(b.step_s for b in self.batches)

    @property
    def tokens_per_s(self) -> float:
        """Real tokens over predicted seconds."""
        return sum(b.real_tokens for b in self.batches) / self.step_s

    @property
    def fits(self) -> bool:
        return all(b.fits for b in self.batches)

    def mean(self, field: str) -> float:
        """Mean of a numeric :class:`BatchPrediction` field over the batches."""
        return sum(getattr(b, field) for b in self.batches) / len(self.batches)


def microbatch_cost_of(source: CostSource, cfg: ParallelConfig) -> MicrobatchCost:
    """The planner's linear-plus-quadratic cost of a micro-batch, read off ``source``: seconds per token and per
    squared document length of one micro-batch's forward and backward over every stage (two shapes of one row's
    tokens, one document of ``seq_len`` and ``seq_len`` documents of one token: the matrices see the same
    tokens, so the difference is attention), and saved bytes per token over every stage."""
    s = source.model.seq_len
    padded = shape_of(source.model, cfg)
    row = MicrobatchShape(size=cfg.microbatch_size, seq_len=s, tokens=s, squared_lengths=s * s)
    flat = MicrobatchShape(size=cfg.microbatch_size, seq_len=s, tokens=s, squared_lengths=s)
    work = {sh: sum(st.forward + st.backward for st in source.stage_costs(cfg, sh).stages) for sh in (row, flat)}
    per_square = max(0.0, (work[row] - work[flat]) / (s * s - s)) if s > 1 else 0.0
    per_token = max(0.0, (work[flat] - per_square * s) / s)
    saved = sum(st.activation_bytes for st in source.stage_costs(cfg, padded).stages)
    return MicrobatchCost(per_token=per_token, per_square=per_square, bytes_per_token=saved / padded.num_tokens)


def _shape(mb: Microbatch, lengths: Sequence[int], *, rows: int, seq_len: int, padded: bool,
           row_multiple: int | None) -> MicrobatchShape:
    """A planned micro-batch's shape: padded rows count their padding; an empty one runs one token; with
    ``row_multiple``, whole rows of the longest row's length rounded up (the module docstring)."""
    if row_multiple is not None:
        runs = [[lengths[d] for d in row] for row in mb.rows] + [[] for _ in range(rows - len(mb.rows))]
        longest = max((sum(run) for run in runs), default=0)
        width = min(seq_len, max(row_multiple, -(-longest // row_multiple) * row_multiple))
        squares = sum(n * n for run in runs for n in run) + sum((width - sum(run)) ** 2 for run in runs)
        return MicrobatchShape(size=rows, seq_len=seq_len, tokens=rows * width, squared_lengths=squares)
    docs = [lengths[d] for d in mb.documents]
    if not docs:
        return MicrobatchShape(size=rows, seq_len=seq_len, tokens=1, squared_lengths=1)
    if padded:  # one document per row, each row as long as the longest
        width = max(docs)
        return MicrobatchShape.of_documents([width] * len(docs), size=rows, seq_len=seq_len)
    return MicrobatchShape.of_documents(docs, size=rows, seq_len=seq_len)


def microbatch_shapes(plan: MicrobatchPlan, lengths: Sequence[int], *, rows: int, seq_len: int,
                      row_multiple: int | None = None) -> tuple[tuple[MicrobatchShape, ...], ...]:
    """Per replica, its micro-batches' shapes in the order they run (``row_multiple``: as the runtime computes
    them, see the module docstring)."""
    if row_multiple is not None and row_multiple < 1:
        raise ConfigError(f"row_multiple must be an integer >= 1 (or None), got {row_multiple}")
    padded = plan.policy is Policy.PAD
    return tuple(tuple(_shape(mb, lengths, rows=rows, seq_len=seq_len, padded=padded, row_multiple=row_multiple)
                       for mb in rep) for rep in plan.replicas)


def predict_batch(lengths: Sequence[int], *, source: CostSource, cfg: ParallelConfig, policy: "Policy | str",
                  cost: MicrobatchCost | None = None, num_microbatches: int | None = None,
                  row_multiple: int | None = None) -> BatchPrediction:
    """One global batch of documents of ``lengths`` under ``policy`` with ``cfg``'s parallelism and schedule
    (its ``global_batch`` and shapes are the plan's; ``num_microbatches`` per replica fixes their count;
    ``row_multiple``: priced as the runtime computes them, see the module docstring). Documents longer than the
    model's ``seq_len`` are refused (ConfigError, one line): split them first."""
    policy = parse_policy(policy)
    rows, seq_len = cfg.microbatch_size, source.model.seq_len
    budget = MicrobatchBudget(row_len=seq_len, rows=rows)
    cost = cost or microbatch_cost_of(source, cfg)
    plan = plan_microbatches(lengths, policy=policy, budget=budget, cost=cost, num_replicas=cfg.dp,
                             num_microbatches=num_microbatches)
    shapes = microbatch_shapes(plan, lengths, rows=rows, seq_len=seq_len, row_multiple=row_multiple)
    count = len(shapes[0])
    estimates: list[Estimate] = []
    for rep in shapes:
        rep_cfg = dataclasses.replace(cfg, global_batch=count * rows * cfg.dp, microbatch_shapes=rep)
        estimates.append(estimate_with(source, rep_cfg))
    return BatchPrediction(
        policy=policy, step_s=max(e.step_time_s for e in estimates), real_tokens=sum(lengths),
        computed_tokens=sum(sh.num_tokens for rep in shapes for sh in rep), num_microbatches=count,
        imbalance=plan.imbalance, peak_memory_gib=max(e.peak_memory_gib for e in estimates),
        fits=all(e.fits for e in estimates))


def predict_policies(lengths: Sequence[int], *, source: CostSource, cfg: ParallelConfig,
                     policies: Iterable["Policy | str"] = tuple(Policy),
                     row_multiple: int | None = None) -> dict[Policy, BatchPrediction]:
    """:func:`predict_batch` of one global batch under each of ``policies``."""
    cost = microbatch_cost_of(source, cfg)
    return {parse_policy(p): predict_batch(lengths, source=source, cfg=cfg, policy=p, cost=cost,
                                           row_multiple=row_multiple) for p in policies}


def predict_throughput(batches: Iterable[Sequence[int]], *, source: CostSource, cfg: ParallelConfig,
                       policies: Iterable["Policy | str"] = tuple(Policy),
                       row_multiple: int | None = None) -> dict[Policy, Throughput]:
    """:func:`predict_policies` over several global batches, per policy their predictions together."""
    cost = microbatch_cost_of(source, cfg)
    chosen = [parse_policy(p) for p in policies]
    out: dict[Policy, list[BatchPrediction]] = {p: [] for p in chosen}
    for batch in batches:
        for p in chosen:
            out[p].append(predict_batch(batch, source=source, cfg=cfg, policy=p, cost=cost, row_multiple=row_multiple))
    return {p: Throughput(policy=p, batches=tuple(v)) for p, v in out.items()}


def stage_bytes_per_token(source: CostSource, cfg: ParallelConfig) -> float:
    """Activation bytes one micro-batch of documents saves per position it computes on ``cfg``'s largest stage
    (its layers, kept input, and the embedding's or head's extras): ``cfg.microbatch_size`` full rows as the
    runtime runs documents, divided by their positions (linear in them, as the profiled fits are)."""
    s, b = source.model.seq_len, cfg.microbatch_size
    shape = MicrobatchShape(size=b, seq_len=s, tokens=b * s, squared_lengths=b * s * s)
    layers = stage_layers(source.model, cfg)
    last = len(layers) - 1
    act = source.layer_bytes(cfg, 0, shape)
    units = [n * act.layer_saved + (act.boundary if st else act.embedding) + (act.head if st == last else 0.0)
             for st, n in enumerate(layers)]
    return max(units) / shape.num_tokens


def larger_peaks(a: Sequence[Mapping[str, int]], b: Sequence[Mapping[str, int]]) -> tuple[dict[str, int], ...]:
    """Per rank and category the larger of two predictions (``a`` empty: ``b``)."""
    if not a:
        return tuple(dict(p) for p in b)
    return tuple({c: max(x[c], y[c]) for c in x} for x, y in zip(a, b, strict=True))
