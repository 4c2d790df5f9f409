"""Derive every transfer action from the compute order, in an order that cannot deadlock.

Messages
--------
``F(s, m)`` feeds ``F(s+1, m)``: when the two stages live on different ranks the producer gets
``SEND_F(s, m, peer=rank(s+1))`` and the consumer ``RECV_F(s+1, m, peer=rank(s))``. The ``B``/``I`` of
``(s+1, m)`` feeds the backward of ``(s, m)``: ``SEND_B(s+1, m, peer=rank(s))`` / ``RECV_B(s, m, peer=rank(s+1))``.
BPipe markers already in the input are kept on the evictor and matched on the partner: ``EVICT`` gets an
``ACCEPT``, ``LOAD`` gets a ``RETURN``. Every other transfer in the input is dropped and derived again, so the
function is idempotent.

Ordering and why it cannot deadlock
-----------------------------------
1. Run a *witness* simulation of the compute lists (:mod:`evenpipe.schedule.witness`): fixed positive durations,
   buffered messages, zero transfer time. Message ``k`` gets a time ``t_k``: the finish of its producing compute,
   or, for BPipe messages, the start of the first compute after the evictor's ``EVICT``/``LOAD`` marker.
2. Number all messages globally by ``(t_k, class, evictor-or-sender rank, list position)`` (class 0 for
   activations and gradients, 1 for BPipe), giving index ``k``.
3. Give every event a sort key: a compute starting at ``t`` gets ``(t, 1, position)``; both the send and the
   receive of message ``k`` get ``(t_k, 0, k)``. Sort each rank's events by key.
4. Post BPipe receives early: on an acceptor, an ``ACCEPT`` whose time falls strictly inside one of its
   backwards (``B``/``I``/``W``, computes that allocate nothing) moves ahead of that backward, together with
   every message before it on that rank (in index order, so the rank's messages stay sorted). Otherwise the
   evictor's next forward, which waits for its eviction to land, would wait for the acceptor's backward to end
   before the eviction could even start: BPipe would be slower than 1F1B. Only receives and ``RETURN`` can
   have a time strictly inside a compute of their own rank (a send's time is its producer's finish; an
   ``EVICT``'s time is a compute start on its rank; a ``RETURN``'s data is its ``ACCEPT``, which comes earlier),
   so the move keeps (a)-(d) below. Only backwards are jumped: that is what the witness step time needs (an
   acceptor's forward is short), and the BPipe transform re-checks its budget in exactly this order.

Then on every rank (a) the communication events appear in increasing global index, so between any two ranks
sends and receives are posted in the same order (what FIFO point-to-point channels need); (b) a receive
precedes the compute that consumes it (``t_k <= start``, and the middle key 0 sorts before 1); (c) a send
follows the compute that produces it (that compute started before ``t_k``); (d) an ``EVICT``/``LOAD`` stays
between the same two computes as in the input, and a ``RETURN`` follows its ``ACCEPT`` (earlier time, or the
same time and an earlier marker). Now take any state of a run with **rendezvous** semantics (a send and its
receive complete together, only when both are at the heads of their ranks' lists) in which some rank is not
finished, and let ``k`` be the smallest index of a message not yet exchanged. On each of its two ranks, every
communication event before it has a smaller index, so it is done; every compute before it has its inputs
received earlier on the same rank (b) or produced earlier on the same rank, so it can run. Hence both sides of
``k`` reach their heads and ``k`` completes: the run always progresses, and more buffering (non-blocking
sends, receives posted early) only removes waits. BPipe's memory rules (a ``F``/``R`` or a ``LOAD``'s transfer
waits for the rank's earlier ``EVICT`` to land, an ``ACCEPT``'s transfer for its earlier ``RETURN``/``ACCEPT``)
wait only for messages of a smaller index on the same rank, which rendezvous has already completed, so they
keep the argument. The validator re-checks progress by a dry run.
"""

from __future__ import annotations

import bisect
import enum


from evenpipe.schedule.columns import Columns
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.semantics import SEMANTICS, TABLES, kind_table
from evenpipe.schedule.witness import WitnessTiming, witness_timing

__all__ = ["derive_communication", "derive_communication_actions"]

_K = ActionKind


