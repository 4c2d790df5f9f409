"""Memory-capped list scheduling: the generator of the zero-bubble families beyond ZB-H1.

Qi et al. (ICLR 2024, "Zero Bubble Pipeline Parallelism") fill the bubbles of a pipeline by splitting every
backward into ``I`` (input gradient, on the critical path) and ``W`` (weight gradient, free to move) and by
letting a rank run more forwards ahead when memory allows: ZB-H2 lets every rank hold up to ``2P - 1``
micro-batches. Their V-shaped placement (Qi et al. 2024b, "Pipeline Parallelism with Controllable Memory", for
ZB-V, V-Half and V-Min; zb-v itself is a fixed pattern, see :mod:`.zb_v`) puts two chunks on every rank, stage ``r`` and stage ``2P - 1 - r``, so the rank
that starts a micro-batch also finishes it, and the activation memory of every rank is set by one number: how
many chunk-activations it may hold.

This module turns that number into a schedule by a unit-time list simulation (every chunk's ``F``, ``I`` and
``W`` take one step, transfers are free). Whenever a rank is free it runs, in this order of preference:

1. an ``I`` whose inputs are ready (the critical path; smallest micro-batch first, then the later stage);
2. an ``F`` whose input is ready and that fits the cap: the next chunk of a micro-batch the rank already
   started (later stage first) when one chunk-activation fits, else the first chunk of a new micro-batch when
   all its chunks on this rank would fit at once (so a rank full of first chunks still has room to turn a
   micro-batch around: the oldest micro-batch on its way back can always go on);
3. the oldest pending ``W`` (it frees the chunk's activations).

Forwards and input gradients of a stage run in micro-batch order. With a cap large enough this is the
zero-bubble greedy order; smaller caps trade bubble for memory, as the paper's family does. The result is a
fixed program order, validated like any other schedule.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule.generate.ordering import Work, compute_schedule
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["capped_zero_bubble"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_NEVER = 1 << 62


class _Rank:
    """One rank's state in the unit-time simulation."""

    __slots__ = ("stages", "held", "left", "pending_w", "work")

    def __init__(self, stages: list[int]) -> None:
        self.stages = stages
        self.held = 0
        """Chunk-activations held (F adds one, W frees one)."""
        self.left: dict[int, int] = {}
        """Started micro-batch -> its chunks on this rank still to forward."""
        self.pending_w: deque[tuple[int, int]] = deque()
        self.work: list[Work] = []


def capped_zero_bubble(name: str, *, num_ranks: int, num_microbatches: int, stage_to_rank: Sequence[int],
                       cap: int, durations: tuple[int, int, int] = (1, 1, 1),
                       meta: dict[str, object] | None = None) -> Schedule:
    """Compute-only zero-bubble schedule in which no rank ever holds more than ``cap`` chunk-activations.

    ``stage_to_rank`` is any placement in which every rank holds at least one stage. Raises ``ConfigError``
    when ``cap`` is below the number of chunks a rank holds (a micro-batch could not even start).
    """
    P, M, S = num_ranks, num_microbatches, len(stage_to_rank)
    ranks = [_Rank(sorted(s for s in range(S) if stage_to_rank[s] == r)) for r in range(P)]
    need = max(len(rk.stages) for rk in ranks)
    if cap < need:
        raise ConfigError(f"{name}: a cap of {cap} chunk-activations is below the {need} chunks a rank holds; "
                          f"allowed: cap >= {need}")
    f_done = [[_NEVER] * M for _ in range(S)]  # finish time of F(s, m)
    i_done = [[_NEVER] * M for _ in range(S)]
    next_f, next_i = [0] * S, [0] * S
    remaining = 3 * S * M
    dur = dict(zip((_F, _I, _W), durations))
    busy = [0] * P
    t = 0
    while remaining:
        progressed = False
        for r, rk in enumerate(ranks):
            if busy[r] > t:
                progressed = True
                continue
            step = _choose(rk, t, f_done, i_done, next_f, next_i, S, M, cap)
            if step is None:
                continue
            kind, s, m = step
            rk.work.append(step)
            remaining -= 1
            progressed = True
            busy[r] = end = t + dur[kind]
            if kind is _F:
                f_done[s][m] = end
                next_f[s] += 1
                _account_forward(rk, s, m)
            elif kind is _I:
                i_done[s][m] = end
                next_i[s] += 1
                rk.pending_w.append((s, m))
            else:
                rk.pending_w.popleft()
                rk.held -= 1
        assert progressed, f"{name}: unit simulation stalled at t={t} (cap {cap})"
        t += 1
    return compute_schedule(name, num_ranks=P, num_microbatches=M, stage_to_rank=stage_to_rank,
                            work=[rk.work for rk in ranks], meta={**(meta or {}), "cap": cap})


def _account_forward(rk: _Rank, s: int, m: int) -> None:
    rk.held += 1
    if m in rk.left:
        rk.left[m] -= 1
        if not rk.left[m]:
            del rk.left[m]
    elif len(rk.stages) > 1:
        rk.left[m] = len(rk.stages) - 1


def _choose(rk: _Rank, t: int, f_done: list[list[int]], i_done: list[list[int]], next_f: list[int],
            next_i: list[int], S: int, M: int, cap: int) -> Work | None:
    """What the rank starts at time ``t`` (see the module docstring), or ``None`` to idle."""
    best_i: tuple[int, int] | None = None
    for s in rk.stages:
        m = next_i[s]
        if m < M and f_done[s][m] <= t and (s == S - 1 or i_done[s + 1][m] <= t):
            if best_i is None or (m, -s) < (best_i[1], -best_i[0]):
                best_i = (s, m)
    if best_i is not None:
        return (_I, *best_i)
    started: tuple[int, int] | None = None
    fresh: tuple[int, int] | None = None
    for s in reversed(rk.stages):
        m = next_f[s]
        if m >= M or (s > 0 and f_done[s - 1][m] > t):
            continue
        if m in rk.left:
            started = started or (s, m)
        elif fresh is None:
            fresh = (s, m)
    if started is not None and rk.held < cap:
        return (_F, *started)
    if fresh is not None and rk.held + len(rk.stages) <= cap:
        return (_F, *fresh)
    if rk.pending_w:
        return (_W, *rk.pending_w[0])
    return None
