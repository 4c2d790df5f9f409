"""Micro-batches by cost (pure Python): group documents of varying length into micro-batches, three ways.

Vocabulary. A *document* is a run of tokens that attends only to itself (see :mod:`evenpipe.models.documents`).
A micro-batch holds up to ``rows`` *rows* of at most ``row_len`` tokens each; a row holds whole documents.

Policies (:class:`Policy`):

- ``pad``: one document per row, in data order, ``rows`` documents per micro-batch, every row padded to the
  micro-batch's longest document (the padding is computed, so it costs time and memory).
- ``pack``: documents in data order, each into the first micro-batch with a row that has room (first fit), rows
  filled to ``row_len``; no padding is computed (attention is block-diagonal), but micro-batches of one token
  budget can differ several-fold in attention work.
- ``balance``: the same budgets, documents grouped so that every micro-batch's predicted time is as equal as
  possible (:func:`balance`), and each micro-batch's rows as even as they can be (a micro-batch runs as long as
  its longest row: :func:`even_rows`).

Cost (:class:`MicrobatchCost`): time ``a * tokens + c * sum(len**2)`` -- the MLP and projections are linear in
tokens, attention quadratic in each document's length -- and memory ``bytes_per_token * tokens``. Padding counts
as tokens (a padded row of ``L`` tokens costs ``a*L + c*L**2``).

Replicas: every data-parallel replica gets the same number of micro-batches (``num_replicas`` divides their
count), the replicas' total predicted times balanced greedily. Order within a replica (:func:`pipeline_order`):
the cheapest micro-batch first, the next cheapest last, the most expensive in the middle. In a pipeline the first
micro-batch's forward crosses every stage before the last stage can start (the fill) and the last micro-batch's
backward crosses every stage after the others are done (the drain); those two are exposed ``P - 1`` times, while
in the steady state each rank alternates forwards and backwards of different micro-batches, so a long one there
is overlapped by its neighbours' work on the other ranks.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from evenpipe.errors import ConfigError, parse_choice

__all__ = ["Policy", "parse_policy", "MicrobatchBudget", "MicrobatchCost", "Microbatch", "MicrobatchPlan",
           "plan_microbatches", "pad", "pack", "balance", "even_rows", "pipeline_order", "lpt_bound",
           "first_fit_prefix"]


class Policy(enum.Enum):
    """How documents are grouped into micro-batches (see the module docstring)."""

    PAD = "pad"
    """One document per row, rows padded to the micro-batch's longest."""
    PACK = "pack"
    """Rows filled first-fit in data order up to the token budget."""
    BALANCE = "balance"
    """Rows filled so that micro-batches' predicted times are as equal as possible."""


