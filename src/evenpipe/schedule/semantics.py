"""What every action kind means, written once: one frozen :class:`KindSemantics` record per :class:`ActionKind`.

Every consumer of the IR (validator, witness timing, communication derivation, simulator, cost model's memory
walk, BPipe transform, runtime executor) reads these records, or the integer tables compiled from them
(:data:`TABLES`, indexed by ``kind.code``), instead of keeping private tables. A consumer that keeps its own
per-kind dispatch builds it with :func:`kind_table`, which fails at import time unless every kind is either
handled or explicitly refused, and registers the consumer in :data:`COVERAGE` (a test checks the registry).

Vocabulary
----------
- **role**: ``COMPUTE`` (runs layers), ``TRANSFER`` (moves an activation or a gradient between neighbouring
  stages) or ``MEMORY_MOVE`` (moves saved activations to a partner rank or to host memory and back).
- **memory effect**: what the action does to the saved activations of its (stage, micro-batch) on the rank
  that runs it; :attr:`KindSemantics.units` is the same in whole activation units, counted in program order
  (what :func:`evenpipe.schedule.bpipe.held_units` adds up).
- **peer kind**: the action on the other side of a message (a send's receive and vice versa).
- **requires**: the dependencies, as named predicates (:class:`Requirement`) checked once by the validator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping, TypeVar

from evenpipe.schedule.ir import ActionKind

__all__ = [
    "COVERAGE",
    "KindSemantics",
    "MemoryEffect",
    "Requirement",
    "Role",
    "SEMANTICS",
    "TABLES",
    "Tables",
    "kind_table",
    "semantics_of",
]

_K = ActionKind


class Role(enum.Enum):
    """What an action is for."""

    COMPUTE = "compute"
    """Runs (part of) a stage's layers on one micro-batch."""
    TRANSFER = "transfer"
    """Moves a stage output (activation) or an input gradient to the neighbouring stage's rank."""
    MEMORY_MOVE = "memory move"
    """Moves saved activations away (BPipe partner, host memory) and back."""


class MemoryEffect(enum.Enum):
    """Effect on the saved activations of the action's (stage, micro-batch) on the running rank."""

    NONE = "none"
    ALLOCATE = "allocate"
    """``F``: saves the stage's activations (only the checkpoint when the micro-batch is recomputed)."""
    REBUILD = "rebuild"
    """``R``: rebuilds the activations beyond the checkpoint."""
    FREE_ALL = "free all"
    """``B``: frees everything the micro-batch holds on the stage."""
    FREE_ALL_BUT_WEIGHT_GRAD = "free all but the weight-gradient inputs"
    """``I``: keeps only what the weight gradient needs."""
    FREE_REST = "free the rest"
    """``W``: frees what ``I`` kept."""
    SEND_AWAY = "send away"
    """``EVICT``/``OFFLOAD``: the rank's copy is freed once the transfer lands."""
    BRING_BACK = "bring back"
    """``LOAD``/``RELOAD``: the rank's copy is allocated again when the transfer starts."""
    HOST = "host"
    """``ACCEPT``: the rank holds a partner's activations (allocated when the transfer starts)."""
    UNHOST = "unhost"
    """``RETURN``: the hosted copy is freed once the transfer lands."""


class Requirement(enum.Enum):
    """A named dependency predicate: what must precede an action in its rank's program order."""

    INPUT = "input"
    """``F(s,m)``: ``F(s-1,m)`` on this rank, or ``RECV_F(s,m)`` when stage s-1 lives elsewhere (none for s=0)."""
    OWN_FORWARD = "own forward"
    """``F(s,m)`` ran on this rank."""
    RECOMPUTED = "recomputed"
    """If ``(s,m)`` is recomputed at all: ``R(s,m)`` ran on this rank."""
    OUTPUT_GRADIENT = "output gradient"
    """``B``/``I(s+1,m)`` on this rank, or ``RECV_B(s,m)`` (none for the last stage)."""
    INPUT_GRADIENT = "input gradient"
    """``I(s,m)`` ran (``W`` follows its input-gradient half)."""
    GRADIENT_PRODUCED = "gradient produced"
    """``B(s,m)`` or ``I(s,m)`` ran (a ``SEND_B`` sends what it produced)."""
    EVICTED = "evicted"
    """``EVICT(s,m)`` ran (a ``LOAD`` brings back what was evicted)."""
    ACCEPTED = "accepted"
    """``ACCEPT(s,m)`` ran (a ``RETURN`` gives back what was accepted)."""
    OFFLOADED = "offloaded"
    """``OFFLOAD(s,m)`` ran (a ``RELOAD`` brings back what was offloaded)."""
    ACTIVATIONS_HERE = "activations here"
    """The micro-batch's activations are not away (between ``EVICT`` and ``LOAD``, ``OFFLOAD`` and ``RELOAD``)."""


_R = Requirement


