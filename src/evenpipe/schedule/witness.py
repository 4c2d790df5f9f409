"""Witness timing: when each compute action would start with fixed positive durations and free, buffered
messages. It is a longest-path computation over the compute lists, O(actions), and it doubles as a check that
the compute order alone has no cyclic wait (the precondition for deriving deadlock-free communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from evenpipe.errors import ScheduleValidationError
from evenpipe.schedule.grid import format_grid
from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.memo import ObjectMemo
from evenpipe.schedule.semantics import SEMANTICS, TABLES, Requirement, kind_table

__all__ = ["WITNESS_DURATIONS", "WitnessTiming", "reuse_witness", "witness_timing"]

WITNESS_DURATIONS: Mapping[ActionKind, int] = {
    ActionKind.FORWARD: 1, ActionKind.BACKWARD: 2, ActionKind.BACKWARD_INPUT: 2,
    ActionKind.BACKWARD_WEIGHT: 1, ActionKind.RECOMPUTE: 1,
}
"""Durations of the witness run; any positive values give a valid order, these mimic B = 2F."""


_DEP_SLOT = {Requirement.INPUT: (-1, 0), Requirement.OWN_FORWARD: (0, 0), Requirement.OUTPUT_GRADIENT: (1, 1),
             Requirement.INPUT_GRADIENT: (0, 1)}
"""Requirement -> (stage offset, slot) of the compute finish it waits for: slot 0 is a forward's finish, slot 1
an input gradient's (``B`` or ``I``). Requirements met in program order on one rank are not timing edges."""
_PRODUCES = {ActionKind.FORWARD: 0, ActionKind.BACKWARD: 1, ActionKind.BACKWARD_INPUT: 1}
"""Kinds whose finish others wait for, and the slot it is recorded in."""
_SPEC = kind_table("witness", {k: ((tuple(_DEP_SLOT[q] for q in SEMANTICS[k].requires if q in _DEP_SLOT),
                                    _PRODUCES.get(k, -1)) if TABLES.compute[k.code] else None)
                               for k in ActionKind})
