"""What the latency-aware generator plans with (:class:`LinkPlan`), and the timing of a compute order under it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from evenpipe.errors import ConfigError
from evenpipe.schedule.ir import Action, ActionKind, Schedule

__all__ = ["LinkPlan", "PRODUCES", "planned_makespan", "planned_times"]

_K = ActionKind
_F, _I, _W = _K.FORWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT
PRODUCES = {_K.FORWARD: (1, _K.SEND_F, _K.RECV_F), _K.BACKWARD: (-1, _K.SEND_B, _K.RECV_B),
            _K.BACKWARD_INPUT: (-1, _K.SEND_B, _K.RECV_B)}
"""Producer kind -> (offset of the stage it feeds, send kind, receive kind)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkPlan:
    """What the latency-aware generator plans with. Times are of one whole rank's layers (a chunk of V on a rank
    takes 1/V of them); any consistent unit."""

    forward: float = 1.0
    """Forward time."""
    backward_input: float = 1.0
    """Input-gradient time (``I``)."""
    backward_weight: float = 1.0
    """Weight-gradient time (``W``)."""
    message: tuple[tuple[float, ...], ...] = ()
    """``message[src][dst]``: time from a send on rank ``src`` to its arrival on ``dst`` (latency plus bytes over
    bandwidth); empty: free links."""
    cap: float | None = None
    """Activation units (a rank's whole layers for one micro-batch) a rank may hold; ``None``: P, 1F1B's peak."""
    slowdown: tuple[float, ...] = ()
    """Per rank, how many times longer its computes take than the times above (a slow or older GPU: 2.0);
    empty: every rank takes them."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"latency-aware plan: {name} must be a finite number >= 0, got {value}")
        for row in self.message:
            if len(row) != len(self.message) or not all(v >= 0 and math.isfinite(v) for v in row):
                raise ConfigError("latency-aware plan: message times must be a square table of finite numbers >= 0, "
                                  f"got {self.message}")
        if not all(v > 0 and math.isfinite(v) for v in self.slowdown):
            raise ConfigError(f"latency-aware plan: slowdowns must be finite numbers > 0, got {self.slowdown}")
        if self.cap is not None and not self.cap > 0:
            raise ConfigError(f"latency-aware plan: cap must be > 0 activation units, got {self.cap}")

    @classmethod
    def uniform(cls, *, num_ranks: int, latency: float, forward: float = 1.0, backward_input: float = 1.0,
                backward_weight: float = 1.0, cap: float | None = None) -> "LinkPlan":
        """Every link takes ``latency`` per message."""
        row = [[0.0 if a == b else latency for b in range(num_ranks)] for a in range(num_ranks)]
        return cls(forward=forward, backward_input=backward_input, backward_weight=backward_weight,
                   message=tuple(tuple(r) for r in row), cap=cap)

    def message_time(self, src: int, dst: int) -> float:
        """Time from a send on ``src`` to its arrival on ``dst``."""
        if src == dst or not self.message:
            return 0.0
        return self.message[src][dst]

    def durations(self, num_chunks: int, rank: int = 0) -> dict[ActionKind, float]:
        """Planning time of each compute kind on one chunk of ``rank``, none below a tiny positive floor (so that
        planned times order messages strictly, see :func:`place_messages`)."""
        floor = 1e-6 * max(self.forward + self.backward_input + self.backward_weight, 1e-300)
        times = {_F: self.forward, _I: self.backward_input, _W: self.backward_weight,
                 ActionKind.RECOMPUTE: self.forward, ActionKind.BACKWARD: self.backward_input + self.backward_weight}
        k = self.slowdown[rank] if self.slowdown else 1.0
        return {kind: max(t * k / num_chunks, floor) for kind, t in times.items()}

    def check_size(self, num_ranks: int) -> None:
        """Raise ``ConfigError`` unless the per-rank tables (if given) have ``num_ranks`` entries."""
        for name, table in (("message times", self.message), ("slowdowns", self.slowdown)):
            if table and len(table) != num_ranks:
                raise ConfigError(f"latency-aware plan has {name} for {len(table)} ranks, schedule has {num_ranks}")



def planned_times(compute: Schedule, plan: LinkPlan) -> tuple[list[list[float]], list[list[float]]]:
    """Start and finish of every action of a compute-only schedule run in its program order with the plan's
    durations and message times (a longest-path pass; links carry messages concurrently here)."""
    P, S, layout = compute.num_ranks, compute.num_stages, compute.stage_to_rank
    dur = [plan.durations(compute.num_chunks, r) for r in range(P)]
    acts = compute.actions
    starts: list[list[float]] = [[0.0] * len(a) for a in acts]
    ends: list[list[float]] = [[0.0] * len(a) for a in acts]
    out_end: dict[tuple[int, int, int], float] = {}  # (direction +1 forward / -1 gradient, stage, mb) -> finish
    pos, free = [0] * P, [0.0] * P
    remaining = sum(len(a) for a in acts)
    while remaining:
        progressed = False
        for r in range(P):
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                ready = _input_time(a, out_end, layout, S, plan)
                if ready is None:
                    break
                i = pos[r]
                starts[r][i] = start = max(free[r], ready)
                ends[r][i] = free[r] = start + dur[r][a.kind]
                if a.kind in PRODUCES:
                    out_end[(PRODUCES[a.kind][0], a.stage, a.microbatch)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "latency-aware: the compute order has a cyclic wait"
    return starts, ends


def _input_time(a: Action, out_end: dict[tuple[int, int, int], float], layout: tuple[int, ...], S: int,
                plan: LinkPlan) -> float | None:
    """When ``a``'s input from another stage is on its rank (0 when it has none), or ``None`` if not yet known."""
    if a.kind is _K.FORWARD and a.stage > 0:
        src = (1, a.stage - 1, a.microbatch)
    elif a.kind in (_K.BACKWARD, _K.BACKWARD_INPUT) and a.stage < S - 1:
        src = (-1, a.stage + 1, a.microbatch)
    else:
        return 0.0
    end = out_end.get(src)
    if end is None:
        return None
    return end + plan.message_time(layout[src[1]], layout[a.stage])


def planned_makespan(compute: Schedule, plan: LinkPlan) -> float:
    """The step time :func:`planned_times` plans for a compute-only schedule."""
    return max((e for row in planned_times(compute, plan)[1] for e in row), default=0.0)