@dataclass(frozen=True, slots=True, kw_only=True)
class KindSemantics:
    """The meaning of one action kind."""

    kind: ActionKind
    """The kind described."""
    role: Role
    """Compute, transfer or memory move."""
    memory: MemoryEffect
    """Effect on the running rank's saved activations of the action's (stage, micro-batch)."""
    units: int
    """The same in activation units, counted in program order (own plus hosted)."""
    sends: bool = False
    """Whether the action sends a message (``False`` for receives and computes)."""
    peer_kind: ActionKind | None = None
    """Kind of the action on the other side of the message; ``None`` for computes."""
    host_side: bool = False
    """The other side is this rank's host memory (``OFFLOAD``/``RELOAD``), not a peer rank."""
    sender_stage_shift: int = 0
    """Offset from the action's stage to the stage that *sends* its message (``RECV_F(s)`` carries s-1's)."""
    neighbour_shift: int | None = None
    """For stage-to-stage transfers: offset from the action's stage to the stage whose rank is the peer."""
    channel: int | None = None
    """Message channel (activations, gradients, evictions, loads, host): a send and its receive share one."""
    stage_on_peer: bool = False
    """The action's stage lives on its peer (the acceptor's ``ACCEPT``/``RETURN`` name the evictor's stage)."""
    requires: tuple[Requirement, ...] = ()
    """Dependencies, as named predicates, checked by the validator in program order."""
    backward: bool = False
    """A backward compute (allocates nothing; an ``ACCEPT`` due while it runs is posted before it)."""
    frees_on_arrival: bool = False
    """The sender's copy is freed when the message lands (``EVICT``, ``RETURN``, ``OFFLOAD``)."""
    allocates_on_start: bool = False
    """The receiver's copy is allocated when the message starts (``ACCEPT``, ``LOAD``, ``RELOAD``)."""
    derived: bool = False
    """Added by :func:`evenpipe.schedule.comm.derive_communication` (dropped and re-derived there)."""

    @property
    def is_compute(self) -> bool:
        return self.role is Role.COMPUTE

    @property
    def is_message(self) -> bool:
        """A send or a receive between two ranks, or between a rank and its host memory."""
        return self.peer_kind is not None


