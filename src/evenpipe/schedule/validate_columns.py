"""The validator's rules decided over the integer columns, whole arrays at a time (the fast path of
:func:`evenpipe.schedule.validate.validate`).

:func:`columns_valid` answers ``True`` only when every rule of :mod:`evenpipe.schedule.validate` except the
deadlock dry run holds, and then returns what the dry run needs; on any doubt it answers ``None`` and the
action-by-action scan (the reference, which also words every error) decides. So a schedule is accepted exactly
when the reference accepts it. The checks, per ``u = stage * M + mb``:

- positions: ``pos[kind][u]`` is ``rank << 32 | index`` of the action (-1 if absent); an action seen twice
  leaves fewer filled entries than actions of its kind (``duplicate``);
- ``range`` and ``placement`` from per-rank minima/maxima and ``stage_to_rank`` counts; the peers of
  neighbour transfers must be the neighbouring stage's rank, those of memory moves another rank;
- ``completeness`` by counting absent entries; ``dependency`` as ``pos[required][v] < pos[kind][u]`` over whole
  stages (an action and what it requires live on one rank, the placement rule makes sure of it, except
  ``ACCEPT``/``RETURN``, whose rank is compared too); evicted or offloaded activations by a small walk over the
  few micro-batches that have any;
- ``matching``: a send exists exactly where its receive does, on the rank its peer names.
"""

from __future__ import annotations

from operator import lt
from typing import Sequence

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.semantics import SEMANTICS, TABLES, Requirement

__all__ = ["columns_valid"]

_K = ActionKind
_F, _B, _I, _W, _R = (k.code for k in (_K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT,
                                       _K.RECOMPUTE))
_SF, _RF, _SB, _RB = (k.code for k in (_K.SEND_F, _K.RECV_F, _K.SEND_B, _K.RECV_B))
_EV, _AC, _RET, _LD, _OF, _RL = (k.code for k in (_K.EVICT, _K.ACCEPT, _K.RETURN, _K.LOAD, _K.OFFLOAD,
                                                  _K.RELOAD))
_NUM_KINDS = len(ActionKind)
_ON_PEER = frozenset(k.code for k in ActionKind if SEMANTICS[k].stage_on_peer)
_MESSAGE = TABLES.message
_NEIGHBOUR: dict[int, int] = {k.code: shift for k in ActionKind
                              if (shift := SEMANTICS[k].neighbour_shift) is not None}
_USERS = tuple(k.code for k in ActionKind if Requirement.ACTIVATIONS_HERE in SEMANTICS[k].requires)
"""Kinds that need the micro-batch's activations on the rank."""
_LOW = (1 << 32) - 1
_KNOWN_REQUIREMENTS = {
    _F: (Requirement.INPUT,),
    _B: (Requirement.OWN_FORWARD, Requirement.RECOMPUTED, Requirement.OUTPUT_GRADIENT,
         Requirement.ACTIVATIONS_HERE),
    _I: (Requirement.OWN_FORWARD, Requirement.RECOMPUTED, Requirement.OUTPUT_GRADIENT,
         Requirement.ACTIVATIONS_HERE),
    _W: (Requirement.INPUT_GRADIENT, Requirement.ACTIVATIONS_HERE),
    _R: (Requirement.OWN_FORWARD, Requirement.ACTIVATIONS_HERE),
    _SF: (Requirement.OWN_FORWARD, Requirement.ACTIVATIONS_HERE), _RF: (),
    _SB: (Requirement.GRADIENT_PRODUCED,), _RB: (),
    _EV: (Requirement.OWN_FORWARD, Requirement.ACTIVATIONS_HERE), _AC: (),
    _RET: (Requirement.ACCEPTED,), _LD: (Requirement.EVICTED,),
    _OF: (Requirement.OWN_FORWARD, Requirement.ACTIVATIONS_HERE), _RL: (Requirement.OFFLOADED,),
}
assert all(SEMANTICS[k].requires == _KNOWN_REQUIREMENTS[k.code] for k in ActionKind), \
    "a kind's requirements changed: teach columns_valid the new ones"


