"""A lower bound on the step of any schedule of a placement under a :class:`LinkPlan` (issue 35 point 4).

Every rank ``r`` has the same work per micro-batch, ``F + I + W`` (its layers, whatever its chunks), so it is
busy ``M (F + I + W)`` in all; what a placement and the links decide is how long it must wait. Two times of
micro-batch 0 running alone, on links that carry it at once (so contention and queueing only add):

* ``start_r``: when the first forward input reaches any of ``r``'s stages;
* ``turn_r``: when the first output gradient reaches any of ``r``'s stages, after the whole forward and the
  input gradients of every later stage.

Before ``turn_r`` the rank can run forwards only (an ``I`` needs the gradient, a ``W`` its ``I``), and a forward's
activations are held until that chunk's ``I`` at least, so at most ``cap`` activation units of forwards
(``min(cap, M)`` micro-batches' worth of its layers) fit before ``turn_r``. Hence

    step >= max over r of  max(start_r, turn_r - min(cap, M) F) + M (F + I + W)     and     turn_r + M (I + W),

with the rank's slowdown applied to its times. For the V at ``F = I = W = 1`` every rank's turn comes
``P + (2P - 2) L`` after its start, so with the cap at ``P`` (1F1B's peak) the last rank of the V waits at least
``(P - 1)(1/2 + 3L)``: at ``L = 1/4`` of a forward and ``P = 8`` that is 8.75 forwards, against ZB-H1's
13.5 at ``M = 8`` and 15.75 at ``M = 16`` (its own bubble grows with ``M`` as every round trip pays the link).
"""

from __future__ import annotations

from typing import Sequence

from evenpipe.schedule.generate.latency_plan import LinkPlan
from evenpipe.schedule.ir import ActionKind

__all__ = ["step_lower_bound"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def step_lower_bound(*, num_microbatches: int, stage_to_rank: Sequence[int], plan: LinkPlan) -> float:
    """No schedule of ``stage_to_rank`` (equal chunks, each rank's layers split evenly over its stages) that
    holds at most ``plan.cap`` activation units per rank can take a shorter step under ``plan`` (module
    docstring)."""
    layout, M = tuple(stage_to_rank), num_microbatches
    P, S = max(layout) + 1, len(layout)
    chunks = [layout.count(r) for r in range(P)]
    dur = [plan.durations(chunks[r], r) for r in range(P)]
    arrive_f = [0.0] * S  # forward input of stage s on its rank, micro-batch 0 alone
    for s in range(1, S):
        a, b = layout[s - 1], layout[s]
        arrive_f[s] = arrive_f[s - 1] + dur[a][_F] + plan.message_time(a, b)
    arrive_i = [0.0] * S  # output gradient of stage s on its rank
    arrive_i[S - 1] = arrive_f[S - 1] + dur[layout[S - 1]][_F]
    for s in range(S - 2, -1, -1):
        a, b = layout[s + 1], layout[s]
        arrive_i[s] = arrive_i[s + 1] + dur[a][_I] + plan.message_time(a, b)
    cap = float(P) if plan.cap is None else plan.cap
    bound = _stage_bound(M, layout, dur, chunks, arrive_f, arrive_i, plan)
    for r in range(P):
        mine = [s for s in range(S) if layout[s] == r]
        start, turn = min(arrive_f[s] for s in mine), min(arrive_i[s] for s in mine)
        per_mb = {kind: dur[r][kind] * chunks[r] for kind in (_F, _I, _W)}
        ahead = min(cap, M) * per_mb[_F]  # forwards a rank can run before its first gradient
        bound = max(bound, max(start, turn - ahead) + M * sum(per_mb.values()), turn + M * (per_mb[_I] + per_mb[_W]))
    return bound


def _stage_bound(M: int, layout: tuple[int, ...], dur: list[dict[ActionKind, float]], chunks: list[int],
                 arrive_f: list[float], arrive_i: list[float], plan: LinkPlan) -> float:
    """Per stage: its ``M`` input gradients and weight gradients all come after its first output gradient lands,
    and its ``M`` forwards after its first input lands, the last of them followed by the rest of that
    micro-batch's round trip (the later stages' forwards, every input gradient down to stage 0 and its ``W``)."""
    S = len(layout)
    chunk = [{kind: dur[r][kind] for kind in (_F, _I, _W)} for r in layout]
    back_to_0 = arrive_i[0] - arrive_i[S - 1]  # from the last stage's gradient landing to stage 0's
    bound = 0.0
    for s in range(S):
        bound = max(bound, arrive_i[s] + M * (chunk[s][_I] + chunk[s][_W]))
        rest = arrive_i[S - 1] - arrive_f[s] - chunk[s][_F] + back_to_0 + chunk[0][_I] + chunk[0][_W]
        bound = max(bound, arrive_f[s] + M * chunk[s][_F] + rest)
    return bound
