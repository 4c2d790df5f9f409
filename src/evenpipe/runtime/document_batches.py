"""Training batches of whole documents: every step's rows hold documents (never a piece of one unless the user
asked to split long ones), attention stays inside each (see :meth:`evenpipe.runtime.stages.StageModule.
packed_forward`), and each micro-batch is as long as it needs: ``[b, T]`` with ``T`` its longest row rounded up
to a multiple of ``length_multiple`` (at most ``seq_len``; kernels like multiples of 8, and sequence parallelism
needs one of ``tp``), so ``pad``'s rows are each its document's length class and packed micro-batches stop where
their rows do. The executor derives every message's shape from the micro-batch's (see
:mod:`evenpipe.runtime.boundary_shapes`).

A document of ``L`` tokens gives ``L - 1`` positions (inputs ``d[:-1]``, targets ``d[1:]``). Documents are read in
a random order per epoch (a pure function of ``(seed, epoch)``), and each step takes the next ones:

- ``pad``: ``global_batch`` documents, one per row, each row padded to ``seq_len``;
- ``pack`` / ``balance``: as many documents as first fit places into the step's ``dp x M`` micro-batches of ``b``
  rows (the same documents for both), grouped by :func:`evenpipe.plan.microbatch.plan_microbatches`.

With a memory budget (``max_bytes``, ``train --microbatch-memory``), a micro-batch of ``rows x T`` positions saves
``bytes_per_token`` per position on the largest stage, and the planner keeps that within the budget
(:attr:`evenpipe.plan.microbatch.MicrobatchBudget.length_multiple`); a document that alone exceeds it is refused,
named, or cut (``split_long``).

Padding has token 0 and target ``-100`` (ignored by the loss). Each micro-batch's loss is the mean over its real
tokens, and the step's loss the mean over micro-batches, as for fixed-length rows. Every rank computes the same
plan; step ``k``'s documents depend on the steps before it, so the plan is built step by step from 0 (and cached).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from evenpipe.dataset import DocumentSet, load_documents
from evenpipe.errors import ConfigError
from evenpipe.plan.microbatch import (MicrobatchBudget, MicrobatchCost, MicrobatchPlan, Policy, first_fit_prefix,
                                      parse_policy, plan_microbatches)
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.runtime.data import Batch, MicroBatches

if TYPE_CHECKING:
    from evenpipe.plan.order_choice import MicrobatchOrderer, OrderChoice

__all__ = ["DocumentBatches", "IGNORE_INDEX", "pack_rows", "microbatch_length", "order_report",
           "planned_microbatches"]

IGNORE_INDEX = -100
"""Target of a padding position (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


def pack_rows(rows: list[list[np.ndarray]], seq_len: int) -> Batch:
    """Rows of documents (each an int64 token array) -> ``Batch(tokens=[B, 2, T], targets=[B, T])``: inputs and
    document ids, and next-token targets; every document contributes ``d[:-1]`` / ``d[1:]``."""
    tokens = torch.zeros(len(rows), 2, seq_len, dtype=torch.int64)
    targets = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for r, docs in enumerate(rows):
        at = 0
        for i, d in enumerate(docs):
            n = len(d) - 1
            assert at + n <= seq_len, "a row overflows its budget"
            tokens[r, 0, at:at + n] = torch.from_numpy(d[:-1])
            targets[r, at:at + n] = torch.from_numpy(d[1:])
            tokens[r, 1, at:at + n] = i
            at += n
        tokens[r, 1, at:] = len(docs)  # padding: a run of its own
    return Batch(tokens=tokens, targets=targets)


def microbatch_length(rows: list[list[np.ndarray]], *, seq_len: int, multiple: int) -> int:
    """Positions of a micro-batch of ``rows``: its longest row's (``L - 1`` per document of ``L`` tokens)
    rounded up to a multiple of ``multiple``, at least ``multiple`` and at most ``seq_len``."""
    longest = max((sum(len(d) - 1 for d in docs) for docs in rows), default=0)
    return min(seq_len, max(multiple, -(-longest // multiple) * multiple))


def planned_microbatches(plan: MicrobatchPlan, documents: list[np.ndarray], *, rows: int, seq_len: int,
                         multiple: int) -> MicroBatches:
    """``plan``'s micro-batches (indices into ``documents``), replica by replica, each of ``rows`` rows (empty
    ones all padding) and :func:`microbatch_length` positions."""
    parts = []
    for mb in plan.microbatches:
        filled: list[list[np.ndarray]] = [[documents[i] for i in row] for row in mb.rows]
        filled += [[] for _ in range(rows - len(filled))]
        parts.append(pack_rows(filled, microbatch_length(filled, seq_len=seq_len, multiple=multiple)))
    return MicroBatches(parts=tuple(parts))


def order_report(choices: list[OrderChoice]) -> dict[str, Any]:
    """What simulated ordering did over ``choices``: how many orders changed, the predicted gain (mean and largest,
    in the planner's cost units) and the choosing time (median and largest process milliseconds)."""
    ms = sorted(1e3 * c.seconds for c in choices)
    return {"choices": len(choices), "changed": sum(c.order != tuple(range(len(c.order))) for c in choices),
            "predicted_gain_mean": sum(c.gain for c in choices) / len(choices),
            "predicted_gain_max": max(c.gain for c in choices),
            "choice_ms_median": ms[len(ms) // 2], "choice_ms_max": ms[-1]}


class DocumentBatches:
    """Deterministic packed batches of documents (see the module docstring)."""

    def __init__(self, *, path: str, seq_len: int, vocab: int, seed: int, policy: "Policy | str",
                 num_replicas: int, num_microbatches: int, rows_per_microbatch: int, token_dtype: str = "uint16",
                 tokenizer: str | None = None, split_long: bool = False, length_multiple: int = 8,
                 orderer: "MicrobatchOrderer | None" = None,
                 max_bytes: float | None = None, bytes_per_token: float = 1.0) -> None:
        self.policy = parse_policy(policy)
        self.orderer = orderer
        """Chooses each replica's micro-batch order by simulation (None: the planner's order)."""
        self.choices: dict[int, tuple[OrderChoice, ...]] = {}
        """Per step, one choice per replica (with an orderer)."""
        if length_multiple < 1:
            raise ConfigError(f"micro-batch lengths round up to a multiple of an integer >= 1, got {length_multiple}")
        self.multiple = length_multiple
        """Each micro-batch's length is a multiple of this (or ``seq_len``)."""
        docs = load_documents(path, token_dtype=token_dtype, tokenizer=tokenizer)
        docs.check_vocab(vocab)
        self.budget = MicrobatchBudget(row_len=seq_len, rows=rows_per_microbatch, max_bytes=max_bytes,
                                       length_multiple=None if max_bytes is None else length_multiple)
        self.cost = MicrobatchCost(per_token=1.0, per_square=1.0 / seq_len, bytes_per_token=bytes_per_token)
        widest = self.budget.widest_document(bytes_per_token)
        if widest < 1:
            raise ConfigError(f"--microbatch-memory {max_bytes:.0f} bytes holds no micro-batch: one of "
                              f"{rows_per_microbatch} row(s) of {length_multiple} positions saves "
                              f"{bytes_per_token * rows_per_microbatch * length_multiple:.0f} bytes of activations "
                              f"({bytes_per_token:.0f} per position on the largest stage)")
        if widest < seq_len and not split_long:
            _refuse_wide(docs, widest, max_bytes, bytes_per_token * rows_per_microbatch)
        self.docs: DocumentSet = docs.fit_to(min(seq_len, widest) + 1, split=split_long)
        if len(self.docs) == 0:
            raise ConfigError(f"{path!r} holds no document of at least 2 tokens ({docs.num_skipped} skipped)")
        self.seq_len, self.seed = seq_len, seed
        self.replicas, self.per_replica, self.rows = num_replicas, num_microbatches, rows_per_microbatch
        self._positions = np.diff(self.docs.offsets) - 1  # positions each document gives
        self._starts = [0]  # stream index of each planned step's first document
        self._orders: dict[int, np.ndarray] = {}
        self._plans: dict[int, MicrobatchPlan] = {}

    @property
    def num_skipped(self) -> int:
        """Documents dropped at load for having fewer than 2 tokens."""
        return self.docs.num_skipped

    def report(self) -> dict[str, Any]:
        """What the run's documents were: kept (pieces counted), skipped at load (fewer than 2 tokens), and how many
        long ones were cut into pieces."""
        out: dict[str, Any] = {"documents": len(self.docs), "skipped": self.docs.num_skipped,
                               "cut": self.docs.num_split}
        if self.choices:
            out["order"] = order_report([c for step in self.choices.values() for c in step])
        return out

    def _order(self, epoch: int) -> np.ndarray:
        """The documents' order in ``epoch``, a pure function of ``(seed, epoch)`` (the last two kept)."""
        if epoch not in self._orders:
            digest = hashlib.blake2b(f"documents:{self.seed}:{epoch}".encode(), digest_size=8).digest()
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = np.random.default_rng(int.from_bytes(digest, "little")).permutation(len(self.docs))
        return self._orders[epoch]

    def _stream(self, start: int) -> Iterator[int]:
        """Document indices from stream position ``start`` on, epoch after epoch."""
        n = len(self.docs)
        for epoch in itertools.count(start // n):
            order = self._order(epoch)
            yield from order[(start % n if epoch == start // n else 0):].tolist()

    def _take(self, start: int) -> int:
        """How many documents the step starting at stream position ``start`` takes."""
        if self.policy is Policy.PAD:
            return self.replicas * self.per_replica * self.rows
        lengths = (int(self._positions[d]) for d in self._stream(start))
        return first_fit_prefix(lengths, self.budget, self.replicas * self.per_replica, self.cost)

    def step_documents(self, step: int) -> list[int]:
        """Document indices of training step ``step`` (0-based), in stream order."""
        while len(self._starts) <= step + 1:
            self._starts.append(self._starts[-1] + self._take(self._starts[-1]))
        begin, end = self._starts[step], self._starts[step + 1]
        return list(itertools.islice(self._stream(begin), end - begin))

    def _reordered(self, step: int, plan: MicrobatchPlan) -> MicrobatchPlan:
        """``plan`` with each replica's micro-batches in the order the orderer chose (every rank chooses alike:
        the choice is a pure function of the plan)."""
        assert self.orderer is not None
        choices = tuple(self.orderer.choose(mbs) for mbs in plan.replicas)
        self.choices[step] = choices
        return dataclasses.replace(plan, replicas=tuple(tuple(mbs[i] for i in c.order)
                                                        for mbs, c in zip(plan.replicas, choices)))

    def batch(self, step: int, batch_size: int) -> MicroBatches:
        """The global batch of ``step``: ``batch_size`` rows (``dp x M x b``) in ``dp x M`` micro-batches,
        replica by replica, each replica's in the planner's order, each as long as it needs."""
        expected = self.replicas * self.per_replica * self.rows
        if batch_size != expected:
            raise ConfigError(f"packed documents fill dp x microbatches x microbatch-size = {expected} rows a step; "
                              f"got a global batch of {batch_size}")
        docs = self.step_documents(step)
        return planned_microbatches(self.step_plan(step), [self.docs.document(d) for d in docs], rows=self.rows,
                                    seq_len=self.seq_len, multiple=self.multiple)

    def step_plan(self, step: int) -> MicrobatchPlan:
        """The micro-batches of ``step`` (indices into :meth:`step_documents`), each replica's in running order
        (the orderer's, if any, chosen once per step: the plans of the last few steps are kept, older ones planned
        again, alike, when asked)."""
        plan = self._plans.get(step)
        if plan is None:
            plan = plan_microbatches(self.step_lengths(step), policy=self.policy, budget=self.budget, cost=self.cost,
                                     num_replicas=self.replicas, num_microbatches=self.per_replica)
            if self.orderer is not None:
                plan = self._reordered(step, plan)
            self._plans[step] = plan
            if len(self._plans) > 3:  # the three planned last (a prediction asks for the step just run)
                del self._plans[next(iter(self._plans))]
        return plan

    def step_lengths(self, step: int) -> list[int]:
        """Positions of each document of ``step`` (its tokens less one), in :meth:`step_documents` order."""
        return [int(self._positions[d]) for d in self.step_documents(step)]

    def step_shapes(self, step: int) -> tuple[tuple[MicrobatchShape, ...], ...]:
        """Per replica, the shape of each micro-batch of ``step`` as the runtime computes it, in running order
        (what the cost model prices: :func:`evenpipe.plan.varlen_predict.microbatch_shapes`)."""
        from evenpipe.plan.varlen_predict import microbatch_shapes
        return microbatch_shapes(self.step_plan(step), self.step_lengths(step), rows=self.rows,
                                 seq_len=self.seq_len, row_multiple=self.multiple)


def _refuse_wide(docs: DocumentSet, widest: int, max_bytes: float | None, bytes_per_row_token: float) -> None:
    """ConfigError naming the first document whose micro-batch alone would exceed the memory budget."""
    lengths = docs.lengths
    wide = np.flatnonzero(lengths - 1 > widest)
    if len(wide):
        i = int(wide[0])
        raise ConfigError(f"document {i} of {docs.source!r} has {int(lengths[i])} tokens: alone it needs more than "
                          f"--microbatch-memory {max_bytes:.0f} bytes of activations (at most {widest + 1} tokens "
                          f"fit, {bytes_per_row_token:.0f} bytes per position; {len(wide)} such document(s)); use "
                          "--split-long-documents or a larger --microbatch-memory")