class _Part(enum.Enum):
    """How the derivation treats a kind found in its input."""

    PRODUCER = "a compute whose output may cross to another rank"
    COMPUTE = "a compute that sends nothing"
    MARKER = "a memory move kept on the rank that decides it; its counterpart is derived on the peer"
    LOCAL = "a host move, kept right before the next compute"
    DERIVED = "dropped and derived again"


_PART = kind_table("communication", {k: (
    _Part.DERIVED if TABLES.derived[k.code] else
    _Part.LOCAL if SEMANTICS[k].host_side else
    _Part.MARKER if not TABLES.compute[k.code] else
    _Part.PRODUCER if k in (_K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT) else _Part.COMPUTE) for k in ActionKind})
_OUTPUT_MESSAGE = {_K.FORWARD.code: _K.SEND_F, _K.BACKWARD.code: _K.SEND_B, _K.BACKWARD_INPUT.code: _K.SEND_B}
"""What each producer sends when the neighbouring stage lives elsewhere (its output, or its input gradient)."""
_IS_COMPUTE = TABLES.compute
_FREEING = TABLES.backward
"""Computes that allocate nothing (backwards): an ``ACCEPT`` due while one runs is posted before it."""

_Message = tuple[tuple[int, int, int, int], int, Action, int, Action]
"""``(order key, sender rank, send action, receiver rank, receive action)``."""


def derive_communication(compute: Schedule) -> Schedule:
    """``compute`` plus all SEND/RECV (and BPipe ACCEPT/RETURN) actions, ordered so that it cannot deadlock.

    The input's compute actions, its ``EVICT``/``LOAD`` markers and any host ``OFFLOAD``/``RELOAD`` are kept in
    their order; other transfers are recomputed. Raises ``ScheduleValidationError`` if the compute order itself
    has a cyclic wait. Works on the integer columns (:mod:`evenpipe.schedule.columns`) and returns a schedule in
    that form; :func:`derive_communication_actions` is the same derivation over ``Action`` objects, the reference
    the golden tests compare it with.
    """
    cols = compute.columns
    derived = TABLES.derived
    if any(derived[c] for ks in cols.kinds for c in set(ks)):
        keep = [[i for i, c in enumerate(ks) if not derived[c]] for ks in cols.kinds]
        cols = Columns(*(tuple(list(map(col.__getitem__, idx)) for col, idx in zip(table, keep))
                         for table in (cols.kinds, cols.stages, cols.microbatches, cols.peers)))
        compute = compute.with_columns(cols)
    timing = witness_timing(compute)
    comm = _comm_columns(compute, timing)
    return compute.with_columns(Columns(*zip(*(_merge_columns(cols, r, timing, comm[r])
                                               for r in range(compute.num_ranks)))))


def derive_communication_actions(compute: Schedule) -> Schedule:
    """The reference of :func:`derive_communication`: the same result, derived over ``Action`` objects."""
    kept = compute.with_actions([[a for a in acts if _PART[a.kind.code] is not _Part.DERIVED]
                                 for acts in compute.actions])
    timing = witness_timing(kept)
    messages = _messages(kept, timing)
    messages.sort(key=lambda msg: msg[0])
    comm: list[list[tuple[int, Action]]] = [[] for _ in range(kept.num_ranks)]
    for (t, _, _, _), src, send, dst, recv in messages:  # global index order
        comm[src].append((t, send))
        comm[dst].append((t, recv))
    return kept.with_actions([_merge(acts, timing.start[r], timing.finish[r], comm[r])
                              for r, acts in enumerate(kept.actions)])


def _merge(acts: tuple[Action, ...], starts: tuple[int, ...], finishes: tuple[int, ...],
           comm: list[tuple[int, Action]]) -> list[Action]:
    """Merge a rank's computes (key ``(start, 1)``) with its messages (key ``(t_k, 0, k)``, already sorted),
    then post an ``ACCEPT`` due while a backward runs (and the messages before it) ahead of that backward."""
    out: list[Action] = []
    local: list[Action] = []  # OFFLOAD/RELOAD: kept right before the next compute, as in the input
    j, n = 0, len(comm)
    accepts = any(a.kind is _K.ACCEPT for _, a in comm)
    for i, a in enumerate(acts):
        code = a.kind.code
        if not _IS_COMPUTE[code]:
            if _PART[code] is _Part.LOCAL:
                local.append(a)
            continue  # EVICT/LOAD markers come back through ``comm``
        start = starts[i]
        while j < n and comm[j][0] <= start:
            out.append(comm[j][1])
            j += 1
        if accepts and _FREEING[code]:
            last, finish = j, finishes[i]
            for k in range(j, n):
                if comm[k][0] >= finish:
                    break
                if comm[k][1].kind is _K.ACCEPT:
                    last = k + 1
            out.extend(m for _, m in comm[j:last])
            j = last
        out.extend(local)
        local.clear()
        out.append(a)
    out.extend(a for _, a in comm[j:])
    return out + local


