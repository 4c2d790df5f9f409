"""What every evaluator shares: the wait-or-park step, the memory rule of a compute, the link-order and exact-sum
checks, per-stage tables, and the fallback protocol.

An evaluator times each rank's actions in program order until one needs a time not known yet; the rank then
*parks* on that signal (``waiters[signal]`` gets the rank) and is woken when the signal is set. :func:`wait_or_park`
is that step for a list of signals; :func:`park` alone for a single one checked inline. An evaluator that meets a
case it cannot vouch for raises :class:`CannotVouch`; the dispatcher (:mod:`evenpipe.sim.dispatch`) then tries the
next one.
"""

from __future__ import annotations

import gc
from collections import Counter
from itertools import chain, repeat
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

from evenpipe.schedule.ir import Schedule
from evenpipe.sim.costs import SimCosts, StageCosts
from evenpipe.sim.rules import B, F, I, KR, W
from evenpipe.sim.trace import Trace

__all__ = ["CannotVouch", "PARKED", "park", "wait_or_park", "compute_memory", "served_first", "sums_exact",
           "stage_tables", "microbatch_tables", "recomputed_slots", "cross_rank_inputs", "kinds_used", "gc_paused", "attempt", "RunState"]

_EXACT_LIMIT = 2 ** 53
PARKED = -1.0
"""What :func:`wait_or_park` returns when the rank parked (times are never negative)."""

_Key = TypeVar("_Key", bound=Hashable)
_Sig = TypeVar("_Sig", bound=Hashable)


class RunState:
    """A record of an evaluator's (its per-run tables and lists, its compiled columns), declared as annotated
    attributes of a subclass and set by keyword, every one (a plain class: defining a dataclass of some fifty fields
    costs a millisecond at import, and the dispatcher imports every evaluator)."""

    def __init__(self, **fields: object) -> None:
        missing = set(type(self).__annotations__) - set(fields)
        unknown = set(fields) - set(type(self).__annotations__)
        assert not missing and not unknown, f"{type(self).__name__}: missing {missing}, unknown {unknown}"
        for name, value in fields.items():
            setattr(self, name, value)


class CannotVouch(Exception):
    """An assumption of an evaluator does not hold: the next evaluator (ultimately the event engine) decides."""


def park(waiters: dict[_Sig, list[int]], signal: _Sig, who: int) -> None:
    """Wake ``who`` when ``signal`` is set."""
    waiting = waiters.get(signal)
    if waiting is None:
        waiters[signal] = [who]
    else:
        waiting.append(who)


def wait_or_park(time_of: Callable[[_Sig], float | None], signals: Iterable[_Sig], start: float,
                 waiters: dict[_Sig, list[int]], who: int) -> float:
    """The latest of ``start`` and the times of ``signals``; or, at the first signal without a time yet (``None``
    or negative), park ``who`` on it and return :data:`PARKED`."""
    for sig in signals:
        t = time_of(sig)
        if t is None or t < 0.0:
            park(waiters, sig, who)
            return PARKED
        if t > start:
            start = t
    return start


def compute_memory(code: int, key: _Key, start: float, end: float, forward_bytes: float,
                   rebuilt_bytes: float, weight_grad_bytes: float, held: dict[_Key, float],
                   mem: list[tuple[float, float]]) -> None:
    """A compute's change to its rank's activation memory (the engine's rules): ``F`` saves ``forward_bytes``
    at its start, ``R`` adds ``rebuilt_bytes`` at its start, ``B``/``W`` free what the micro-batch holds at their
    end, ``I`` keeps ``weight_grad_bytes`` of it. ``held`` maps (stage, mb), in any one encoding, to bytes;
    ``mem`` gets (time, delta)."""
    if code == F:
        if forward_bytes:
            held[key] = held.get(key, 0.0) + forward_bytes
            mem.append((start, forward_bytes))
    elif code == B or code == W:
        nb = held.pop(key, 0.0)
        if nb:
            mem.append((end, -nb))
    elif code == I:
        h = held.get(key, 0.0)
        nb = h - weight_grad_bytes
        if nb > 0.0:
            held[key] = h - nb
            mem.append((end, -nb))
    elif rebuilt_bytes > 0.0:
        held[key] = held.get(key, 0.0) + rebuilt_bytes
        mem.append((start, rebuilt_bytes))


def served_first(first: int, first2: int, then: int, then2: int) -> bool:
    """Whether the engine's FIFO surely queues a message before another one on its link ready at the same time.

    Each is described by the positions (``rank << 32 | index``) of the send or receive reached at that time
    (the second -2 when only one was; -1 first when a signal took part, whose place among the events of that
    instant the engine decides). A message is queued when the last of its conditions is met, and a rank meets
    its actions in program order; so the first one is surely ahead when each of its positions has a later
    position of the second message on the same rank."""
    if first < 0 or then < 0:
        return False
    later = (then,) if then2 < 0 else (then, then2)
    return all(any(b >> 32 == a >> 32 and b > a for b in later) for a in ((first,) if first2 < 0 else (first, first2)))


