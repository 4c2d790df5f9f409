"""What a run of a schedule produced: when each action ran, every transfer, and activation memory over time.

The simulator returns a :class:`Trace`; the runtime records the same type from measurements, so "predicted vs
measured" is a comparison of two traces. Times are in the cost model's unit (seconds by convention), memory in
bytes. An *activation unit* is the activations one micro-batch leaves on one whole stage (``Trace.unit_bytes``
per rank: the sum of ``activation_bytes`` over the stages the rank holds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, TypeAlias

from evenpipe.errors import ConfigError
from evenpipe.schedule.ir import Action, ActionKind, Schedule, parse_action
from evenpipe.schedule.semantics import TABLES

__all__ = ["ActionRecord", "TransferRecord", "MemoryTimeline", "Trace", "SimResult", "TRACE_FORMAT",
           "TRACE_VERSION"]

TRACE_FORMAT = "evenpipe.trace"
"""``format`` field of a trace's JSON form."""
TRACE_VERSION = 1
"""``version`` field of a trace's JSON form; bumped when the fields change meaning."""

_IS_COMPUTE = TABLES.compute
"""Whether each kind code is a compute (list indexing by ``kind.code``, for hot loops)."""


class ActionRecord(NamedTuple):
    """One executed action of one rank.

    For a compute, ``start``..``end`` is when it ran. For a send or receive, ``start`` is when the rank reached
    (posted) it and ``end`` when its message was delivered; the rank itself never blocks on either.
    (A named tuple rather than a dataclass: a large step has ~10^5-10^6 of them and this is 3x cheaper to build.)
    """

    rank: int
    """Rank that executed the action."""
    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: the name reads best
    """Position in the rank's action list."""
    action: Action
    """The schedule action."""
    start: float
    """Start time."""
    end: float
    """End time."""

    @property
    def kind(self) -> ActionKind:
        return self.action.kind

    @property
    def duration(self) -> float:
        return self.end - self.start


