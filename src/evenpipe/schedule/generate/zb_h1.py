"""Zero-bubble H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", section 3).

The backward is split into ``I`` (input gradient, on the critical path) and ``W`` (weight gradient, free to
move). Forwards and input-gradients keep 1F1B's order, so the micro-batches between ``F`` and ``I`` on rank r
never exceed 1F1B's ``min(P - r, M)``. Each ``W`` is deferred to the first moment the rank would otherwise idle,
but a rank never holds more than ``min(P, M)`` micro-batches whose ``W`` is still due (1F1B's peak, reached on
its first rank): at that limit the oldest pending ``W`` runs before the next forward. So the peak activation
count over ranks equals 1F1B's (later ranks trade their 1F1B slack for deferred ``W``s, as in the paper's
figure), and with F = I = W = 1 the bubble is ``P - 1`` per rank, a third of 1F1B's ``3(P - 1)``.

The W placement is decided once by a unit-time list simulation (F = I = W = 1, free transfers); the result is a
fixed program order like any other schedule.
"""

from __future__ import annotations

from collections import deque

from evenpipe.schedule.generate.one_f_one_b import one_f_one_b_warmup
from evenpipe.schedule.generate.ordering import (
    Work,
    compute_schedule,
    linear_layout,
    unit_time_order,
    warmup_then_alternate,
)
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["zb_h1"]

_NEVER = 1 << 62


def _skeleton(rank: int, num_ranks: int, num_microbatches: int) -> list[Work]:
    """1F1B's order with each full backward replaced by its input-gradient half."""
    items = [(rank, m) for m in range(num_microbatches)]
    order = warmup_then_alternate(items, items, one_f_one_b_warmup(rank, num_ranks, num_microbatches))
    return [(ActionKind.BACKWARD_INPUT if k is ActionKind.BACKWARD else k, s, m) for k, s, m in order]


def zb_h1(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Compute-only ZB-H1 with one stage per rank."""
    P, M = num_ranks, num_microbatches
    skeleton = [_skeleton(r, P, M) for r in range(P)]
    limit = [min(P, M)] * P  # micro-batches with W still due; 1F1B's peak (rank 0)
    done_f: dict[tuple[int, int], int] = {}  # (stage, mb) -> finish time of F
    done_i: dict[tuple[int, int], int] = {}
    pos = [0] * P
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
    in_flight = [0] * P

    def start(r: int, t: int) -> Work | None:
        step = _choose(r, t, skeleton[r], pos[r], pending_w[r], in_flight[r] >= limit[r], done_f, done_i, P)
        if step is None:
            return None
        kind, s, m = step
        if kind is ActionKind.BACKWARD_WEIGHT:
            pending_w[r].popleft()
            in_flight[r] -= 1
            return step
        pos[r] += 1
        if kind is ActionKind.FORWARD:
            done_f[(s, m)] = t + 1
            in_flight[r] += 1
        else:
            done_i[(s, m)] = t + 1
            pending_w[r].append((s, m))
        return step
    work = unit_time_order("zb-h1", P, 3 * P * M, start)
    return compute_schedule("zb-h1", num_ranks=P, num_microbatches=M, stage_to_rank=linear_layout(P), work=work)


def _choose(rank: int, t: int, skeleton: list[Work], pos: int, pending_w: deque[tuple[int, int]],
            at_limit: bool, done_f: dict[tuple[int, int], int], done_i: dict[tuple[int, int], int],
            num_ranks: int) -> Work | None:
    """What rank ``rank`` starts at time ``t``: the next F/I if ready (W first when at the in-flight limit),
    else a deferred W to fill the gap, else nothing."""
    if pos < len(skeleton):
        kind, s, m = skeleton[pos]
        if kind is ActionKind.FORWARD:
            if at_limit and pending_w:
                return (ActionKind.BACKWARD_WEIGHT, *pending_w[0])
            if not at_limit and (s == 0 or done_f.get((s - 1, m), _NEVER) <= t):
                return skeleton[pos]
        elif s == num_ranks - 1 or done_i.get((s + 1, m), _NEVER) <= t:
            return skeleton[pos]
    if pending_w:
        return (ActionKind.BACKWARD_WEIGHT, *pending_w[0])
    return None