def _anchor_time(timing: WitnessTiming, acts: tuple[Action, ...], rank: int, i: int) -> int:
    """When the evictor reaches position ``i``: the start of the next compute (or the end of its work)."""
    starts = timing.start[rank]
    for j in range(i + 1, len(acts)):
        if starts[j] >= 0:
            return starts[j]
    return max(timing.finish[rank], default=0)


def _messages(kept: Schedule, timing: WitnessTiming) -> list[_Message]:
    S, layout = kept.num_stages, kept.stage_to_rank
    out: list[_Message] = []
    for r, acts in enumerate(kept.actions):
        finish = timing.finish[r]
        for i, a in enumerate(acts):
            code, s, m = a.kind.code, a.stage, a.microbatch
            part = _PART[code]
            if part is _Part.PRODUCER:
                send_kind = _OUTPUT_MESSAGE[code]
                send = SEMANTICS[send_kind]
                assert send.neighbour_shift is not None and send.peer_kind is not None
                t = s + send.neighbour_shift
                if 0 <= t < S and layout[t] != r:
                    dst = layout[t]
                    out.append(((finish[i], 0, r, i), r, Action(send_kind, s, m, dst),
                                dst, Action(send.peer_kind, t, m, r)))
            elif part is _Part.MARKER:
                peer, other = a.peer, SEMANTICS[a.kind].peer_kind
                assert peer is not None and other is not None
                key = (_anchor_time(timing, acts, r, i), 1, r, i)
                if TABLES.sends[code]:  # EVICT: this rank sends, the partner accepts
                    out.append((key, r, a, peer, Action(other, s, m, r)))
                else:  # LOAD: the partner returns, this rank receives
                    out.append((key, peer, Action(other, s, m, r), r, a))
    return out


# -- the same derivation over integer columns ------------------------------------------------------------------
_CF, _CB, _CI = _K.FORWARD.code, _K.BACKWARD.code, _K.BACKWARD_INPUT.code
_C_ACCEPT, _C_EVICT = _K.ACCEPT.code, _K.EVICT.code
_PART_OF_CODE = _PART
_SEND_OF: dict[int, tuple[int, int, int]] = {
    code: (kind.code, SEMANTICS[kind].neighbour_shift, SEMANTICS[kind].peer_kind.code)  # type: ignore[misc,union-attr]
    for code, kind in _OUTPUT_MESSAGE.items()}
"""Producer code -> (its send's code, offset of the stage it feeds, the receive's code)."""
_MARKER_PEER = {k.code: SEMANTICS[k].peer_kind.code for k in ActionKind  # type: ignore[union-attr]
                if _PART[k.code] is _Part.MARKER}
"""EVICT/LOAD code -> the code of the action derived on the partner (ACCEPT/RETURN)."""

_CommRow = tuple[list[int], list[int], list[int], list[int], list[int]]
"""One rank's messages in global index order: (time, kind code, stage, micro-batch, peer) as parallel lists."""


