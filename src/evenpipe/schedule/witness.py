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
from evenpipe.schedule.semantics import SEMANTICS, TABLES, Requirement, kind_table

__all__ = ["WITNESS_DURATIONS", "WitnessTiming", "witness_timing"]

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
    P, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    lists = schedule.actions
    dur: list[int | None] = [durations.get(k) for k in ActionKind]
    spec = _SPEC
    start = [[-1] * len(acts) for acts in lists]
    finish = [[-1] * len(acts) for acts in lists]
    # done[2*u] = finish of F(u), done[2*u+1] = finish of B/I(u), u = stage*M + mb; -1 = not yet
    done = [-1] * (2 * S * M)
    waiting: dict[int, list[int]] = {}
    pos, free = [0] * P, [0] * P
    stack = list(reversed(range(P)))
    while stack:
        r = stack.pop()
        acts, i, t_free = lists[r], pos[r], free[r]
        st, fi = start[r], finish[r]
        while i < len(acts):
            a = acts[i]
            code = a.kind.code
            d_i = dur[code]
            sp = spec[code]
            if d_i is None or sp is None:
                i += 1
                continue
            s, u = a.stage, a.stage * M + a.microbatch
            ready = t_free
            blocked = -1
            for ds, slot in sp[0]:
                if not 0 <= s + ds < S:
                    continue
                d = 2 * (u + ds * M) + slot
                t = done[d]
                if t < 0:
                    blocked = d
                    break
                if t > ready:
                    ready = t
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            st[i], t_free = ready, ready + d_i
            fi[i] = t_free
            produced = sp[1]
            if produced >= 0:
                slot = 2 * u + produced
                done[slot] = t_free
                woken = waiting.pop(slot, None)
                if woken:
                    stack.extend(woken)
            i += 1
        pos[r], free[r] = i, t_free
    stuck = {r: pos[r] for r in range(P) if pos[r] < len(lists[r])}
    if stuck:
        raise ScheduleValidationError(
            "deadlock", f"compute order has a cyclic wait even with buffered messages; stuck ranks "
            f"{sorted(stuck)}", format_grid(schedule, stuck))
    return WitnessTiming(start=tuple(map(tuple, start)), finish=tuple(map(tuple, finish)))
