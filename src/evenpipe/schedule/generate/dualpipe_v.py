"""DualPipeV: DeepSeek-V3's DualPipe "cut in half" (DeepSeek-AI, 2024, section 3.2.1; the V variant of
deepseek-ai/DualPipe), on the V placement: rank ``r`` holds stages ``r`` and ``2P - 1 - r``.

Every rank runs eight phases; ``f0``/``f1`` are forwards of its first and second chunk, ``b0``/``b1`` full
backwards, ``i``/``w`` a split backward's halves:

1. ``2(P - r - 1)`` × f0 (fill the pipeline down to the turning rank);
2. ``r + 1`` × (f0 f1);
3. ``P - r - 1`` × (i1 w f1), zero-bubble style;
4. ``M - 2P + r + 1`` × (f0 b1) (f1 b0): the steady state; DualPipe overlaps each pair's forward with the
   backward (computation with the other's communication), which the IR writes as two actions in a row;
5. ``P - r - 1`` × b1 (f1 b0);
6. ``r + 1`` × (b1 b0), the second half as split backwards (i instead of b; its w deferred);
7. ``P - r - 1`` × (w b0) (b0 split when the switch happened in phase 6);
8. ``r + 1`` × w.

Each rank starts with ``2P`` chunk-activations in flight and peaks at ``2P + 1`` right after a steady-state
forward: DualPipe's stated activation cost of ``PP + 1`` stage-activations per device, with ``PP = 2P`` stages.
Needs ``M >= 2P``.
"""

from __future__ import annotations

from collections import deque

from evenpipe.schedule.family import Placement
from evenpipe.schedule.generate.ordering import Work, compute_schedule
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["dualpipe_v"]

_F, _B, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


class _Order:
    """One rank's action list under construction: micro-batches are taken in order per stage and direction."""

    def __init__(self) -> None:
        self.work: list[Work] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.weights: deque[tuple[int, int]] = deque()

    def forward(self, stage: int) -> None:
        m = self.next_f.get(stage, 0)
        self.next_f[stage] = m + 1
        self.work.append((_F, stage, m))

    def backward(self, stage: int, *, split: bool) -> None:
        m = self.next_b.get(stage, 0)
        self.next_b[stage] = m + 1
        self.work.append((_I if split else _B, stage, m))
        if split:
            self.weights.append((stage, m))

    def weight(self) -> None:
        if self.weights:
            self.work.append((_W, *self.weights.popleft()))


def _rank_order(r: int, P: int, M: int) -> list[Work]:
    s0, s1 = r, 2 * P - 1 - r
    o = _Order()
    for _ in range(2 * (P - r - 1)):
        o.forward(s0)
    for _ in range(r + 1):
        o.forward(s0)
        o.forward(s1)
    for _ in range(P - r - 1):
        o.backward(s1, split=True)
        o.weight()
        o.forward(s1)
    for _ in range(M - 2 * P + r + 1):
        o.forward(s0)
        o.backward(s1, split=False)
        o.forward(s1)
        o.backward(s0, split=False)
    for _ in range(P - r - 1):
        o.backward(s1, split=False)
        o.forward(s1)
        o.backward(s0, split=False)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):
        if i == half and r % 2 == 1:
            split = True
        o.backward(s1, split=split)
        if i == half and r % 2 == 0:
            split = True
        o.backward(s0, split=split)
    for _ in range(P - r - 1):
        o.weight()
        o.backward(s0, split=split)
    for _ in range(r + 1):
        o.weight()
    assert not o.weights, "every split backward gets its weight half"
    return o.work


def dualpipe_v(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Compute-only DualPipeV (the caller checks ``M >= 2P``)."""
    P, M = num_ranks, num_microbatches
    assert M >= 2 * P, f"dualpipev needs M >= 2P, got M={M} for P={P}"
    return compute_schedule("dualpipev", num_ranks=P, num_microbatches=M,
                            stage_to_rank=Placement.V_SHAPE.stage_to_rank(P, 2),
                            work=[_rank_order(r, P, M) for r in range(P)], meta={"chunks": 2})