"""Per kind code: (timing dependencies, produced slot) for computes; ``None``: not timed (transfers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WitnessTiming:
    """Start and finish of every compute action, by rank and list position (-1 for non-compute positions)."""

    start: tuple[tuple[int, ...], ...]
    """``start[r][i]``: start time of action ``i`` of rank ``r``."""
    finish: tuple[tuple[int, ...], ...]
    """``finish[r][i]``: finish time of action ``i`` of rank ``r``."""

    @property
    def makespan(self) -> int:
        """When the last compute ends."""
        return max((f for row in self.finish for f in row), default=0)


def witness_timing(schedule: Schedule, durations: Mapping[ActionKind, int] = WITNESS_DURATIONS) -> WitnessTiming:
    """Time the compute actions of ``schedule`` (others are ignored); raise if the compute order cycles.

    Data dependencies: ``F(s,m)`` needs ``F(s-1,m)``; ``B``/``I(s,m)`` need ``F(s,m)`` and ``B``/``I(s+1,m)``;
    ``W`` needs ``I``; ``R`` needs ``F``. A rank runs its list in order, one compute at a time.
    """
    return _LAST.get(schedule, frozenset(durations.items()), lambda: _witness_timing(schedule, durations))


_LAST: ObjectMemo[WitnessTiming] = ObjectMemo(1)
"""The last (schedule, durations) timed: the BPipe transform and the communication derivation time the same
compute order in turn (schedules are immutable, so the identity of the object is the key)."""


def reuse_witness(schedule: Schedule, computes_of: Schedule) -> bool:
    """Remember for ``schedule`` the witness timing of ``computes_of`` when both hold the same computes in the same
    order on every rank (``schedule`` adds only actions the witness ignores, e.g. BPipe's EVICT/LOAD markers): the
    same times at the computes' new positions, so that deriving its communication does not time it again.
    Answers whether it did (else the next :func:`witness_timing` of ``schedule`` times it)."""
    cols, ref = schedule.columns, computes_of.columns
    if schedule.num_ranks != computes_of.num_ranks or schedule.num_microbatches != computes_of.num_microbatches:
        return False
    base = witness_timing(computes_of)
    timed = TABLES.compute  # the kinds the witness times (the others it skips)
    start, finish = [], []
    for r, ks in enumerate(cols.kinds):
        at = [i for i, c in enumerate(ks) if timed[c]]
        was = [i for i, c in enumerate(ref.kinds[r]) if timed[c]]
        for col, old in ((cols.kinds, ref.kinds), (cols.stages, ref.stages), (cols.microbatches, ref.microbatches)):
            if list(map(col[r].__getitem__, at)) != list(map(old[r].__getitem__, was)):
                return False  # not the same computes in the same order
        st, fi = [-1] * len(ks), [-1] * len(ks)
        b_st, b_fi = base.start[r], base.finish[r]
        for i, j in zip(at, was):
            st[i], fi[i] = b_st[j], b_fi[j]
        start.append(tuple(st))
        finish.append(tuple(fi))
    timing = WitnessTiming(start=tuple(start), finish=tuple(finish))
    _LAST.get(schedule, frozenset(WITNESS_DURATIONS.items()), lambda: timing)
    return True


def _witness_timing(schedule: Schedule, durations: Mapping[ActionKind, int]) -> WitnessTiming:
    P, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    cols = schedule.columns
    kinds_all, stages_all, mbs_all = cols.kinds, cols.stages, cols.microbatches
    dur: list[int | None] = [durations.get(k) for k in ActionKind]
    # per code: (duration, offsets into ``done`` of the finishes it waits for, produced slot), or None
    plan = [None if d is None or sp is None else (d, tuple(2 * ds * M + slot for ds, slot in sp[0]), sp[1])
            for d, sp in zip(dur, _SPEC)]
    # done[2*(u + M) + slot]: finish of F (slot 0) or B/I (slot 1) of u = stage*M + mb, -1 = not yet; stages -1
    # and S are padding, finished at time 0, so a dependency on a stage that does not exist never waits
    done = [0] * (2 * M) + [-1] * (2 * S * M) + [0] * (2 * M)
    start = [[-1] * len(ks) for ks in kinds_all]
    finish = [[-1] * len(ks) for ks in kinds_all]
    waiting: dict[int, list[int]] = {}
    pos, free = [0] * P, [0] * P
    stack = list(reversed(range(P)))
    while stack:
        r = stack.pop()
        ks, ss, ms, i, t_free = kinds_all[r], stages_all[r], mbs_all[r], pos[r], free[r]
        n = len(ks)
        st, fi = start[r], finish[r]
        while i < n:
            step = plan[ks[i]]
            if step is None:
                i += 1
                continue
            d_i, offsets, produced = step
            base = 2 * ((ss[i] + 1) * M + ms[i])
            ready = t_free
            blocked = -1
            for off in offsets:
                t = done[base + off]
                if t < 0:
                    blocked = base + off
                    break
                if t > ready:
                    ready = t
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            st[i], t_free = ready, ready + d_i
            fi[i] = t_free
            if produced >= 0:
                slot = base + produced
                done[slot] = t_free
                woken = waiting.pop(slot, None)
                if woken:
                    stack.extend(woken)
            i += 1
        pos[r], free[r] = i, t_free
    stuck = {r: pos[r] for r in range(P) if pos[r] < len(kinds_all[r])}
    if stuck:
        raise ScheduleValidationError(
            "deadlock", f"compute order has a cyclic wait even with buffered messages; stuck ranks "
            f"{sorted(stuck)}", format_grid(schedule, stuck))
    return WitnessTiming(start=tuple(map(tuple, start)), finish=tuple(map(tuple, finish)))