class TransferRecord(NamedTuple):
    """One point-to-point message (activation, gradient, BPipe evict/return, or host offload/reload).

    Host transfers have ``src == dst`` (the rank's own host link). A named tuple for the same reason as
    :class:`ActionRecord`.
    """

    src: int
    """Sending rank."""
    dst: int
    """Receiving rank."""
    kind: ActionKind
    """The sending action's kind (``SEND_F``, ``SEND_B``, ``EVICT``, ``RETURN``, ``OFFLOAD`` or ``RELOAD``)."""
    stage: int
    """Stage of the sending action."""
    microbatch: int
    """Micro-batch the message belongs to."""
    num_bytes: float
    """Message size in bytes."""
    start: float
    """When the bytes started to move (both sides ready and the link free)."""
    end: float
    """When the message arrived."""
    exposed_s: float = 0.0
    """How long the consuming compute waited on this message beyond its rank and the data being ready (for an
    ``EVICT``: how long the sender's next ``F``/``R`` waited for it to land, beyond its other inputs)."""

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind.token}{self.microbatch} {self.src}->{self.dst}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTimeline:
    """Activation bytes held by one rank (own plus hosted) as a step function of time."""

    rank: int
    """Rank the timeline belongs to."""
    points: tuple[tuple[float, float], ...]
    """``(time, bytes)``: the bytes held from ``time`` until the next point; starts at ``(0, 0)``."""

    @property
    def peak_bytes(self) -> float:
        return max((b for _, b in self.points), default=0.0)

    @property
    def peak_time(self) -> float:
        """First time the peak is reached."""
        peak = self.peak_bytes
        return next((t for t, b in self.points if b == peak), 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """Everything one step of a schedule did, simulated or measured."""

    schedule: Schedule
    """The schedule that ran."""
    actions: tuple[tuple[ActionRecord, ...], ...]
    """Per rank, its executed actions in list order."""
    transfers: tuple[TransferRecord, ...]
    """Every message, in order of arrival."""
    memory: tuple[MemoryTimeline, ...]
    """Per rank, activation memory over time."""
    unit_bytes: tuple[float, ...]
    """Per rank, the bytes of one activation unit (sum of ``activation_bytes`` of the stages it holds)."""
    step_time: float
    """Makespan: the last end time of any action or transfer."""
    source: str = "sim"
    """``sim`` for the simulator, ``measured`` for a runtime trace."""

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def to_json(self) -> str:
        """The trace as JSON text (times in seconds, bytes as numbers, actions as IR tokens)."""
        doc: dict[str, Any] = {
            "format": TRACE_FORMAT, "version": TRACE_VERSION, "source": self.source, "step_time": self.step_time,
            "unit_bytes": list(self.unit_bytes), "schedule": json.loads(self.schedule.to_json()),
            "actions": [[[rec.index, str(rec.action), rec.start, rec.end] for rec in acts] for acts in self.actions],
            "transfers": [[t.src, t.dst, t.kind.name, t.stage, t.microbatch, t.num_bytes, t.start, t.end, t.exposed_s]
                          for t in self.transfers],
            "memory": [[list(p) for p in m.points] for m in self.memory],
        }
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        """Inverse of :meth:`to_json`; a ``ConfigError`` names what is wrong with a foreign or damaged text."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a trace: invalid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
            raise ConfigError(f"not an evenpipe trace (format {doc.get('format') if isinstance(doc, dict) else None!r},"
                              f" expected {TRACE_FORMAT!r})")
        if doc.get("version") != TRACE_VERSION:
            raise ConfigError(f"trace version {doc.get('version')!r} is not supported; this evenpipe reads "
                              f"version {TRACE_VERSION}")
        try:
            schedule = Schedule.from_json(json.dumps(doc["schedule"]))
            actions = tuple(tuple(ActionRecord(rank, int(i), parse_action(tok), float(s), float(e))
                                  for i, tok, s, e in acts) for rank, acts in enumerate(doc["actions"]))
            transfers = tuple(TransferRecord(int(src), int(dst), ActionKind[kind], int(st), int(mb), float(n),
                                             float(s), float(e), float(x))
                              for src, dst, kind, st, mb, n, s, e, x in doc["transfers"])
            memory = tuple(MemoryTimeline(rank=r, points=tuple((float(t), float(b)) for t, b in pts))
                           for r, pts in enumerate(doc["memory"]))
            return cls(schedule=schedule, actions=actions, transfers=transfers, memory=memory,
                       unit_bytes=tuple(float(u) for u in doc["unit_bytes"]), step_time=float(doc["step_time"]),
                       source=str(doc["source"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"damaged trace: {type(e).__name__}: {e}") from None

    @property
    def num_actions(self) -> int:
        return sum(len(acts) for acts in self.actions)

    def records(self, rank: int) -> tuple[ActionRecord, ...]:
        """The executed actions of one rank, in list order."""
        return self.actions[rank]

    def compute_records(self) -> Iterator[ActionRecord]:
        """Every compute action of every rank."""
        for acts in self.actions:
            yield from (rec for rec in acts if _IS_COMPUTE[rec.action.kind.code])

    def busy_time(self, rank: int) -> float:
        """Total compute time of one rank."""
        return sum(rec.end - rec.start for rec in self.actions[rank] if _IS_COMPUTE[rec.action.kind.code])

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: ``1 - busy compute / (ranks x step_time)``."""
        if self.step_time <= 0:
            return 0.0
        busy = sum(self.busy_time(r) for r in range(self.num_ranks))
        return 1.0 - busy / (self.num_ranks * self.step_time)

    @property
    def repeated_bubble_fraction(self) -> float:
        """Idle share when steps repeat back to back with nothing synchronising the ranks in between (Qi et al.'s
        post-validation in place of the optimizer's all-reduce): the period is then the longest span of any rank's
        computes (first start to last end), ``1 - busy compute / (ranks x longest span)``. A schedule whose ranks
        all work without a gap from their first compute to their last (ZB-H2's parallelogram) has none, although
        each single step still has its ramps."""
        spans = [max(rec.end for rec in recs) - min(rec.start for rec in recs)
                 for recs in ([r for r in acts if _IS_COMPUTE[r.action.kind.code]] for acts in self.actions) if recs]
        period = max(spans, default=0.0)
        if period <= 0:
            return 0.0
        busy = sum(self.busy_time(r) for r in range(self.num_ranks))
        return max(0.0, 1.0 - busy / (self.num_ranks * period))

    @property
    def peak_activation_bytes(self) -> tuple[float, ...]:
        """Per rank, the peak activation bytes (own plus hosted)."""
        return tuple(m.peak_bytes for m in self.memory)

    @property
    def peak_activations(self) -> tuple[float, ...]:
        """Per rank, the peak in activation units (0 for a rank whose stages save nothing)."""
        return tuple(peak / unit if unit > 0 else 0.0
                     for peak, unit in zip(self.peak_activation_bytes, self.unit_bytes))

    @property
    def exposed_transfers(self) -> tuple[TransferRecord, ...]:
        """Transfers some compute waited on, most exposed first."""
        return tuple(sorted((t for t in self.transfers if t.exposed_s > 0), key=lambda t: -t.exposed_s))

    @property
    def exposed_transfer_time(self) -> float:
        """Sum of ``exposed_s`` over all transfers."""
        return sum(t.exposed_s for t in self.transfers)


SimResult: TypeAlias = Trace
"""What :func:`evenpipe.sim.simulate` returns (a :class:`Trace` with ``source == "sim"``)."""