def parse_policy(value: "str | Policy") -> Policy:
    """``"pad"`` / ``"pack"`` / ``"balance"`` -> :class:`Policy`; else ConfigError listing them."""
    return parse_choice(Policy, value, "micro-batching policy")


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchBudget:
    """What one micro-batch may hold."""

    row_len: int
    """Tokens per row: the longest document allowed (split longer ones before planning)."""
    rows: int = 1
    """Rows per micro-batch (the micro-batch size ``b``)."""
    max_bytes: float | None = None
    """Predicted activation bytes one micro-batch may need (None: no limit beyond the token budget)."""
    length_multiple: int | None = None
    """None: a micro-batch's bytes are those of the tokens it computes. An integer ``m``: of the tokens the runtime
    computes for it (:mod:`evenpipe.runtime.document_batches`): ``rows`` rows as long as its longest row rounded up
    to a multiple of ``m`` (at most ``row_len``)."""

    def __post_init__(self) -> None:
        if self.row_len < 1 or self.rows < 1:
            raise ConfigError(f"a micro-batch budget needs row_len >= 1 and rows >= 1, got {self.row_len} and "
                              f"{self.rows}")
        if self.length_multiple is not None and self.length_multiple < 1:
            raise ConfigError(f"a micro-batch's length multiple must be >= 1, got {self.length_multiple}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"the micro-batch memory budget must be > 0 bytes, got {self.max_bytes}")

    @property
    def tokens(self) -> int:
        """Token budget of one micro-batch: ``rows * row_len``."""
        return self.rows * self.row_len

    def footprint(self, tokens: int, longest_row: int) -> int:
        """Tokens whose activations a micro-batch of ``tokens`` real tokens, the longest row ``longest_row``,
        keeps (see :attr:`length_multiple`)."""
        m = self.length_multiple
        if m is None:
            return tokens
        return self.rows * min(self.row_len, max(m, -(-longest_row // m) * m))

    def widest_document(self, bytes_per_token: float) -> int:
        """The longest document one micro-batch can hold within :attr:`max_bytes` (``row_len`` without one)."""
        if self.max_bytes is None or bytes_per_token <= 0:
            return self.row_len
        if self.length_multiple is None:
            return min(self.row_len, int(self.max_bytes // bytes_per_token))
        widest = int(self.max_bytes // (bytes_per_token * self.rows))
        return widest if widest >= self.row_len else widest // self.length_multiple * self.length_multiple


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchCost:
    """Predicted time and memory of a micro-batch from its documents' lengths (units are the caller's)."""

    per_token: float = 1.0
    """``a``: time per token (MLP, projections, norms), e.g. seconds per token."""
    per_square: float = 0.0
    """``c``: time per squared document length (attention scores), same unit as ``per_token``."""
    bytes_per_token: float = 1.0
    """Activation bytes per token."""

    def __post_init__(self) -> None:
        if min(self.per_token, self.per_square, self.bytes_per_token) < 0:
            raise ConfigError(f"micro-batch cost coefficients must be >= 0, got a={self.per_token}, "
                              f"c={self.per_square}, bytes/token={self.bytes_per_token}")

    def doc_time(self, length: int) -> float:
        """Predicted time of one document (or one padded row) of ``length`` tokens."""
        return self.per_token * length + self.per_square * length * length


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatch:
    """One micro-batch: documents (indices into the planner's lengths) per row, and their predicted cost."""

    rows: tuple[tuple[int, ...], ...]
    """Document indices of each row."""
    tokens: int
    """Real (document) tokens."""
    computed_tokens: int
    """Tokens computed, padding included (``pad`` only differs)."""
    time: float
    """Predicted time, :class:`MicrobatchCost` units."""
    bytes: float
    """Predicted activation bytes."""

    @property
    def documents(self) -> tuple[int, ...]:
        """Every document index, row by row."""
        return tuple(d for row in self.rows for d in row)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchPlan:
    """Each replica's micro-batches, in the order they run."""

    policy: Policy
    replicas: tuple[tuple[Microbatch, ...], ...]
    """``replicas[r]`` is replica ``r``'s micro-batches (every replica the same number)."""

    @property
    def microbatches(self) -> tuple[Microbatch, ...]:
        """Every micro-batch, replica by replica."""
        return tuple(m for rep in self.replicas for m in rep)

    @property
    def max_time(self) -> float:
        """The slowest micro-batch's predicted time."""
        return max((m.time for m in self.microbatches), default=0.0)

    @property
    def mean_time(self) -> float:
        """Mean predicted time per micro-batch."""
        mbs = self.microbatches
        return sum(m.time for m in mbs) / len(mbs) if mbs else 0.0

    @property
    def imbalance(self) -> float:
        """``max_time / mean_time`` (1.0 is perfect balance)."""
        return self.max_time / self.mean_time if self.mean_time else 1.0

    @property
    def padding_fraction(self) -> float:
        """Share of computed tokens that are padding."""
        computed = sum(m.computed_tokens for m in self.microbatches)
        return 1.0 - sum(m.tokens for m in self.microbatches) / computed if computed else 0.0


# --- building blocks -------------------------------------------------------------------------------------------

def _check_lengths(lengths: Sequence[int], budget: MicrobatchBudget) -> None:
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"document {i} has length {n!r}; lengths must be integers >= 1 (drop empty ones)")
        if n > budget.row_len:
            raise ConfigError(f"document {i} has {n} tokens, more than the row budget of {budget.row_len}; "
                              "split long documents or raise the row length")


def _build(rows: Iterable[Sequence[int]], lengths: Sequence[int], cost: MicrobatchCost, *,
           padded: bool = False) -> Microbatch:
    """A :class:`Microbatch` from its rows; ``padded``: one document per row, all padded to the longest."""
    rows_t = tuple(tuple(r) for r in rows if r)
    docs = [lengths[d] for row in rows_t for d in row]
    if padded:
        width = max(docs, default=0)
        computed, time = width * len(docs), cost.doc_time(width) * len(docs)
    else:
        computed, time = sum(docs), sum(cost.doc_time(n) for n in docs)
    return Microbatch(rows=rows_t, tokens=sum(docs), computed_tokens=computed, time=time,
                      bytes=cost.bytes_per_token * computed)


@dataclass(slots=True)
class _Bin:
    """A micro-batch being filled: rows with their used tokens."""

    rows: list[list[int]]
    used: list[int]
    time: float = 0.0
    tokens: int = 0
    order: int = field(default=0)

    def row_for(self, length: int, budget: MicrobatchBudget, cost: MicrobatchCost) -> int | None:
        """The first row with room for a document of ``length`` (None if none, or memory would overflow)."""
        row = next((i for i, u in enumerate(self.used) if u + length <= budget.row_len), None)
        if row is None or budget.max_bytes is None:
            return row
        if budget.length_multiple is None:
            return None if cost.bytes_per_token * (self.tokens + length) > budget.max_bytes else row
        # the emptiest row with room keeps the longest row shortest
        row = min((i for i, u in enumerate(self.used) if u + length <= budget.row_len), key=lambda i: (self.used[i], i))
        longest = max(max(self.used), self.used[row] + length)
        fits = cost.bytes_per_token * budget.footprint(self.tokens + length, longest) <= budget.max_bytes
        return row if fits else None

    def add(self, doc: int, length: int, row: int, cost: MicrobatchCost) -> None:
        self.rows[row].append(doc)
        self.used[row] += length
        self.tokens += length
        self.time += cost.doc_time(length)


def _new_bin(budget: MicrobatchBudget, order: int = 0) -> _Bin:
    return _Bin(rows=[[] for _ in range(budget.rows)], used=[0] * budget.rows, order=order)


def _check_memory(lengths: Sequence[int], budget: MicrobatchBudget, cost: MicrobatchCost) -> None:
    if budget.max_bytes is None:
        return
    worst = max(range(len(lengths)), key=lambda i: lengths[i], default=None)
    if worst is None:
        return
    need = cost.bytes_per_token * budget.footprint(lengths[worst], lengths[worst])
    if need > budget.max_bytes:
        raise ConfigError(f"document {worst} of {lengths[worst]} tokens needs {need:.0f} bytes of activations, more "
                          f"than the micro-batch memory budget of {budget.max_bytes:.0f}")


# --- the three policies ----------------------------------------------------------------------------------------

def pad(lengths: Sequence[int], budget: MicrobatchBudget, cost: MicrobatchCost) -> list[Microbatch]:
    """One document per row, ``budget.rows`` consecutive documents per micro-batch (fewer when padding to the
    longest would overflow the memory budget), each row padded to the micro-batch's longest."""
    out: list[Microbatch] = []
    group: list[int] = []
    for d, n in enumerate(lengths):
        width = max([lengths[g] for g in group] + [n])
        kept = width * (len(group) + 1) if budget.length_multiple is None else budget.footprint(0, width)
        too_big = budget.max_bytes is not None and cost.bytes_per_token * kept > budget.max_bytes
        if group and (len(group) == budget.rows or too_big):
            out.append(_build([[g] for g in group], lengths, cost, padded=True))
            group = []
        group.append(d)
    if group:
        out.append(_build([[g] for g in group], lengths, cost, padded=True))
    return out


def pack(lengths: Sequence[int], budget: MicrobatchBudget, cost: MicrobatchCost) -> list[Microbatch]:
    """First fit in data order: each document into the first micro-batch (oldest first) with a row that has room."""
    bins: list[_Bin] = []
    for d, n in enumerate(lengths):
        for b in bins:
            row = b.row_for(n, budget, cost)
            if row is not None:
                b.add(d, n, row, cost)
                break
        else:
            b = _new_bin(budget, len(bins))
            b.add(d, n, 0, cost)
            bins.append(b)
    return [_build(b.rows, lengths, cost) for b in bins]


def _lpt(lengths: Sequence[int], count: int, budget: MicrobatchBudget, cost: MicrobatchCost) -> list[_Bin] | None:
    """Longest processing time first into the least-loaded micro-batch that has room; None if one cannot fit."""
    bins = [_new_bin(budget, i) for i in range(count)]
    for d in sorted(range(len(lengths)), key=lambda i: (-cost.doc_time(lengths[i]), i)):
        n = lengths[d]
        for b in sorted(bins, key=lambda b: (b.time, b.order)):
            row = b.row_for(n, budget, cost)
            if row is not None:
                b.add(d, n, row, cost)
                break
        else:
            return None
    return bins


def _improve(bins: list[_Bin], lengths: Sequence[int], budget: MicrobatchBudget, cost: MicrobatchCost) -> None:
    """Move single documents off the slowest micro-batch while a move lowers the slowest time (each move strictly
    lowers the sum of squared times, so this ends)."""
    while True:
        top = max(bins, key=lambda b: (b.time, -b.order))
        best: tuple[float, int, int, _Bin, int] | None = None
        for r, row in enumerate(top.rows):
            for i, d in enumerate(row):
                t = cost.doc_time(lengths[d])
                for b in bins:
                    if b is top or b.time + t >= top.time:
                        continue
                    dest = b.row_for(lengths[d], budget, cost)
                    if dest is not None and (best is None or b.time + t < best[0]):
                        best = (b.time + t, r, i, b, dest)
        if best is None:
            return
        _, r, i, b, dest = best
        d = top.rows[r].pop(i)
        top.used[r] -= lengths[d]
        top.tokens -= lengths[d]
        top.time -= cost.doc_time(lengths[d])
        b.add(d, lengths[d], dest, cost)


def balance(lengths: Sequence[int], budget: MicrobatchBudget, cost: MicrobatchCost, *,
            count: int | None = None) -> list[Microbatch]:
    """``count`` micro-batches (default: as many as :func:`pack` makes) of near-equal predicted time.

    Why a greedy and not DynaPipe's dynamic program: with attention masked per document a micro-batch's time is a
    *sum over its documents* (``a*len + c*len**2``), so balancing is multiprocessor scheduling (P||Cmax).
    Longest-processing-time-first into the least-loaded micro-batch (Graham 1969) is within ``4/3 - 1/(3m)`` of
    the optimal slowest micro-batch when the token budget does not bind (:func:`lpt_bound`; tested against brute
    force), runs in ``O(n log n + n m)``, and needs no contiguous order; DynaPipe's O(n^2)-state program
    partitions a *sorted* sequence into contiguous *padded* micro-batches, which is the right shape for padding
    but not for packed rows. A local search then moves single documents off the slowest micro-batch while that
    helps, and the result is never worse than first fit into the same number of micro-batches (both are computed
    and the one with the faster slowest micro-batch is kept), so ``balance`` is at least as even as ``pack``.

    Even is not the same as a faster pipeline step. No grouping lowers the slowest micro-batch below the longest
    document alone, and with the documents of a step fixed the total work is too (time is linear in tokens and
    squared lengths); what is left is the spread, and a pipeline gains from cheap micro-batches at its fill and
    drain (:func:`pipeline_order`), which evening removes. With the shipped lengths split at rows of 1024 (b=1,
    M=8), the longest document is the slowest micro-batch of every step, and the simulator (1f1b, P=4, a
    gpt-tiny profile) predicts micro-batches of exactly equal time 3% slower than first fit's; ``balance`` is
    predicted 1-4% slower than ``pack`` there and with b = 2 or 4 rows of 1024 or rows of 2048.
    """
    packed = pack(lengths, budget, cost)
    count = len(packed) if count is None else count
    if count < len(packed):
        raise ConfigError(f"{len(lengths)} documents need at least {len(packed)} micro-batches of "
                          f"{budget.rows} x {budget.row_len} tokens (first fit); got {count}")
    fallback = packed + [_build([], lengths, cost) for _ in range(count - len(packed))]
    bins = _lpt(lengths, count, budget, cost)
    if bins is None:
        return fallback
    _improve(bins, lengths, budget, cost)
    balanced = [_build(even_rows(b.rows, lengths, budget), lengths, cost) for b in bins]
    return balanced if max(m.time for m in balanced) <= max(m.time for m in fallback) else fallback


def even_rows(rows: Sequence[Sequence[int]], lengths: Sequence[int],
              budget: MicrobatchBudget) -> list[list[int]]:
    """The same documents in rows as even as a greedy makes them: longest first into the emptiest row with room (a
    micro-batch runs as long as its longest row, :mod:`evenpipe.runtime.document_batches`); ``rows`` unchanged
    when the greedy cannot place one or its longest row is no shorter."""
    out: list[list[int]] = [[] for _ in range(budget.rows)]
    used = [0] * budget.rows
    for d in sorted((d for row in rows for d in row), key=lambda d: (-lengths[d], d)):
        room = [i for i in range(budget.rows) if used[i] + lengths[d] <= budget.row_len]
        if not room:
            return [list(r) for r in rows]
        r = min(room, key=lambda i: (used[i], i))
        out[r].append(d)
        used[r] += lengths[d]
    before = max((sum(lengths[d] for d in row) for row in rows), default=0)
    return out if max(used, default=0) < before else [list(r) for r in rows]


def lpt_bound(num_microbatches: int) -> float:
    """Graham's bound on LPT's slowest micro-batch over the optimum: ``4/3 - 1/(3m)``."""
    return 4.0 / 3.0 - 1.0 / (3.0 * num_microbatches)


# --- replicas and order ----------------------------------------------------------------------------------------

def _even_out(mbs: list[Microbatch], target: int | None, multiple: int, lengths: Sequence[int],
              cost: MicrobatchCost, *, padded: bool) -> list[Microbatch]:
    """Split the micro-batch with the most documents (its last document out) until there are ``target``
    micro-batches (or, without a target, until ``multiple`` divides the count); a split never breaks a budget
    (the pieces are smaller). When every micro-batch holds one document, add empty ones (a row of padding)."""
    if target is not None and len(mbs) > target:
        raise ConfigError(f"{len(lengths)} documents need {len(mbs)} micro-batches; only {target} were allowed")
    mbs = list(mbs)
    while (len(mbs) < target) if target is not None else (len(mbs) % multiple):
        i = max(range(len(mbs)), key=lambda j: (len(mbs[j].documents), mbs[j].time)) if mbs else -1
        if i < 0 or len(mbs[i].documents) < 2:
            mbs.append(_build([], lengths, cost))
            continue
        rows = [list(r) for r in mbs[i].rows]
        moved = next(r for r in reversed(rows) if r).pop()
        mbs[i] = _build(rows, lengths, cost, padded=padded)
        mbs.append(_build([[moved]], lengths, cost, padded=padded))
    return mbs


def first_fit_prefix(lengths: Iterable[int], budget: MicrobatchBudget, count: int,
                     cost: MicrobatchCost = MicrobatchCost()) -> int:
    """How many leading documents first fit places into ``count`` micro-batches (it stops at the first that
    would open one more); a document longer than a row ends the prefix too (``cost``: its bytes per token, with
    the budget's ``max_bytes``)."""
    bins: list[_Bin] = []
    taken = 0
    for n in lengths:
        home = next(((b, r) for b in bins for r in [b.row_for(n, budget, cost)] if r is not None), None)
        if home is None:
            if len(bins) == count or n > budget.row_len:
                break
            bins.append(_new_bin(budget, len(bins)))
            home = (bins[-1], 0)
        home[0].add(taken, n, home[1], cost)
        taken += 1
    return taken


def pipeline_order(mbs: Sequence[Microbatch]) -> list[Microbatch]:
    """Cheapest first, next cheapest last, the most expensive in the middle (why: the module docstring)."""
    ranked = sorted(mbs, key=lambda m: m.time)
    front, back = ranked[0::2], ranked[1::2]
    return front + back[::-1]


def _distribute(mbs: Sequence[Microbatch], num_replicas: int) -> list[list[Microbatch]]:
    """Equal counts per replica; each micro-batch (slowest first) to the least-loaded replica that has room."""
    per = len(mbs) // num_replicas
    reps: list[list[Microbatch]] = [[] for _ in range(num_replicas)]
    load = [0.0] * num_replicas
    for m in sorted(mbs, key=lambda m: -m.time):
        r = min((r for r in range(num_replicas) if len(reps[r]) < per), key=lambda r: (load[r], r))
        reps[r].append(m)
        load[r] += m.time
    return reps


def plan_microbatches(lengths: Sequence[int], *, policy: "Policy | str", budget: MicrobatchBudget,
                      cost: MicrobatchCost = MicrobatchCost(), num_replicas: int = 1,
                      num_microbatches: int | None = None) -> MicrobatchPlan:
    """Place every document exactly once under ``policy``. ``num_microbatches`` (per replica) fixes the count
    (ConfigError if the documents need more); without it ``pad`` and ``pack`` make as many as they need and
    ``balance`` as many as ``pack``, each split up to a multiple of ``num_replicas``."""
    policy = parse_policy(policy)
    if num_replicas < 1:
        raise ConfigError(f"data-parallel replicas must be >= 1, got {num_replicas}")
    _check_lengths(lengths, budget)
    _check_memory(lengths, budget, cost)
    if policy is Policy.PAD:
        mbs = pad(lengths, budget, cost)
    elif policy is Policy.PACK:
        mbs = pack(lengths, budget, cost)
    else:
        first_fit = len(pack(lengths, budget, cost))
        count = num_microbatches * num_replicas if num_microbatches else \
            math.ceil(first_fit / num_replicas) * num_replicas
        mbs = balance(lengths, budget, cost, count=count)
    target = num_microbatches * num_replicas if num_microbatches else None
    mbs = _even_out(mbs, target, num_replicas, lengths, cost, padded=policy is Policy.PAD)
    replicas = tuple(tuple(pipeline_order(rep)) for rep in _distribute(mbs, num_replicas))
    return MicrobatchPlan(policy=policy, replicas=replicas)
