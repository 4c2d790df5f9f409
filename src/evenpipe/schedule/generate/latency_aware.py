"""Latency-aware list scheduling under a per-rank activation cap (after CrossPipe, Chen et al. 2025).

A pipeline whose links are slow loses, in 1F1B and its zero-bubble kin, about twice the link time per hop on
every micro-batch's round trip: their warm-up counts and orders are fixed for free links. This generator orders
the actions knowing each link's message time. It runs a list simulation in continuous time, with the given
forward, input-gradient and weight-gradient times and, for every directed rank pair, the time from a send to
its arrival (a link carries one message at a time, as in the simulator). Whenever a rank is free it starts, in
this order of preference:

1. an ``I`` whose inputs have arrived (the critical path; oldest micro-batch first, then the later stage);
2. a ``F`` whose input has arrived and that fits the cap (the next chunk of a micro-batch the rank already
   started when one chunk fits, else the first chunk of a new micro-batch when all its chunks on this rank fit);
3. the oldest pending ``W`` (it frees the chunk's activations).

and when nothing has arrived it idles until the next arrival. Variants differ in whether ``W`` goes before
``F``, whether rank ``r`` keeps ``r`` units of its cap for deferred ``W``s (ZB-H1's rule), and whether a rank
idles for an ``I`` about to land rather than start something that would delay it. The zero-bubble order of the
same placement (zb-h1, or zb-v on the V) is one more candidate when it fits the cap. Every candidate is timed
under the plan with one message at a time per link, as the simulator runs it
(:func:`~evenpipe.schedule.generate.latency_compact.timed`); the two fastest are then shifted left (later work
pulled into the idle time latency leaves, never lengthening the step:
:func:`~evenpipe.schedule.generate.latency_compact.left_shift`) and the fastest of all is kept. The cap counts chunk-activations from ``F`` until ``W`` (an ``I`` frees nothing in this count) and a new
micro-batch starts only when the chunks the rank's started micro-batches still need also fit, so no rank ever
holds more than ``cap`` activation units in the simulator either, whatever the times.

Placement (the family's ``--chunks``): one stage per rank, or the V (stage ``r`` and ``2P-1-r`` on rank ``r``),
where a micro-batch starts and ends on the same rank and the first rank is busy while the pipeline fills; the V
gains most at a quarter of a forward, one stage per rank from half a forward up (every V hop is a message, so it
pays the latency twice as often).

Messages are then placed by the planned times (:func:`place_messages`): a receive is posted as soon as the rank
has finished the computes planned to end before the message is sent, so a transfer starts when its producer
ends instead of when the consumer's rank gets round to asking for it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule.generate.latency_compact import left_shift, timed
from evenpipe.schedule.generate.latency_plan import LinkPlan
from evenpipe.schedule.generate.ordering import Work, compute_schedule
from evenpipe.schedule.generate.zb_h1 import zb_h1
from evenpipe.schedule.generate.zb_v import zb_v
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["LinkPlan", "latency_aware", "v_layout"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_NEVER = math.inf


@dataclass(frozen=True, slots=True)
class _Policy:
    """One variant of the list scheduler."""

    weight_first: bool
    """Whether a pending ``W`` goes before a ready ``F`` (else only when no ``F`` fits)."""
    slack: int
    """Rank ``r`` starts a new micro-batch only while fewer than ``cap - slack * r`` chunk-activations wait for
    their ``I`` (zb-h1's rule at ``slack = 1``: the rest of the cap holds deferred ``W``s for the drain)."""
    patient: bool
    """Whether a rank idles for an ``I`` that arrives before the ``F`` or ``W`` it could start would end."""

    @property
    def label(self) -> str:
        return (f"{'W' if self.weight_first else 'F'}-first/slack{self.slack}"
                f"{'/patient' if self.patient else ''}")


_POLICIES = tuple(_Policy(w, slack, patient) for patient in (False, True) for w in (False, True) for slack in (0, 1))
"""The variants tried; the fastest under the plan is kept."""
_SHIFTED = 2
"""How many of the fastest candidates are shifted left (:func:`left_shift`; each pass times the whole order)."""


def v_layout(num_ranks: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: stage ``s`` on rank ``s`` for ``s < P``, else on rank ``2P-1-s``."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


def latency_aware(*, num_ranks: int, num_microbatches: int, plan: LinkPlan,
                  stage_to_rank: Sequence[int] | None = None) -> Schedule:
    """Compute-only latency-aware schedule (the fastest candidate under ``plan``); ``stage_to_rank`` is one stage
    per rank or the V (the default). Raises ``ConfigError`` when the cap is below one activation unit or the plan
    has the wrong size."""
    P, M = num_ranks, num_microbatches
    layout = tuple(stage_to_rank) if stage_to_rank is not None else v_layout(P)
    plan.check_size(P)
    chunks = max(sum(1 for x in layout if x == r) for r in range(P))
    cap_units = float(P) if plan.cap is None else plan.cap
    cap = math.floor(cap_units * chunks + 1e-9)
    if cap < chunks:
        raise ConfigError(f"latency-aware: a cap of {cap_units:g} activation units is below one micro-batch's "
                          f"{chunks} chunks on a rank; allowed: cap >= 1")
    candidates = [(policy.label, _ListRun(P, M, layout, plan, cap, policy).run()[1]) for policy in _POLICIES]
    fixed = _fixed_order(P, M, layout)
    if fixed is not None and _held_peak(fixed) <= cap:
        candidates.append(("zero-bubble order", fixed))
    label, work = _best(candidates, layout, plan, cap)
    return compute_schedule("latency-aware", num_ranks=P, num_microbatches=M, stage_to_rank=layout, work=work,
                            meta={"chunks": chunks, "cap": cap_units, "policy": label})


def _best(candidates: list[tuple[str, list[list[Work]]]], layout: tuple[int, ...], plan: LinkPlan, cap: int
          ) -> tuple[str, list[list[Work]]]:
    """The fastest candidate after :func:`left_shift` of the fastest ``_SHIFTED`` as they are (all timed with one
    message at a time per link, as the simulator does)."""
    timings = [(timing.step, k) for k, (_, work) in enumerate(candidates)
               if (timing := timed(work, layout, plan)) is not None]
    timings.sort()
    best = (timings[0][0], candidates[timings[0][1]][0], candidates[timings[0][1]][1])
    for _, k in timings[:_SHIFTED]:
        label, work = candidates[k]
        shifted = left_shift(work, layout, plan, cap)
        if shifted is not None and shifted[1] < best[0] - 1e-9:
            best = (shifted[1], f"{label}, shifted left", shifted[0])
    return best[1], best[2]


def _fixed_order(P: int, M: int, layout: tuple[int, ...]) -> list[list[Work]] | None:
    """The zero-bubble family's order for this placement (zb-h1 on one stage per rank, zb-v on the V), a candidate
    that the list scheduler's variants must beat; ``None`` for other placements."""
    if layout == tuple(range(P)):
        sched = zb_h1(num_ranks=P, num_microbatches=M)
    elif layout == v_layout(P):
        sched = zb_v(num_ranks=P, num_microbatches=M, stage_to_rank=layout)
    else:
        return None
    return [[(a.kind, a.stage, a.microbatch) for a in acts] for acts in sched.actions]


def _held_peak(work: list[list[Work]]) -> int:
    """The most chunk-activations any rank holds, counting each from its ``F`` to its ``W``."""
    peak = 0
    for rank_work in work:
        held = 0
        for kind, _, _ in rank_work:
            held += 1 if kind is _F else -1 if kind is _W else 0
            peak = max(peak, held)
    return peak


class _ListRun:
    """One list simulation (see the module docstring)."""

    def __init__(self, P: int, M: int, layout: tuple[int, ...], plan: LinkPlan, cap: int, policy: _Policy) -> None:
        self.P, self.M, self.S, self.layout, self.plan, self.cap = P, M, len(layout), layout, plan, cap
        self.weight_first, self.patient = policy.weight_first, policy.patient
        self.stages = [sorted((s for s in range(self.S) if layout[s] == r), reverse=True) for r in range(P)]
        chunks = max(len(st) for st in self.stages)
        self.limit = [max(chunks, cap - chunks * policy.slack * r) for r in range(P)]
        """Per rank: chunk-activations that may wait for their ``I`` before a new micro-batch starts."""
        self.waiting = [0] * P
        self.dur = [plan.durations(max(len(st) for st in self.stages), r) for r in range(P)]
        self.f_arrive = [[_NEVER] * M for _ in range(self.S)]  # when F(s, m)'s input is on its rank
        self.i_arrive = [[_NEVER] * M for _ in range(self.S)]  # when I(s, m)'s output gradient is on its rank
        self.f_end = [[_NEVER] * M for _ in range(self.S)]
        self.next_f, self.next_i = [0] * self.S, [0] * self.S
        self.held = [0] * P
        self.left: list[dict[int, int]] = [{} for _ in range(P)]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
        self.link_free: dict[tuple[int, int], float] = {}
        self.wake = [0.0] * P
        """Per rank: the next time it may start something (its busy end, or an input landing)."""
        self.work: list[list[Work]] = [[] for _ in range(P)]
        for m in range(M):
            self.f_arrive[0][m] = 0.0
            self.i_arrive[self.S - 1][m] = 0.0

    def run(self) -> tuple[float, list[list[Work]]]:
        """Makespan and per-rank work. A rank is asked again only when it may have something new: at the end of
        its own action, or when an input it waits for lands (``self.wake``, lowered by :meth:`_send`)."""
        wake = self.wake
        remaining, t, end = 3 * self.S * self.M, 0.0, 0.0
        while remaining:
            progressed = True
            while progressed:
                progressed = False
                for r in range(self.P):
                    if wake[r] > t:
                        continue
                    step, when = self._choose(r, t)
                    if step is None:
                        wake[r] = when
                        continue
                    wake[r] = finish = t + self.dur[r][step[0]]
                    end = max(end, finish)
                    self._start(r, step, finish)
                    remaining -= 1
                    progressed = True
            nxt = min(wake)
            assert remaining == 0 or t < nxt < _NEVER, f"latency-aware: list simulation stalled at t={t}"
            t = nxt
        return end, self.work

    def _choose(self, r: int, t: float) -> tuple[Work | None, float]:
        """What rank ``r`` starts at ``t``, or ``None`` and the next time one of its inputs arrives."""
        wake = _NEVER
        best_i: tuple[int, int] | None = None
        for s in self.stages[r]:
            m = self.next_i[s]
            if m < self.M and self.f_end[s][m] < _NEVER:
                ready = max(self.f_end[s][m], self.i_arrive[s][m])
                if ready <= t:
                    if best_i is None or m < best_i[1]:
                        best_i = (s, m)
                else:
                    wake = min(wake, ready)
        if best_i is not None:
            return (_I, *best_i), t
        forward, when = self._forward(r, t)
        weight = (_W, *self.pending_w[r][0]) if self.pending_w[r] else None
        first, second = (weight, forward) if self.weight_first else (forward, weight)
        step = first or second
        if step is not None and self.patient and wake < t + self.dur[r][step[0]]:
            return None, wake  # an input gradient lands before this would end: keep the rank for it
        return step, min(wake, when)

    def _forward(self, r: int, t: float) -> tuple[Work | None, float]:
        """The forward rank ``r`` may start at ``t`` within its cap, or ``None`` and when one's input arrives."""
        started: tuple[int, int] | None = None
        fresh: tuple[int, int] | None = None
        wake = _NEVER
        left, room = self.left[r], self.cap - self.held[r]
        reserved = sum(left.values())  # chunks the started micro-batches still need here
        for s in self.stages[r]:
            m = self.next_f[s]
            if m >= self.M:
                continue
            fits = room >= 1 if m in left else (room >= len(self.stages[r]) + reserved and
                                                self.waiting[r] + len(self.stages[r]) <= self.limit[r])
            if not fits:
                continue
            if self.f_arrive[s][m] > t:
                wake = min(wake, self.f_arrive[s][m])
            elif m in left:
                started = started or (s, m)
            elif fresh is None:
                fresh = (s, m)
        chosen = started or fresh
        return ((_F, *chosen) if chosen else None), wake

    def _send(self, src_stage: int, dst_stage: int, at: float) -> float:
        """Arrival time of a message from ``src_stage``'s rank to ``dst_stage``'s, sent at ``at``."""
        a, b = self.layout[src_stage], self.layout[dst_stage]
        if a == b:
            return at  # the rank's own action: it is asked again when that ends
        start = max(at, self.link_free.get((a, b), 0.0))
        arrive = start + self.plan.message_time(a, b)
        self.link_free[(a, b)] = arrive
        self.wake[b] = min(self.wake[b], arrive)
        return arrive

    def _start(self, r: int, step: Work, finish: float) -> None:
        kind, s, m = step
        self.work[r].append(step)
        if kind is _F:
            self.next_f[s] += 1
            self.f_end[s][m] = finish
            if s + 1 < self.S:
                self.f_arrive[s + 1][m] = self._send(s, s + 1, finish)
            self.held[r] += 1
            self.waiting[r] += 1
            left = self.left[r]
            if m in left:
                left[m] -= 1
                if not left[m]:
                    del left[m]
            elif len(self.stages[r]) > 1:
                left[m] = len(self.stages[r]) - 1
        elif kind is _I:
            self.next_i[s] += 1
            if s > 0:
                self.i_arrive[s - 1][m] = self._send(s, s - 1, finish)
            self.pending_w[r].append((s, m))
            self.waiting[r] -= 1
        else:
            self.pending_w[r].popleft()
            self.held[r] -= 1
