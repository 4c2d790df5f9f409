"""The simulator's rule table: what each action kind means to an evaluator, compiled once from
:data:`~evenpipe.schedule.semantics.SEMANTICS`.

Every evaluator (:mod:`~evenpipe.sim.engine`, :mod:`~evenpipe.sim.fast`, :mod:`~evenpipe.sim.free`,
:mod:`~evenpipe.sim.links`) reads these tuples, indexed by ``kind.code``, instead of keeping its own; hot loops
bind them to locals. Vocabulary:

- **event code**: how an evaluator treats an action: a compute (``F``, ``B``, ``I``, ``W``, ``R``: its kind code),
  a send (``SEND``, or ``SEND_FREES`` when the sender's copy is freed on arrival) or a receive (``RECV``, or
  ``RECV_ALLOC`` when the receiver allocates as the transfer starts). Computes < ``SEND`` <= sends < ``RECV`` <=
  receives, so one comparison tells them apart.
- **message slot** (the one-pass evaluators): a message is named by the (stage, micro-batch) ``u`` that consumes
  it and its channel (0: the input activation, 1: the output gradient).
"""

from __future__ import annotations

from evenpipe.schedule.ir import ActionKind
from evenpipe.schedule.semantics import SEMANTICS, TABLES, Role, kind_table

__all__ = [
    "HOST", "F", "B", "I", "W", "R", "SEND", "SEND_FREES", "RECV", "RECV_ALLOC", "EVENT", "PEER", "RECV_SHIFT",
    "SENDER_SHIFT", "CHANNEL", "HOST_SIDE", "FREES", "ALLOCS", "IS_COMPUTE", "KINDS", "PLAIN", "PEER_ONLY",
    "FIRST_TRANSFER", "FIRST_MOVE", "BRINGS_BACK",
    "KF", "KB", "KI", "KW", "KR", "KSEND_F", "KRECV_F", "KSEND_B", "KRECV_B", "KEVICT", "KACCEPT", "KRETURN",
    "KLOAD", "KOFFLOAD", "KRELOAD",
]

_K = ActionKind
HOST = -1
"""Pseudo-rank standing for host memory in link keys."""

(KF, KB, KI, KW, KR, KSEND_F, KRECV_F, KSEND_B, KRECV_B, KEVICT, KACCEPT, KRETURN, KLOAD, KOFFLOAD,
 KRELOAD) = (k.code for k in (_K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT, _K.RECOMPUTE,
                              _K.SEND_F, _K.RECV_F, _K.SEND_B, _K.RECV_B, _K.EVICT, _K.ACCEPT, _K.RETURN, _K.LOAD,
                              _K.OFFLOAD, _K.RELOAD))
"""Kind codes."""

F, B, I, W, R, SEND, SEND_FREES, RECV, RECV_ALLOC = range(9)
"""Event codes; a compute's is its kind's code."""
assert [KF, KB, KI, KW, KR] == [F, B, I, W, R], "computes come first in ActionKind"


def _event_code(k: ActionKind) -> int:
    sem = SEMANTICS[k]
    if sem.is_compute:
        return k.code
    if sem.sends:
        return SEND_FREES if sem.frees_on_arrival else SEND
    return RECV_ALLOC if sem.allocates_on_start else RECV


EVENT: tuple[int, ...] = tuple(c for c in kind_table("simulator", {k: _event_code(k) for k in ActionKind})
                               if c is not None)
"""Kind code -> event code (every kind is handled)."""
assert len(EVENT) == len(ActionKind)
KINDS = TABLES.kinds
"""Kind code -> kind."""
PEER = TABLES.peer_code
"""Kind code -> code of the kind on the other side of the message."""
SENDER_SHIFT = TABLES.sender_stage_shift
"""Kind code -> offset from the action's stage to the stage that sends its message."""
RECV_SHIFT = tuple(-TABLES.sender_stage_shift[p] if p >= 0 else 0 for p in TABLES.peer_code)
"""Send kind code -> stage offset of its receive (SEND_F feeds stage s+1, SEND_B feeds s-1, BPipe keeps s)."""
CHANNEL = TABLES.channel
"""Kind code -> message channel (0 activations, 1 gradients, then BPipe and host moves; -1 for computes)."""
HOST_SIDE = tuple(SEMANTICS[k].host_side for k in ActionKind)
"""Kind code -> whether the other side is the rank's host memory."""
FREES = tuple(SEMANTICS[k].frees_on_arrival for k in ActionKind)
"""Transfer kind code -> whether arrival frees the sender's copy."""
ALLOCS = tuple((SEMANTICS[k].sends and not SEMANTICS[k].host_side
                and SEMANTICS[SEMANTICS[k].peer_kind or k].allocates_on_start)
               or (SEMANTICS[k].host_side and not SEMANTICS[k].sends and SEMANTICS[k].allocates_on_start)
               for k in ActionKind)
"""Transfer kind code (a peer message is named by its send, a host move by itself) -> whether its start
allocates on the receiving rank."""
IS_COMPUTE = TABLES.compute
"""Kind code -> whether it is a compute."""
BRINGS_BACK = tuple(TABLES.away[c] < 0 or (p >= 0 and TABLES.away[p] < 0) for c, p in enumerate(TABLES.peer_code))
"""Kind code -> whether its message brings saved activations back (``RETURN``/``LOAD``, ``OFFLOAD``/``RELOAD``'s
second half), as opposed to sending them away; a one-pass evaluator's slot parity of a move."""

PLAIN = frozenset(k.code for k in ActionKind if SEMANTICS[k].role in (Role.COMPUTE, Role.TRANSFER))
"""Codes of computes and stage-to-stage messages (what the instant-link evaluator takes)."""
PEER_ONLY = frozenset(k.code for k in ActionKind if not SEMANTICS[k].host_side)
"""Codes of every kind but host moves (what the one-pass link evaluator takes)."""

_ROLE_ORDER = [SEMANTICS[k].role for k in ActionKind]
FIRST_TRANSFER = _ROLE_ORDER.index(Role.TRANSFER)
"""Kind codes from here on are not computes."""
FIRST_MOVE = _ROLE_ORDER.index(Role.MEMORY_MOVE)
"""Kind codes from here on are memory moves: a one-pass evaluator tells computes, transfers and moves apart by
comparing codes with these two."""
assert _ROLE_ORDER == sorted(_ROLE_ORDER, key=[Role.COMPUTE, Role.TRANSFER, Role.MEMORY_MOVE].index), \
    "kinds are ordered by role"
assert [KSEND_F, KRECV_F, KSEND_B, KRECV_B] == list(range(FIRST_TRANSFER, FIRST_MOVE))
assert {CHANNEL[KSEND_F], CHANNEL[KSEND_B]} == {0, 1} and CHANNEL[KSEND_F] == CHANNEL[KRECV_F] == 0
