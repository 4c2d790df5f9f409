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

__all__ = ["WITNESS_DURATIONS", "WitnessTiming", "witness_timing"]

WITNESS_DURATIONS: Mapping[ActionKind, int] = {
    ActionKind.FORWARD: 1, ActionKind.BACKWARD: 2, ActionKind.BACKWARD_INPUT: 2,
    ActionKind.BACKWARD_WEIGHT: 1, ActionKind.RECOMPUTE: 1,
}
"""Durations of the witness run; any positive values give a valid order, these mimic B = 2F."""


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
    dur = {k.value: d for k, d in durations.items()}
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
            token = a.kind._value_
            if token not in dur:
                i += 1
                continue
            u = a.stage * M + a.microbatch
            deps: tuple[int, ...]
            if token == "F":
                deps = (2 * (u - M),) if a.stage > 0 else ()
            elif token == "B" or token == "I":
                deps = (2 * u, 2 * (u + M) + 1) if a.stage + 1 < S else (2 * u,)
            elif token == "W":
                deps = (2 * u + 1,)
            else:  # R
                deps = (2 * u,)
            ready = t_free
            blocked = -1
            for d in deps:
                t = done[d]
                if t < 0:
                    blocked = d
                    break
                if t > ready:
                    ready = t
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            st[i], t_free = ready, ready + dur[token]
            fi[i] = t_free
            if token == "F" or token == "B" or token == "I":
                slot = 2 * u if token == "F" else 2 * u + 1
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