def columns_valid(schedule: Schedule) -> list[list[int]] | None:
    """Per rank, the message key of each peer transfer (what the dry run compares) and its position, as
    ``keys[r]`` = [position, key, position, key, ...], when every rule but deadlock-freedom holds; else ``None``."""
    P, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    layout = schedule.stage_to_rank
    cols = schedule.columns
    NU = S * M
    counts = [0] * _NUM_KINDS
    pos: list[list[int] | None] = [None] * _NUM_KINDS
    peer: list[list[int] | None] = [None] * _NUM_KINDS
    us_all: list[list[int]] = []
    for r in range(P):
        ks, ss, ms, ps = cols.kinds[r], cols.stages[r], cols.microbatches[r], cols.peers[r]
        n = len(ks)
        if not n:
            us_all.append([])
            continue
        if min(ss) < 0 or max(ss) >= S or min(ms) < 0 or max(ms) >= M or max(ps) >= P or min(ps) < -1:
            return None  # range
        homes = list(map(layout.__getitem__, ss))
        kinds_here = set(ks)
        on_peer = [c for c in kinds_here if c in _ON_PEER]
        if homes.count(r) != n - sum(map(ks.count, on_peer)):
            return None  # placement (or an on-peer action on its own stage's rank)
        for c in kinds_here:
            counts[c] += ks.count(c)
            if pos[c] is None:
                pos[c] = [-1] * NU
                peer[c] = [-2] * NU  # only the transfers' are read
        us = [s * M + m for s, m in zip(ss, ms)]
        us_all.append(us)
        base = r << 32
        for c, u, p, q in zip(ks, us, range(base, base + n), ps):
            pos[c][u] = p  # type: ignore[index]
            peer[c][u] = q  # type: ignore[index]
        if on_peer and any(homes[i] != ps[i] or ps[i] == r for i, c in enumerate(ks) if c in _ON_PEER):
            return None  # placement of ACCEPT/RETURN: their stage lives on their peer
    for c in range(_NUM_KINDS):
        arr = pos[c]
        if arr is not None and NU - arr.count(-1) != counts[c]:
            return None  # duplicate
    if not _complete(pos, NU):
        return None
    if not (_peers_ok(pos, peer, layout, M) and _dependencies_ok(pos, layout, M) and _away_ok(pos, M)
            and _matching_ok(pos, peer, layout, M)):
        return None
    return _message_keys(cols.kinds, us_all, S, M)


def _get(pos: list[list[int] | None], code: int, NU: int) -> list[int]:
    arr = pos[code]
    return arr if arr is not None else [-1] * NU


def _complete(pos: list[list[int] | None], NU: int) -> bool:
    """Every (stage, mb) has one F and either one B or one I and one W."""
    f = pos[_F]
    if f is None or -1 in f:
        return False
    b, i, w = pos[_B], pos[_I], pos[_W]
    if i is None and w is None:
        return b is not None and -1 not in b
    if b is None:
        return i is not None and w is not None and -1 not in i and -1 not in w
    assert i is not None or w is not None
    ii, ww = _get(pos, _I, NU), _get(pos, _W, NU)
    return all((bu >= 0) != (iu >= 0) and (iu >= 0) == (wu >= 0) for bu, iu, wu in zip(b, ii, ww))


def _before(req: Sequence[int], act: Sequence[int], present: bool) -> bool:
    """Wherever ``act`` has an action, ``req`` has one earlier on the same rank (``present``), or has none or one
    earlier (not ``present``: a conditional requirement). Both sides are known to be on one rank."""
    if -1 not in act:
        if present and -1 in req:
            return False
        return all(map(lt, req, act))
    return all((q >= 0 or not present) and q < a for q, a in zip(req, act) if a >= 0)


def _dependencies_ok(pos: list[list[int] | None], layout: tuple[int, ...], M: int) -> bool:
    S = len(layout)
    NU = S * M
    f = pos[_F]
    assert f is not None
    rf, rb = pos[_RF], pos[_RB]
    backwards = [c for c in (_B, _I) if pos[c] is not None]
    # the B or I of each (s, m): complete() made sure exactly one of them exists
    bi = pos[backwards[0]] if len(backwards) == 1 else \
        [x if x >= 0 else y for x, y in zip(pos[_B], pos[_I])]  # type: ignore[arg-type]
    assert bi is not None
    r_pos = pos[_R]
    for s in range(S):
        lo, hi = s * M, (s + 1) * M
        act_f = f[lo:hi]
        if s > 0:  # INPUT
            if layout[s - 1] == layout[s]:
                if not all(map(lt, f[lo - M:lo], act_f)):
                    return False
            elif rf is None or not _before(rf[lo:hi], act_f, True):
                return False
        for c in backwards:
            act = pos[c][lo:hi]  # type: ignore[index]
            if not _before(f[lo:hi], act, True):  # OWN_FORWARD
                return False
            if r_pos is not None and not _before(r_pos[lo:hi], act, False):  # RECOMPUTED
                return False
            if s + 1 < S:  # OUTPUT_GRADIENT
                if layout[s + 1] == layout[s]:
                    if not _before(bi[hi:hi + M], act, True):
                        return False
                elif rb is None or not _before(rb[lo:hi], act, True):
                    return False
    checks = [(_W, _I, True), (_R, _F, True), (_SF, _F, True), (_SB, -1, True), (_EV, _F, True),
              (_LD, _EV, True), (_RL, _OF, True), (_OF, _F, True)]
    for code, required, present in checks:
        act_all = pos[code]
        if act_all is None:
            continue
        req_all = bi if required < 0 else pos[required]
        if req_all is None or not _before(req_all, act_all, present):
            return False
    ret = pos[_RET]
    if ret is not None:  # ACCEPTED: the ACCEPT on the same rank, earlier
        acc = _get(pos, _AC, NU)
        if not all(a >= 0 and (a >> 32) == (x >> 32) and a < x for a, x in zip(acc, ret) if x >= 0):
            return False
    return True