def _comm_columns(kept: Schedule, timing: WitnessTiming) -> list[_CommRow]:
    """Every message of ``kept`` (as :func:`_messages` finds them), numbered globally and split per rank."""
    P, S, layout = kept.num_ranks, kept.num_stages, kept.stage_to_rank
    cols = kept.columns
    keys: list[int] = []
    # per message: time, src, send code, send stage, dst, receive code, receive stage, micro-batch
    rows: list[tuple[int, int, int, int, int, int, int, int]] = []
    part, send_of, marker_peer = _PART_OF_CODE, _SEND_OF, _MARKER_PEER
    producer, marker = _Part.PRODUCER, _Part.MARKER
    for r in range(P):
        ks, ss, ms, ps, finish = cols.kinds[r], cols.stages[r], cols.microbatches[r], cols.peers[r], timing.finish[r]
        for i, code in enumerate(ks):
            what = part[code]
            if what is producer:
                send_code, shift, recv_code = send_of[code]
                s = ss[i]
                t = s + shift
                if 0 <= t < S and layout[t] != r:
                    keys.append(((finish[i] * 2 * P + r) << 32) | i)
                    rows.append((finish[i], r, send_code, s, layout[t], recv_code, t, ms[i]))
            elif what is marker:
                anchor = _anchor_time_columns(timing, r, i)
                keys.append((((anchor * 2 + 1) * P + r) << 32) | i)
                if code == _C_EVICT:  # this rank sends, the partner accepts
                    rows.append((anchor, r, code, ss[i], ps[i], marker_peer[code], ss[i], ms[i]))
                else:  # LOAD: the partner returns, this rank receives
                    rows.append((anchor, ps[i], marker_peer[code], ss[i], r, code, ss[i], ms[i]))
    comm: list[_CommRow] = [([], [], [], [], []) for _ in range(P)]
    for k in sorted(range(len(keys)), key=keys.__getitem__):  # global index order
        t, src, send_code, send_stage, dst, recv_code, recv_stage, mb = rows[k]
        for rank, code, stage, peer in ((src, send_code, send_stage, dst), (dst, recv_code, recv_stage, src)):
            times, codes, stages, mbs, peers = comm[rank]
            times.append(t)
            codes.append(code)
            stages.append(stage)
            mbs.append(mb)
            peers.append(peer)
    return comm


def _anchor_time_columns(timing: WitnessTiming, rank: int, i: int) -> int:
    """:func:`_anchor_time` by position."""
    starts = timing.start[rank]
    for j in range(i + 1, len(starts)):
        if starts[j] >= 0:
            return starts[j]
    return max(timing.finish[rank], default=0)


def _merge_columns(cols: Columns, r: int, timing: WitnessTiming, comm: _CommRow
                   ) -> tuple[list[int], list[int], list[int], list[int]]:
    """:func:`_merge` as one stable sort: a message at time ``t`` sorts by ``2t`` (before a compute starting at
    ``t``), a compute starting at ``t`` by ``2t + 1``, a host move with the compute after it (after all when none
    follows); an ``ACCEPT`` due inside a backward takes that backward's key, with the messages before it."""
    ks, ss, ms, ps = cols.kinds[r], cols.stages[r], cols.microbatches[r], cols.peers[r]
    starts, finishes = timing.start[r], timing.finish[r]
    ct, ck, cs, cm, cp = comm
    n_comm = len(ct)
    keys = [2 * t for t in ct]
    if _C_ACCEPT in ck:
        compute_at = [i for i, st in enumerate(starts) if st >= 0]
        compute_starts = [starts[i] for i in compute_at]
        for k, code in enumerate(ck):
            if code != _C_ACCEPT:
                continue
            t = ct[k]
            j = bisect.bisect_left(compute_starts, t) - 1  # the compute that started last before t
            if j < 0:
                continue
            i = compute_at[j]
            if _FREEING[ks[i]] and t < finishes[i]:
                first = bisect.bisect_right(ct, starts[i])
                for q in range(first, k + 1):
                    keys[q] = 2 * starts[i]
    src: list[int] = list(range(-1, -n_comm - 1, -1))  # -1 - k: message k; i >= 0: the rank's action i
    part, local, marker = _PART_OF_CODE, _Part.LOCAL, _Part.MARKER
    last_key = 2 * max(max(finishes, default=0), max(ct, default=0)) + 2
    pending: list[int] = []
    for i, code in enumerate(ks):
        st = starts[i]
        if st >= 0:
            key = 2 * st + 1
            for q in pending:
                keys.append(key)
                src.append(q)
            pending.clear()
            keys.append(key)
            src.append(i)
        elif part[code] is local:
            pending.append(i)
        else:
            assert part[code] is marker, "only computes, markers and host moves remain"
    for q in pending:
        keys.append(last_key)
        src.append(q)
    order = [src[j] for j in sorted(range(len(keys)), key=keys.__getitem__)]
    return ([ck[-1 - x] if x < 0 else ks[x] for x in order], [cs[-1 - x] if x < 0 else ss[x] for x in order],
            [cm[-1 - x] if x < 0 else ms[x] for x in order], [cp[-1 - x] if x < 0 else ps[x] for x in order])