SEMANTICS: Mapping[ActionKind, KindSemantics] = {s.kind: s for s in (
    KindSemantics(kind=_K.FORWARD, role=Role.COMPUTE, memory=MemoryEffect.ALLOCATE, units=1,
                  requires=(_R.INPUT,)),
    KindSemantics(kind=_K.BACKWARD, role=Role.COMPUTE, memory=MemoryEffect.FREE_ALL, units=-1, backward=True,
                  requires=(_R.OWN_FORWARD, _R.RECOMPUTED, _R.OUTPUT_GRADIENT, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.BACKWARD_INPUT, role=Role.COMPUTE, memory=MemoryEffect.FREE_ALL_BUT_WEIGHT_GRAD,
                  units=0, backward=True,
                  requires=(_R.OWN_FORWARD, _R.RECOMPUTED, _R.OUTPUT_GRADIENT, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.BACKWARD_WEIGHT, role=Role.COMPUTE, memory=MemoryEffect.FREE_REST, units=-1,
                  backward=True, requires=(_R.INPUT_GRADIENT, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.RECOMPUTE, role=Role.COMPUTE, memory=MemoryEffect.REBUILD, units=0,
                  requires=(_R.OWN_FORWARD, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.SEND_F, role=Role.TRANSFER, memory=MemoryEffect.NONE, units=0, sends=True,
                  peer_kind=_K.RECV_F, neighbour_shift=1, channel=0, derived=True,
                  requires=(_R.OWN_FORWARD, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.RECV_F, role=Role.TRANSFER, memory=MemoryEffect.NONE, units=0, peer_kind=_K.SEND_F,
                  sender_stage_shift=-1, neighbour_shift=-1, channel=0, derived=True),
    KindSemantics(kind=_K.SEND_B, role=Role.TRANSFER, memory=MemoryEffect.NONE, units=0, sends=True,
                  peer_kind=_K.RECV_B, neighbour_shift=-1, channel=1, derived=True,
                  requires=(_R.GRADIENT_PRODUCED,)),
    KindSemantics(kind=_K.RECV_B, role=Role.TRANSFER, memory=MemoryEffect.NONE, units=0, peer_kind=_K.SEND_B,
                  sender_stage_shift=1, neighbour_shift=1, channel=1, derived=True),
    KindSemantics(kind=_K.EVICT, role=Role.MEMORY_MOVE, memory=MemoryEffect.SEND_AWAY, units=-1, sends=True,
                  peer_kind=_K.ACCEPT, channel=2, frees_on_arrival=True,
                  requires=(_R.OWN_FORWARD, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.ACCEPT, role=Role.MEMORY_MOVE, memory=MemoryEffect.HOST, units=1, peer_kind=_K.EVICT,
                  channel=2, stage_on_peer=True, allocates_on_start=True, derived=True),
    KindSemantics(kind=_K.RETURN, role=Role.MEMORY_MOVE, memory=MemoryEffect.UNHOST, units=-1, sends=True,
                  peer_kind=_K.LOAD, channel=3, stage_on_peer=True, frees_on_arrival=True, derived=True,
                  requires=(_R.ACCEPTED,)),
    KindSemantics(kind=_K.LOAD, role=Role.MEMORY_MOVE, memory=MemoryEffect.BRING_BACK, units=1,
                  peer_kind=_K.RETURN, channel=3, allocates_on_start=True, requires=(_R.EVICTED,)),
    KindSemantics(kind=_K.OFFLOAD, role=Role.MEMORY_MOVE, memory=MemoryEffect.SEND_AWAY, units=-1, sends=True,
                  peer_kind=_K.RELOAD, host_side=True, channel=4, frees_on_arrival=True,
                  requires=(_R.OWN_FORWARD, _R.ACTIVATIONS_HERE)),
    KindSemantics(kind=_K.RELOAD, role=Role.MEMORY_MOVE, memory=MemoryEffect.BRING_BACK, units=1,
                  peer_kind=_K.OFFLOAD, host_side=True, channel=4, allocates_on_start=True,
                  requires=(_R.OFFLOADED,)),
)}
"""One record per action kind."""


def semantics_of(kind: ActionKind) -> KindSemantics:
    """The record of ``kind``."""
    return SEMANTICS[kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tables:
    """Per-kind facts as tuples indexed by ``kind.code`` (list indexing is what hot loops can afford)."""

    kinds: tuple[ActionKind, ...]
    """Kind of each code."""
    units: tuple[int, ...]
    """Program-order activation units (:attr:`KindSemantics.units`)."""
    hosted: tuple[bool, ...]
    """Whether the units are a partner's (hosted) rather than the rank's own."""
    compute: tuple[bool, ...]
    backward: tuple[bool, ...]
    message: tuple[bool, ...]
    """A send or receive with a peer rank (host moves excluded)."""
    sends: tuple[bool, ...]
    peer_code: tuple[int, ...]
    """Code of the peer kind (-1 for computes)."""
    channel: tuple[int, ...]
    sender_stage_shift: tuple[int, ...]
    neighbour_shift: tuple[int | None, ...]
    derived: tuple[bool, ...]
    away: tuple[int, ...]
    """+1: the activations go away (EVICT, OFFLOAD); -1: they come back (LOAD, RELOAD); 0 otherwise."""


def _compile() -> Tables:
    recs = [SEMANTICS[k] for k in ActionKind]
    assert [k.code for k in ActionKind] == list(range(len(recs)))
    away = {MemoryEffect.SEND_AWAY: 1, MemoryEffect.BRING_BACK: -1}
    return Tables(
        kinds=tuple(r.kind for r in recs), units=tuple(r.units for r in recs),
        hosted=tuple(r.memory in (MemoryEffect.HOST, MemoryEffect.UNHOST) for r in recs),
        compute=tuple(r.is_compute for r in recs), backward=tuple(r.backward for r in recs),
        message=tuple(r.is_message and not r.host_side for r in recs), sends=tuple(r.sends for r in recs),
        peer_code=tuple(r.peer_kind.code if r.peer_kind is not None else -1 for r in recs),
        channel=tuple(r.channel if r.channel is not None else -1 for r in recs),
        sender_stage_shift=tuple(r.sender_stage_shift for r in recs),
        neighbour_shift=tuple(r.neighbour_shift for r in recs), derived=tuple(r.derived for r in recs),
        away=tuple(away.get(r.memory, 0) for r in recs))


TABLES = _compile()
"""The compiled integer tables."""

COVERAGE: dict[str, tuple[frozenset[ActionKind], frozenset[ActionKind]]] = {}
"""Consumer name -> (kinds it handles, kinds it explicitly refuses), filled by :func:`kind_table`."""

T = TypeVar("T")


def kind_table(consumer: str, handled: Mapping[ActionKind, T], refused: Iterable[ActionKind] = ()
               ) -> tuple[T | None, ...]:
    """``handled`` as a tuple indexed by ``kind.code`` (``None`` for refused kinds); registers ``consumer``.

    Raises ``AssertionError`` (at import time of the consumer) when a kind is neither handled nor refused, or
    both: adding a kind to the IR then fails loudly everywhere it is not yet understood.
    """
    refused_set = frozenset(refused)
    both = refused_set & set(handled)
    missing = set(ActionKind) - set(handled) - refused_set
    assert not both and not missing, (f"{consumer}: kinds handled and refused {sorted(k.name for k in both)}, "
                                      f"neither {sorted(k.name for k in missing)}")
    COVERAGE[consumer] = (frozenset(handled), refused_set)
    return tuple(handled.get(k) for k in ActionKind)
