"""ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): zero bubble on a V placement.

Rank ``r`` holds chunk 0 (stage ``a = r``) and chunk 1 (stage ``b = 2P - 1 - r``): a micro-batch runs down
the ranks in chunk 0, turns at rank ``P - 1`` and comes back up in chunk 1, so the rank that starts it (rank 0)
also finishes it. The order is a fixed pattern, the same whatever the durations, so it does not go wrong when
``I`` and ``W`` differ or when the first stage's ``I`` is empty (its input is tokens) and its ``W`` the whole
backward, which is how the runtime runs it:

1. warm-up: ``2(P - r) - 1`` chunk-0 forwards, then ``r`` pairs of (chunk-1 forward, chunk-0 forward), then one
   chunk-1 forward;
2. the first chunk-1 backward (``I`` then ``W``), then ``P - 1 - r`` chunk-1 forwards each followed by its
   backward;
3. steady state, until every forward has run: a chunk-0 forward and the oldest chunk-0 backward, then a chunk-1
   forward and the oldest chunk-1 backward; each ``W`` right after its ``I``;
4. cool-down, decided by a unit-time simulation of all ranks (F = I = W = 1, free transfers): the next input
   gradient whose gradient has arrived (chunk 0 before chunk 1), else the oldest deferred ``W``.

Every rank holds at most ``2P`` chunk-activations, 1F1B's peak on its first rank, on every rank. With equal
durations the bubble is the warm-up's, half of ZB-H1's; simulated against torch's ZBV order on the same costs
(``benchmarks/bench_zbv_orders.py``) the step times are equal in every case measured.
"""

from __future__ import annotations

from collections import deque

from evenpipe.schedule.generate.ordering import Work, compute_schedule, unit_time_order
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["zb_v"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_NEVER = 1 << 62


class _Pattern:
    """Phases 1-3 of one rank: the fixed part of its order."""

    def __init__(self, rank: int, num_ranks: int, num_microbatches: int) -> None:
        self.stage = (rank, 2 * num_ranks - 1 - rank)
        self.m = num_microbatches
        self.forwarded = [0, 0]
        self.backwarded = [0, 0]
        self.work: list[Work] = []
        P, r = num_ranks, rank
        for _ in range(2 * (P - r) - 1):
            self._forward(0)
        for _ in range(r):
            self._forward(1)
            self._forward(0)
        self._forward(1)
        self._backward(1)
        for _ in range(P - 1 - r):
            self._forward(1)
            self._backward(1)
        while self.forwarded[0] < self.m or self.forwarded[1] < self.m:
            for chunk in (0, 1):
                self._forward(chunk)
                self._backward(chunk)

    def _forward(self, chunk: int) -> None:
        if self.forwarded[chunk] < self.m:
            self.work.append((_F, self.stage[chunk], self.forwarded[chunk]))
            self.forwarded[chunk] += 1

    def _backward(self, chunk: int) -> None:
        k = self.backwarded[chunk]
        if k < self.forwarded[chunk]:
            self.work += [(_I, self.stage[chunk], k), (_W, self.stage[chunk], k)]
            self.backwarded[chunk] += 1

    def left(self) -> list[deque[tuple[int, int]]]:
        """Per chunk, the (stage, micro-batch) input gradients still to run."""
        return [deque((self.stage[c], k) for k in range(self.backwarded[c], self.m)) for c in (0, 1)]


def zb_v(*, num_ranks: int, num_microbatches: int, stage_to_rank: tuple[int, ...]) -> Schedule:
    """Compute-only ZB-V; ``stage_to_rank`` is the V placement (the family's)."""
    P, M = num_ranks, num_microbatches
    S = 2 * P
    assert stage_to_rank == tuple(range(P)) + tuple(range(P - 1, -1, -1)), "zb-v needs the V placement"
    patterns = [_Pattern(r, P, M) for r in range(P)]
    fixed = [p.work for p in patterns]
    left = [p.left() for p in patterns]
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
    f_done = [[_NEVER] * M for _ in range(S)]
    i_done = [[_NEVER] * M for _ in range(S)]
    pos = [0] * P

    def start(r: int, t: int) -> Work | None:
        step = _next(r, t, fixed[r], pos, left[r], pending_w[r], f_done, i_done, S)
        if step is not None and step[0] is not _W:
            (f_done if step[0] is _F else i_done)[step[1]][step[2]] = t + 1
        return step
    work = unit_time_order("zb-v", P, 3 * S * M, start)
    return compute_schedule("zb-v", num_ranks=P, num_microbatches=M, stage_to_rank=stage_to_rank, work=work,
                            meta={"chunks": 2})


def _next(r: int, t: int, fixed: list[Work], pos: list[int], left: list[deque[tuple[int, int]]],
          pending_w: deque[tuple[int, int]], f_done: list[list[int]], i_done: list[list[int]], S: int) -> Work | None:
    """What rank ``r`` starts at time ``t``: its next fixed action once ready, then the cool-down's choice."""
    if pos[r] < len(fixed):
        kind, s, m = fixed[pos[r]]
        ready = (s == 0 or f_done[s - 1][m] <= t) if kind is _F else \
            (f_done[s][m] <= t and (s == S - 1 or i_done[s + 1][m] <= t)) if kind is _I else i_done[s][m] <= t
        if not ready:
            return None
        pos[r] += 1
        return (kind, s, m)
    for queue in left:
        if queue:
            s, m = queue[0]
            if f_done[s][m] <= t and (s == S - 1 or i_done[s + 1][m] <= t):
                queue.popleft()
                pending_w.append((s, m))
                return (_I, s, m)
    if pending_w:
        s, m = pending_w.popleft()
        return (_W, s, m)
    return None
