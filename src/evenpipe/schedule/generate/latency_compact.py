"""Timing a latency-aware order as the simulator does, and shifting work left into the idle time it leaves.

:func:`timed` runs per-rank work lists (each rank in its order, an action at the latest of its rank being free
and its input landing) with each link carrying one message at a time in its sender's order, the simulator's
rule; :func:`~evenpipe.schedule.generate.latency_plan.planned_times` lets messages share a link, which on
slow links can plan a step that the simulator then stretches.

:func:`left_shift` improves an order without ever lengthening its timing. A rank that idles before action ``i``
(from ``gap_start`` to ``i``'s start) may run, in that gap, a later action ``j`` of its own list that is ready by
``gap_start``, fits in what is left of the gap, keeps the cap (a forward moved earlier holds its activations
through ``i .. j-1`` too) and depends on nothing between (no earlier action of the same micro-batch, no earlier
action of the same kind and stage). Moving ``j`` there changes no start before ``j``'s old place and can only
bring later ones (and the ranks that wait on ``j``) forward, so a pass never lengthens the step; passes repeat,
each on the times of the last, until none moves anything or a pass limit is reached. A latency gap that a
zero-bubble order leaves before a returning gradient is so filled with a weight gradient or the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evenpipe.schedule.generate.latency_plan import LinkPlan
from evenpipe.schedule.generate.ordering import Work
from evenpipe.schedule.ir import ActionKind

__all__ = ["Timing", "left_shift", "timed"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_EPS = 1e-9
_MAX_PASSES = 20
_WINDOW = 64
"""How far down its list a rank looks for work to pull into a gap."""


@dataclass(frozen=True, slots=True)
class Timing:
    """Per rank and list position: start and input-landing times; the step (the last end)."""

    starts: list[list[float]]
    ready: list[list[float]]
    step: float


def timed(work: Sequence[Sequence[Work]], layout: Sequence[int], plan: LinkPlan) -> Timing | None:
    """The times of ``work`` under ``plan`` with one message at a time on each link (module docstring);
    ``None`` when the lists wait on each other in a cycle."""
    P, S = len(work), len(layout)
    chunks = [max(1, sum(1 for x in layout if x == r)) for r in range(P)]
    dur = [plan.durations(chunks[r], r) for r in range(P)]
    starts = [[0.0] * len(w) for w in work]
    ready = [[0.0] * len(w) for w in work]
    out: dict[tuple[ActionKind, int, int], float] = {}  # (kind, stage, mb) -> when its output is on the consumer
    link_free: dict[tuple[int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    remaining = sum(len(w) for w in work)
    while remaining:
        progressed = False
        for r in range(P):
            rank_work = work[r]
            while pos[r] < len(rank_work):
                kind, s, m = rank_work[pos[r]]
                if kind is _F:
                    landed = out.get((_F, s - 1, m)) if s > 0 else 0.0
                elif kind is _I:
                    landed = out.get((_I, s + 1, m)) if s < S - 1 else out.get((_F, s, m))
                else:
                    landed = 0.0
                if landed is None:
                    break
                i = pos[r]
                ready[r][i], starts[r][i] = landed, max(free[r], landed)
                free[r] = end = starts[r][i] + dur[r][kind]
                if kind is not _W:
                    dst = s + 1 if kind is _F else s - 1
                    out[(kind, s, m)] = end if not 0 <= dst < S else _arrival(r, layout[dst], end, link_free, plan)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return None
    return Timing(starts, ready, max(free, default=0.0))


def _arrival(src: int, dst: int, sent: float, link_free: dict[tuple[int, int], float], plan: LinkPlan) -> float:
    if src == dst:
        return sent
    arrive = max(sent, link_free.get((src, dst), 0.0)) + plan.message_time(src, dst)
    link_free[(src, dst)] = arrive
    return arrive


def left_shift(work: Sequence[Sequence[Work]], layout: Sequence[int], plan: LinkPlan, cap: int
               ) -> tuple[list[list[Work]], float] | None:
    """``work`` with later actions pulled into idle gaps (module docstring), and its step under :func:`timed`;
    ``cap`` counts chunk-activations from ``F`` to ``W``. ``None`` when ``work`` itself cannot be timed."""
    lists = [list(w) for w in work]
    timing = timed(lists, layout, plan)
    if timing is None:
        return None
    P = len(lists)
    chunks = [max(1, sum(1 for x in layout if x == r)) for r in range(P)]
    dur = [plan.durations(chunks[r], r) for r in range(P)]
    best = ([list(w) for w in lists], timing.step)
    for _ in range(_MAX_PASSES):
        moved = 0
        for r in range(P):
            lists[r], n = _shift_rank(lists[r], timing.starts[r], timing.ready[r], dur[r], cap)
            moved += n
        if not moved:
            break
        again = timed(lists, layout, plan)
        if again is None:  # cannot happen (a move keeps every wait a rank had); stop at the last good order
            break
        timing = again
        if timing.step < best[1] - _EPS:
            best = ([list(w) for w in lists], timing.step)
    return best


def _shift_rank(order: list[Work], starts: list[float], ready: list[float], dur: dict[ActionKind, float],
                cap: int) -> tuple[list[Work], int]:
    """One rank's list after one pass of gap filling, and how many actions moved."""
    n = len(order)
    used = [False] * n
    result: list[Work] = []
    now, held, moved = 0.0, 0, 0
    for i in range(n):
        if used[i]:
            continue
        for j in range(i + 1, min(n, i + _WINDOW)):
            if starts[i] - now <= _EPS:
                break
            if used[j] or ready[j] > now + _EPS or dur[order[j][0]] > starts[i] - now + _EPS:
                continue
            if _blocked(order, used, i, j) or not _keeps_cap(order, used, i, j, held, cap):
                continue
            used[j] = True
            result.append(order[j])
            held += _DELTA[order[j][0]]
            now += dur[order[j][0]]
            moved += 1
        used[i] = True
        result.append(order[i])
        held += _DELTA[order[i][0]]
        now = max(now, starts[i]) + dur[order[i][0]]
    return result, moved


_DELTA = {_F: 1, _I: 0, _W: -1}
"""Chunk-activations an action adds to its rank's count (``F`` to ``W``)."""


def _blocked(order: list[Work], used: list[bool], i: int, j: int) -> bool:
    """Whether ``order[j]`` must stay after an action still waiting in ``order[i:j]``: one of its micro-batch,
    or one of its kind and stage (each stage runs its forwards and its input gradients in micro-batch order)."""
    kind, s, m = order[j]
    return any(not used[q] and (order[q][2] == m or (order[q][0] is kind and order[q][1] == s))
               for q in range(i, j))


def _keeps_cap(order: list[Work], used: list[bool], i: int, j: int, held: int, cap: int) -> bool:
    """Whether running ``order[j]`` now keeps the rank within ``cap`` until ``order[j]``'s old place."""
    delta = _DELTA[order[j][0]]
    level = held + delta
    if level > cap:
        return False
    if delta <= 0:
        return True
    for q in range(i, j):
        if not used[q]:
            level += _DELTA[order[q][0]]
            if level > cap:
                return False
    return True