def sums_exact(events: list[tuple[float, float]]) -> bool:
    """Whether every partial sum of these deltas, in any order, is exact in binary floating point."""
    counts = Counter(delta for _, delta in events)
    den = 1
    for delta in counts:
        den = max(den, delta.as_integer_ratio()[1])  # powers of two: the largest is a common multiple
    total = 0
    for delta, count in counts.items():
        num, q = delta.as_integer_ratio()
        total += abs(num) * (den // q) * count
    return total < _EXACT_LIMIT


def stage_tables(stages: Sequence[StageCosts]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Durations indexed by ``kind code * stages + stage`` (F, B, I, W, R), and per stage the activation,
    checkpoint and weight-gradient bytes."""
    table = ([st.forward for st in stages] + [st.backward for st in stages]
             + [st.backward_input for st in stages] + [st.backward_weight for st in stages]
             + [st.recompute_time for st in stages])
    return (table, [st.activation_bytes for st in stages], [st.checkpoint_bytes for st in stages],
            [st.weight_grad_bytes for st in stages])


def microbatch_tables(costs: SimCosts, num_microbatches: int
                      ) -> tuple[list[float], list[float], list[float], list[float]]:
    """:func:`stage_tables` per (stage, micro-batch): durations indexed by ``kind code * S * M + stage * M + mb`` and,
    per ``stage * M + mb``, the activation, checkpoint and weight-gradient bytes. Equal micro-batches repeat each
    stage's entry ``M`` times, so one lookup serves both; unequal ones (:attr:`SimCosts.microbatch_stages`, one
    row per micro-batch, checked by the engine's ``check_costs``) interleave their rows' entries."""
    per = costs.microbatch_stages
    if per is None:
        M = num_microbatches
        table, act, ckpt, wgb = (list(chain.from_iterable(repeat(v, M) for v in col))
                                 for col in stage_tables(costs.stages))
        return table, act, ckpt, wgb
    rows = [stage_tables(row) for row in per]  # rows[m][k][index by stage]: (table, act, ckpt, wgb)
    table, act, ckpt, wgb = (list(chain.from_iterable(zip(*(row[k] for row in rows)))) for k in range(4))
    return table, act, ckpt, wgb


def recomputed_slots(schedule: Schedule) -> set[int]:
    """``stage * M + mb`` of every (stage, micro-batch) the schedule recomputes."""
    cols, M = schedule.columns, schedule.num_microbatches
    return {s * M + m for ks, ss, ms in zip(cols.kinds, cols.stages, cols.microbatches) if KR in ks
            for c, s, m in zip(ks, ss, ms) if c == KR}


def cross_rank_inputs(layout: tuple[int, ...]) -> tuple[list[bool], list[bool]]:
    """Per stage: whether its forward's input comes from another rank, and whether its backward's output
    gradient does (what a validated schedule then receives in a message)."""
    S = len(layout)
    return ([s > 0 and layout[s - 1] != layout[s] for s in range(S)],
            [s + 1 < S and layout[s + 1] != layout[s] for s in range(S)])


def kinds_used(schedule: Schedule) -> frozenset[int]:
    """The kind codes ``schedule`` holds (not memoized: a memo would hold the schedule, and its release would
    then fall inside a later simulation)."""
    return frozenset().union(*map(set, schedule.columns.kinds))


class _GcPause:
    """A re-entrant pause of cyclic garbage collection that allocates nothing on entry (a generator-based context
    manager would allocate, and so could start the very collection it is meant to keep out)."""

    __slots__ = ("depth", "was_enabled")

    def __init__(self) -> None:
        self.depth = 0
        self.was_enabled = False

    def __enter__(self) -> None:
        if not self.depth:
            self.was_enabled = gc.isenabled()
            gc.disable()
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth and self.was_enabled:
            gc.enable()


_GC_PAUSE = _GcPause()


def gc_paused() -> _GcPause:
    """Pause cyclic garbage collection (re-entrant): a run allocates ~10^5-10^6 small acyclic objects, and
    collections would only cost time (~25% on the event engine). Enter it before anything allocates."""
    return _GC_PAUSE


def attempt(run: Callable[[], Trace]) -> Trace | None:
    """``run()``'s trace, or ``None`` where it cannot vouch for it; collections paused meanwhile."""
    with gc_paused():
        try:
            return run()
        except CannotVouch:
            return None