def _away_ok(pos: list[list[int] | None], M: int) -> bool:
    """No action that needs a micro-batch's activations runs while they are evicted or offloaded (the walk of
    the reference, over the few (stage, mb) that ever leave; every such action lives on the stage's rank)."""
    leaving = [u for c in (_EV, _OF) if pos[c] is not None
               for u, p in enumerate(pos[c]) if p >= 0]  # type: ignore[arg-type]
    if not leaving:
        return True
    users = [pos[c] for c in _USERS if pos[c] is not None]
    moves = [(pos[c], d) for c, d in ((_EV, 1), (_OF, 1), (_LD, -1), (_RL, -1)) if pos[c] is not None]
    for u in set(leaving):
        events = sorted((arr[u], d) for arr, d in moves if arr[u] >= 0)  # type: ignore[index]
        uses = sorted(arr[u] for arr in users if arr[u] >= 0)  # type: ignore[index]
        away, j = 0, 0
        for p in uses:
            while j < len(events) and events[j][0] < p:
                away = 1 if events[j][1] > 0 else 0
                j += 1
            if away:
                return False
    return True


def _peers_ok(pos: list[list[int] | None], peer: list[list[int] | None], layout: tuple[int, ...], M: int) -> bool:
    """Neighbour transfers name the neighbouring stage's rank (never their own); memory moves another rank."""
    S = len(layout)
    for code, shift in _NEIGHBOUR.items():
        pc = peer[code]
        if pc is None:
            continue
        for s in range(S):
            present = M - pos[code][s * M:(s + 1) * M].count(-1)  # type: ignore[index]
            if not present:
                continue
            t = s + shift
            if not 0 <= t < S or layout[t] == layout[s] or pc[s * M:(s + 1) * M].count(layout[t]) != present:
                return False
    for code in (_EV, _LD):
        pc = peer[code]
        if pc is not None and any(p != -2 and (p < 0 or p == layout[u // M]) for u, p in enumerate(pc)):
            return False
    return True


def _matching_ok(pos: list[list[int] | None], peer: list[list[int] | None], layout: tuple[int, ...],
                 M: int) -> bool:
    """Every message has both ends: SEND_F(s) with RECV_F(s+1), SEND_B(s) with RECV_B(s-1) (their peers are
    already the neighbours' ranks), EVICT with ACCEPT and RETURN with LOAD on the ranks their peers name."""
    NU = len(layout) * M
    for send, recv, shift in ((_SF, _RF, 1), (_SB, _RB, -1)):
        a, b = pos[send], pos[recv]
        if a is None and b is None:
            continue
        a, b = _get(pos, send, NU), _get(pos, recv, NU)
        # a[u] pairs with b[u + shift*M]; outside the array there is nothing
        if shift > 0:
            sa, sb = a[:NU - M], b[M:]
            edge_a, edge_b = a[NU - M:], b[:M]
        else:
            sa, sb = a[M:], b[:NU - M]
            edge_a, edge_b = a[:M], b[NU - M:]
        if edge_a.count(-1) != M or edge_b.count(-1) != M:
            return False
        if [x < 0 for x in sa] != [y < 0 for y in sb]:
            return False
    for send, recv, by_send in ((_EV, _AC, True), (_RET, _LD, False)):
        a, b = pos[send], pos[recv]
        if a is None and b is None:
            continue
        a, b = _get(pos, send, NU), _get(pos, recv, NU)
        named = peer[send] if by_send else peer[recv]
        other_side = b if by_send else a
        for u in range(NU):
            if (a[u] >= 0) != (b[u] >= 0):
                return False
            if a[u] >= 0:
                # EVICT names the acceptor (the ACCEPT's rank); LOAD names the returner (the RETURN's rank);
                # ACCEPT/RETURN name the stage's rank, which placement checked
                if named[u] != other_side[u] >> 32:  # type: ignore[index]
                    return False
    return True


def _message_keys(kinds: tuple[list[int], ...], us_all: list[list[int]], S: int, M: int) -> list[list[int]]:
    """Per rank, the peer transfers as [position, key, ...] with the key of
    :func:`evenpipe.schedule.validate.message_key` folded into one int."""
    offset = [((TABLES.channel[c] * S + TABLES.sender_stage_shift[c]) * M) if _MESSAGE[c] else 0
              for c in range(_NUM_KINDS)]
    out = []
    for ks, us in zip(kinds, us_all):
        out.append([x for i, c in enumerate(ks) if _MESSAGE[c] for x in (i, us[i] + offset[c])])
    return out

