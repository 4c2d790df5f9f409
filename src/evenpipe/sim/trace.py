"""What a run of a schedule produced: when each action ran, every transfer, and activation memory over time.

The simulator returns a :class:`Trace`; the runtime records the same type from measurements, so "predicted vs
measured" is a comparison of two traces. Times are in the cost model's unit (seconds by convention), memory in
bytes. An *activation unit* is the activations one micro-batch leaves on one whole stage (``Trace.unit_bytes``
per rank: the sum of ``activation_bytes`` over the stages the rank holds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import repeat
from operator import sub
from typing import Any, Callable, Iterator, NamedTuple, TypeAlias

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


class Trace:
    """Everything one step of a schedule did, simulated or measured.

    Made from per-rank :class:`ActionRecord` tuples (``actions``) or, by the simulator, from per-rank start and
    end times (``times``), in which case the records (and the schedule's ``Action`` objects) are built only when
    ``actions`` is first read; the summaries (busy time, bubbles, counts) read the times directly. Immutable;
    equality compares every field but ``evaluator`` (two evaluators that agree make equal traces).
    """

    __slots__ = ("schedule", "_actions", "_times", "_transfers", "memory", "unit_bytes", "step_time", "source",
                 "_spans", "_deferred", "_counts", "_waited", "evaluator")

    schedule: Schedule
    """The schedule that ran."""
    memory: tuple[MemoryTimeline, ...]
    """Per rank, activation memory over time."""
    unit_bytes: tuple[float, ...]
    """Per rank, the bytes of one activation unit (sum of ``activation_bytes`` of the stages it holds)."""
    step_time: float
    """Makespan: the last end time of any action or transfer."""
    source: str
    """``sim`` for the simulator, ``measured`` for a runtime trace."""
    evaluator: str
    """Which of the simulator's evaluators made the trace (``free``, ``links``, ``fast``, ``events``; see
    :mod:`evenpipe.sim.dispatch`); empty for a measured trace or one read from JSON written before the field."""
    _actions: tuple[tuple[ActionRecord, ...], ...] | None
    _times: tuple[list[list[float]], list[list[float]]] | None
    _spans: list[tuple[float, float, float]] | None
    _transfers: tuple[TransferRecord, ...] | None
    _deferred: "Callable[[], tuple[tuple[list[list[float]], list[list[float]]], tuple[TransferRecord, ...]]] | None"
    _counts: tuple[int, float] | None
    _waited: tuple[TransferRecord, ...] | None

    def __init__(self, *, schedule: Schedule, transfers: tuple[TransferRecord, ...],
                 memory: tuple[MemoryTimeline, ...], unit_bytes: tuple[float, ...], step_time: float,
                 source: str = "sim", actions: tuple[tuple[ActionRecord, ...], ...] | None = None,
                 times: tuple[list[list[float]], list[list[float]]] | None = None, evaluator: str = "") -> None:
        if (actions is None) == (times is None):
            raise ValueError("a trace needs exactly one of actions and times")
        self._init(schedule, actions, times, transfers, memory, unit_bytes, step_time, source, None, None, None,
                   None, evaluator)

    def _init(self, schedule: Schedule, actions: object, times: object, transfers: object, memory: object,
              unit_bytes: object, step_time: float, source: str, spans: object, deferred: object,
              counts: object, waited: object, evaluator: str) -> None:
        init = object.__setattr__
        for name, value in (("schedule", schedule), ("_actions", actions), ("_times", times),
                            ("_transfers", transfers), ("memory", memory), ("unit_bytes", unit_bytes),
                            ("step_time", step_time), ("source", source), ("_spans", spans),
                            ("_deferred", deferred), ("_counts", counts), ("_waited", waited),
                            ("evaluator", evaluator)):
            init(self, name, value)

    @classmethod
    def deferred(cls, *, schedule: Schedule, memory: tuple[MemoryTimeline, ...], unit_bytes: tuple[float, ...],
                 step_time: float, spans: list[tuple[float, float, float]] | None, num_transfers: int,
                 exposed_transfer_time: float,
                 times_and_transfers: "Callable[[], tuple[tuple[list[list[float]], list[list[float]]], "
                                      "tuple[TransferRecord, ...]]]",
                 evaluator: str, times: tuple[list[list[float]], list[list[float]]] | None = None,
                 waited: tuple[TransferRecord, ...] | None = None) -> "Trace":
        """A simulated trace whose per-action times and transfer records are computed only when first read
        (``times_and_transfers``); the summaries a caller reads most (step time, bubbles from ``spans``, memory
        peaks, the number of transfers and their exposed time) are known up front, and so are the per-action
        ``times`` and the records some compute ``waited`` on (in order of arrival) where the caller has them
        (``spans`` may then be ``None``: they follow from the times); ``evaluator`` names who made it."""
        self = cls.__new__(cls)
        self._init(schedule, None, times, None, memory, unit_bytes, step_time, "sim", spans, times_and_transfers,
                   (num_transfers, exposed_transfer_time), waited, evaluator)
        return self

    def _resolve(self) -> None:
        """Compute the deferred times and transfers (once)."""
        make = self._deferred
        if make is not None:
            times, transfers = make()
            object.__setattr__(self, "_times", times)
            object.__setattr__(self, "_transfers", transfers)
            object.__setattr__(self, "_deferred", None)

    @property
    def transfers(self) -> tuple[TransferRecord, ...]:
        """Every message, in order of arrival."""
        if self._transfers is None:
            self._resolve()
        assert self._transfers is not None
        return self._transfers

    @property
    def num_transfers(self) -> int:
        """``len(transfers)`` (without computing deferred records)."""
        return self._counts[0] if self._counts is not None else len(self.transfers)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Trace is immutable: cannot assign {name!r}")

    @property
    def actions(self) -> tuple[tuple[ActionRecord, ...], ...]:
        """Per rank, its executed actions in list order."""
        recs = self._actions
        if recs is None:
            self._resolve()
            assert self._times is not None
            starts, ends = self._times
            new = tuple.__new__  # over zip: the named tuples are built in C
            recs = tuple(tuple(map(new, repeat(ActionRecord), zip(repeat(r), range(len(acts)), acts, starts[r],
                                                                   ends[r])))
                         for r, acts in enumerate(self.schedule.actions))
            object.__setattr__(self, "_actions", recs)
        return recs

    def _fields(self) -> tuple[object, ...]:
        return (self.schedule, self.transfers, self.memory, self.unit_bytes, self.step_time, self.source)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        if self is other:
            return True
        if self._fields() != other._fields():
            return False
        self._resolve()
        other._resolve()
        if self._times is not None and other._times is not None:
            return self._times == other._times
        return self.actions == other.actions

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[object, ...]:
        return (_trace_from_state, (self.schedule, self.actions, self.transfers, self.memory, self.unit_bytes,
                                    self.step_time, self.source, self.evaluator))

    def __repr__(self) -> str:
        return (f"Trace(source={self.source!r}, schedule={self.schedule.name!r}, step_time={self.step_time!r}, "
                f"transfers={len(self.transfers)}, actions={self.num_actions})")

    def _compute_spans(self) -> list[tuple[float, float, float]]:
        """Per rank (busy compute time, first compute start, last compute end); zeros and infinities when none."""
        if self._spans is not None:
            return self._spans
        compute = _IS_COMPUTE
        out: list[tuple[float, float, float]] = []
        object.__setattr__(self, "_spans", out)
        if self._times is not None:
            starts, ends = self._times
            for kinds, st, en in zip(self.schedule.columns.kinds, starts, ends):
                at = [i for i, c in enumerate(kinds) if compute[c]]
                s = list(map(st.__getitem__, at))
                e = list(map(en.__getitem__, at))
                out.append((sum(map(sub, e, s)),
                            min(s, default=float("inf")), max(e, default=float("-inf"))))
            return out
        for acts in self.actions:
            recs = [r for r in acts if compute[r.action.kind.code]]
            out.append((sum(r.end - r.start for r in recs), min((r.start for r in recs), default=float("inf")),
                        max((r.end for r in recs), default=float("-inf"))))
        return out

    @property
    def num_ranks(self) -> int:
        if self._deferred is not None:
            return len(self.memory)
        return len(self._times[0]) if self._times is not None else len(self.actions)

    def to_json(self) -> str:
        """The trace as JSON text (times in seconds, bytes as numbers, actions as IR tokens)."""
        doc: dict[str, Any] = {
            "format": TRACE_FORMAT, "version": TRACE_VERSION, "source": self.source, "evaluator": self.evaluator,
            "step_time": self.step_time,
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
                       source=str(doc["source"]), evaluator=str(doc.get("evaluator", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"damaged trace: {type(e).__name__}: {e}") from None

    @property
    def num_actions(self) -> int:
        if self._deferred is not None:
            return sum(map(len, self.schedule.columns.kinds))
        if self._times is not None:
            return sum(len(row) for row in self._times[0])
        return sum(len(acts) for acts in self.actions)

    def action_times(self, rank: int) -> tuple[list[float], list[float]]:
        """Start and end of each action of one rank, in list order (without building records when the trace
        holds times)."""
        if self._times is None:
            self._resolve()
        if self._times is not None:
            return self._times[0][rank], self._times[1][rank]
        recs = self.actions[rank]
        return [r.start for r in recs], [r.end for r in recs]

    def records(self, rank: int) -> tuple[ActionRecord, ...]:
        """The executed actions of one rank, in list order."""
        return self.actions[rank]

    def compute_records(self) -> Iterator[ActionRecord]:
        """Every compute action of every rank."""
        for acts in self.actions:
            yield from (rec for rec in acts if _IS_COMPUTE[rec.action.kind.code])

    def busy_time(self, rank: int) -> float:
        """Total compute time of one rank."""
        if self._times is not None or self._spans is not None:
            return self._compute_spans()[rank][0]
        return sum(rec.end - rec.start for rec in self.actions[rank] if _IS_COMPUTE[rec.action.kind.code])

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: ``1 - busy compute / (ranks x step_time)``."""
        if self.step_time <= 0:
            return 0.0
        busy = sum(b for b, _, _ in self._compute_spans())
        return 1.0 - busy / (self.num_ranks * self.step_time)

    @property
    def repeated_bubble_fraction(self) -> float:
        """Idle share when steps repeat back to back with nothing synchronising the ranks in between (Qi et al.'s
        post-validation in place of the optimizer's all-reduce): the period is then the longest span of any rank's
        computes (first start to last end), ``1 - busy compute / (ranks x longest span)``. A schedule whose ranks
        all work without a gap from their first compute to their last (ZB-H2's parallelogram) has none, although
        each single step still has its ramps."""
        spans = self._compute_spans()
        period = max((last - first for _, first, last in spans if first <= last), default=0.0)
        if period <= 0:
            return 0.0
        busy = sum(b for b, _, _ in spans)
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
    def waited_transfers(self) -> tuple[TransferRecord, ...]:
        """Transfers some compute waited on (``exposed_s > 0``), in order of arrival (without computing deferred
        records where the simulator knew them)."""
        if self._waited is not None:
            return self._waited
        if self._counts is not None and self._counts[1] == 0:
            return ()  # exposed times are never negative: none is exposed
        return tuple(t for t in self.transfers if t.exposed_s > 0)

    @property
    def exposed_transfers(self) -> tuple[TransferRecord, ...]:
        """Transfers some compute waited on, most exposed first."""
        return tuple(sorted(self.waited_transfers, key=lambda t: -t.exposed_s))

    @property
    def exposed_transfer_time(self) -> float:
        """Sum of ``exposed_s`` over all transfers."""
        if self._counts is not None:
            return self._counts[1]
        return sum(t.exposed_s for t in self.transfers)


def _trace_from_state(schedule: Schedule, actions: tuple[tuple[ActionRecord, ...], ...],
                      transfers: tuple[TransferRecord, ...], memory: tuple[MemoryTimeline, ...],
                      unit_bytes: tuple[float, ...], step_time: float, source: str, evaluator: str = "") -> Trace:
    return Trace(schedule=schedule, actions=actions, transfers=transfers, memory=memory, unit_bytes=unit_bytes,
                 step_time=step_time, source=source, evaluator=evaluator)


SimResult: TypeAlias = Trace
"""What :func:`evenpipe.sim.simulate` returns (a :class:`Trace` with ``source == "sim"``)."""
