"""The actions of the schedule IR: :class:`ActionKind`, :class:`Action` and its one-token text form.

An :class:`Action` is one step of one rank. Its text form is one token, ``{stage}{KIND}{microbatch}`` with an
optional ``@{peer}`` for transfers, e.g. ``0F3``, ``2I1``, ``1W0``, ``0SEND_F3@1``, ``0EVICT2@3``. The per-rank
lists of actions form a :class:`~evenpipe.schedule.ir.Schedule` (which re-exports every name here, the IR's
vocabulary); the integer form of the lists is :mod:`evenpipe.schedule.columns`, which builds on this module.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Iterable

from evenpipe.errors import ScheduleFormatError

__all__ = [
    "Action",
    "ActionKind",
    "COMPUTE_KINDS",
    "SEND_KINDS",
    "RECV_KINDS",
    "MATCHING_RECV",
    "parse_action",
    "count_kinds",
]


class ActionKind(enum.Enum):
    """What an action does. The value is its token in the text form."""

    FORWARD = "F"
    """Forward pass of one stage on one micro-batch; saves activations for backward."""
    BACKWARD = "B"
    """Full backward (input and weight gradients); frees the micro-batch's activations."""
    BACKWARD_INPUT = "I"
    """Input-gradient half of the backward (zero-bubble); keeps what the weight gradient needs."""
    BACKWARD_WEIGHT = "W"
    """Weight-gradient half of the backward; frees the rest of the activations."""
    RECOMPUTE = "R"
    """Re-run the forward from the stashed stage input to rebuild activations before a backward."""
    SEND_F = "SEND_F"
    """Send a stage's output activation to the rank of the next stage."""
    RECV_F = "RECV_F"
    """Receive the input activation of a stage from the rank of the previous stage."""
    SEND_B = "SEND_B"
    """Send the gradient of a stage's input to the rank of the previous stage."""
    RECV_B = "RECV_B"
    """Receive the gradient of a stage's output from the rank of the next stage."""
    EVICT = "EVICT"
    """BPipe evictor: send the micro-batch's saved activations to the partner rank and free them locally."""
    ACCEPT = "ACCEPT"
    """BPipe acceptor: receive and hold a partner's evicted activations."""
    RETURN = "RETURN"
    """BPipe acceptor: send held activations back to their owner and free them."""
    LOAD = "LOAD"
    """BPipe evictor: receive its evicted activations back before the backward."""
    OFFLOAD = "OFFLOAD"
    """Copy the micro-batch's saved activations to host memory and free device memory."""
    RELOAD = "RELOAD"
    """Copy offloaded activations back from host memory."""

    code: int
    """Small ordinal (declaration order), set below: index of this kind in the integer tables that
    :mod:`evenpipe.schedule.semantics` compiles for hot loops."""

    __hash__ = object.__hash__  # members are singletons: identity hashing is C-fast (Enum's hashes the name)

    @property
    def token(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self in RECV_KINDS

    @property
    def is_transfer(self) -> bool:
        return self in SEND_KINDS or self in RECV_KINDS


for _code, _kind in enumerate(ActionKind):
    _kind.code = _code
del _code, _kind

COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
     ActionKind.RECOMPUTE}
)
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.EVICT, ActionKind.RETURN})
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.ACCEPT, ActionKind.LOAD})

_COMPUTE_CODES = frozenset(k.code for k in COMPUTE_KINDS)

MATCHING_RECV: dict[ActionKind, ActionKind] = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.EVICT: ActionKind.ACCEPT,
    ActionKind.RETURN: ActionKind.LOAD,
}
"""Each send kind and the receive kind that completes it on the peer rank."""


@functools.cache
def _token_re() -> re.Pattern[str]:
    """The pattern of one action token, compiled on the first parse (plans and simulations never parse text)."""
    return re.compile(r"^(\d+)([A-Z_]+?)(\d+)(?:@(\d+))?$")


_KIND_BY_TOKEN = {k.value: k for k in ActionKind}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``; ``peer`` is the other rank of a transfer."""

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleFormatError(f"action {self.kind.name} has negative stage/microbatch "
                                      f"({self.stage}, {self.microbatch})")
        if self.kind.is_transfer and self.peer is None:
            raise ScheduleFormatError(f"transfer action {self.kind.name} needs a peer rank")

    def __str__(self) -> str:
        base = f"{self.stage}{self.kind.token}{self.microbatch}"
        return base if self.peer is None else f"{base}@{self.peer}"

    @property
    def key(self) -> tuple[int, int]:
        """(stage, microbatch): the unit of work this action belongs to."""
        return (self.stage, self.microbatch)


def parse_action(token: str) -> Action:
    """Parse one text token such as ``0F3`` or ``1SEND_F2@2``."""
    m = _token_re().match(token.strip())
    if not m or m.group(2) not in _KIND_BY_TOKEN:
        allowed = ", ".join(k.value for k in ActionKind)
        raise ScheduleFormatError(f"bad action token {token!r}: expected STAGE KIND MICROBATCH[@PEER] "
                                  f"with KIND one of {allowed}")
    peer = int(m.group(4)) if m.group(4) is not None else None
    return Action(_KIND_BY_TOKEN[m.group(2)], int(m.group(1)), int(m.group(3)), peer)


def count_kinds(actions: Iterable[Action]) -> dict[ActionKind, int]:
    out: dict[ActionKind, int] = {}
    for a in actions:
        out[a.kind] = out.get(a.kind, 0) + 1
    return out
