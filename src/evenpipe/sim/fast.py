"""The simulator's rules evaluated as a dataflow: no clock, no event heap, a schedule's shape compiled once.

Every time the event engine (:mod:`evenpipe.sim.engine`) computes is a max-plus expression of earlier times
(a compute starts at the latest of its rank becoming free, its inputs arriving and its gates landing; a
message starts at the latest of its send being reached, its receive posted and its data ready), with one
exception: the order in which a busy link serves the messages queued on it. So this module computes each time
as soon as the times it depends on are known, in any order, and serves every link in a static order (the
sending side's program order). That static order is the engine's FIFO order when the link's messages become
ready at increasing times along it, which is checked as each message starts; at equal times, when each send or
receive that made the earlier one ready has a later one on the same rank among those that made the next one ready
(a rank reaches its actions in program order: BPipe's EVICT right after a SEND_F to its neighbour); a link whose
messages all take no time never queues, in any order. The same holds for memory: each rank's changes are
recorded in causal order, so the bytes every change moves are the engine's; only changes recorded at equal times
by a transfer and a compute may come in another order, and the levels are then the engine's when the sums
are exact in floating point (checked: all deltas share a power-of-two denominator and add up to under 2^53).

:func:`simulate_fast` returns ``None`` whenever an assumption fails (a link served out of order, inexact
memory sums, a schedule the engine must reject or that deadlocks); the caller then runs the event engine, which
also produces every error message. The golden tests compare both engines trace for trace.

A schedule's compiled shape (message matching, each compute's inputs and gates: everything that does not depend
on the costs) is cached for the last few schedules simulated, so sweeps over costs pay for it once.
"""

from __future__ import annotations

from typing import Callable
from itertools import repeat

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.memo import ObjectMemo
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.kernel import (PARKED, CannotVouch, RunState, attempt, compute_memory, served_first, stage_tables,
                                 sums_exact, wait_or_park)
from evenpipe.sim.result import make_trace
from evenpipe.sim.rules import (ALLOCS, EVENT, FREES, HOST, HOST_SIDE, KACCEPT, KB, KEVICT, KF, KI, KINDS, KLOAD,
                                KOFFLOAD, KR, KRECV_B, KRECV_F, KRELOAD, KRETURN, KSEND_F, PEER, RECV, RECV_SHIFT,
                                SEND, R)
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["NAME", "applies", "run", "simulate_fast", "compile_shape", "Shape"]

NAME = "fast"
"""The evaluator's name in traces and in the dispatcher."""
_CACHE_SIZE = 4  # a shape of 4*10^5 actions holds tens of MB
_CACHE_ACTIONS = 1_000_000
"""Beyond ``_CACHE_SIZE`` shapes, more are kept while their schedules hold this many actions in all."""


class Shape:
    """What a schedule's simulation needs that does not depend on the costs. Signals are ints: transfer ids
    ``0..T-1`` (the message arrived), then compute completions and delayed (implicit-transfer) completions. A plain
    slotted class, as the run's other state (a dataclass costs every import of the simulator its generated
    methods)."""

    __slots__ = ("codes", "ops", "delay_specs", "recomputed", "num_signals", "x_src", "x_dst", "x_kind", "x_stage",
                 "x_mb", "x_send", "x_recv", "x_pending", "x_spec", "specs", "link_keys", "x_link", "link_order",
                 "x_linkpos", "gated", "data_waiters", "mixed")

    def __init__(self, *, codes: list[list[int]], ops: list[list[tuple]],  # type: ignore[type-arg]
                 delay_specs: list[tuple[int, int, int]], recomputed: frozenset[tuple[int, int]], num_signals: int,
                 x_src: list[int], x_dst: list[int], x_kind: list[ActionKind], x_stage: list[int], x_mb: list[int],
                 x_send: list[tuple[int, int] | None], x_recv: list[tuple[int, int] | None], x_pending: list[int],
                 x_spec: list[int], specs: list[tuple[int, int, int, bool]], link_keys: list[tuple[int, int]],
                 x_link: list[int], link_order: list[list[int]] | None, x_linkpos: list[int] | None,
                 gated: dict[int, list[int]], data_waiters: dict[int, list[int]], mixed: frozenset[int]) -> None:
        self.codes = codes
        """Per rank and action, the event code."""
        self.ops = ops
        """Per rank and action: ``(code, transfer id)`` for a send or receive; for a compute ``(code, duration index
        (code x stages + stage), stage, (stage, micro-batch), forward-bytes index (stage, + stages if recomputed),
        signals it waits for (its inputs, then the EVICT transfers gating it), transfers it consumes, extra or
        None)``, with extra ``(EVICT transfers it waits to land, signals it announces, (delayed signal, delay slot)
        pairs it announces)``."""
        self.delay_specs = delay_specs
        """Per delay slot, (src rank, dst rank, stage whose ``output_bytes`` move)."""
        self.recomputed = recomputed
        self.num_signals = num_signals
        # transfers, as parallel lists
        self.x_src = x_src
        self.x_dst = x_dst
        self.x_kind = x_kind
        self.x_stage = x_stage
        self.x_mb = x_mb
        self.x_send = x_send
        self.x_recv = x_recv
        self.x_pending = x_pending
        self.x_spec = x_spec
        """Per transfer, index into ``specs``."""
        self.specs = specs
        """(link id, 0 = stage output / 1 = saved activations moved, stage, recomputed)."""
        self.link_keys = link_keys
        self.x_link = x_link
        self.link_order = link_order
        """Per link id, its transfers in the order the link serves them when busy (built when first needed)."""
        self.x_linkpos = x_linkpos
        self.gated = gated
        """Transfer id -> transfers that may not start before it lands."""
        self.data_waiters = data_waiters
        """Signal -> transfers whose data it makes ready."""
        self.mixed = mixed
        """Ranks whose memory changes also come from transfers."""

    def serving_order(self) -> tuple[list[list[int]], list[int]]:
        """Per link its transfers in the sending side's program order, and each transfer's place there."""
        if self.link_order is None or self.x_linkpos is None:
            order: list[list[int]] = [[] for _ in self.link_keys]
            for tid, lid in enumerate(self.x_link):
                order[lid].append(tid)
            pos = [0] * len(self.x_link)
            send, recv = self.x_send, self.x_recv
            for tids in order:
                tids.sort(key=lambda t: send[t] or recv[t])  # type: ignore[arg-type,return-value]
                for k, tid in enumerate(tids):
                    pos[tid] = k
            self.link_order, self.x_linkpos = order, pos
        return self.link_order, self.x_linkpos


class _PeerColumns(RunState):
    """The peer-to-peer messages :meth:`_Compiler._match` numbers, as parallel lists in that order."""

    src: list[int]
    dst: list[int]
    kind: list[int]
    """The send's kind code."""
    stage: list[int]
    """The send's stage."""
    mb: list[int]
    moved: list[int]
    """0: a stage output; 1: saved activations (BPipe)."""
    bytes_stage: list[int]
    """The stage whose bytes the message carries."""
    send: list[tuple[int, int]]
    """(rank, index) of the send."""
    recv: list[tuple[int, int]]
    """(rank, index) of the receive."""


_cache: ObjectMemo[Shape] = ObjectMemo(_CACHE_SIZE, weight=lambda s: sum(map(len, s.columns.kinds)),
                                      budget=_CACHE_ACTIONS)


def compile_shape(schedule: Schedule) -> Shape:
    """The cost-independent part of a simulation (raises ``CannotVouch`` for schedules the engine must judge)."""
    return _cache.get(schedule, None, lambda: _Compiler(schedule).run())


class _RankState:
    """What :meth:`_Compiler._rank` has met so far on one rank (keys (stage, mb), or completion keys)."""

    __slots__ = ("done", "wanted", "away", "back", "accepted", "offloaded", "evicting", "returning")

    def __init__(self) -> None:
        self.done: dict[int, int] = {}
        """Completion key -> index of the compute producing it, produced so far."""
        self.wanted: dict[int, int] = {}
        """Completion key -> signal, for consumers met before their producer."""
        self.away: set[tuple[int, int]] = set()
        self.back: dict[tuple[int, int], int] = {}
        self.accepted: dict[tuple[int, int], int] = {}
        self.offloaded: dict[tuple[int, int], int] = {}
        self.evicting: list[int] = []
        self.returning: list[int] = []


class _Compiler:
    """The engine's preparation with integer signals, in two passes; any irregularity raises ``CannotVouch``."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        cols = schedule.columns  # the integer form: the passes below touch no Action object
        self.kcodes = cols.kinds
        self.codes = [list(map(EVENT.__getitem__, kc)) for kc in self.kcodes]
        self.stages = cols.stages
        self.mbs = cols.microbatches
        self.peers = cols.peers
        self.xfer_at = [[-1] * len(kc) for kc in self.kcodes]
        self.x_pending: list[int] = []
        self.gated: dict[int, list[int]] = {}
        self.data_waiters: dict[int, list[int]] = {}
        self.mixed: set[int] = set()

    def run(self) -> Shape:
        peers, hosts, recv_index = self._match()
        num_peers = len(peers.src)
        num_x = num_peers + len(hosts)
        for k, (r, i) in enumerate(hosts):
            self.xfer_at[r][i] = num_peers + k
        self.x_pending = [2] * num_peers + [1] * len(hosts)
        self.next_signal = num_x
        self.host_x: list[tuple[int, int, ActionKind, int, int]] = []
        self.delay_specs: list[tuple[int, int, int]] = []
        self.implicit: dict[int, tuple[int, int]] = {}  # producer key -> (delayed signal, slot)
        recomputed = frozenset((s, m) for codes, ss, ms in zip(self.codes, self.stages, self.mbs)
                               if R in codes for c, s, m in zip(codes, ss, ms) if c == R)
        self.recomputed = recomputed
        produced: list[dict[int, int]] = []
        ops_all = []
        for r in range(self.schedule.num_ranks):
            ops, done = self._rank(r, recv_index[r])
            ops_all.append(ops)
            produced.append(done)
        s2r = self.schedule.stage_to_rank
        for key, (sig, slot) in self.implicit.items():  # cross-rank consumers without a receive: rare
            q = s2r[key >> 33]
            at = produced[q].get(key)
            if at is None:
                raise CannotVouch
            op = ops_all[q][at]
            gate, announce, delayed = op[7] or ((), (), ())
            ops_all[q][at] = op[:7] + ((gate, announce, delayed + ((sig, slot),)),)
        kinds = KINDS
        if len(self.host_x) != len(hosts):
            raise CannotVouch
        host_rows = [(src, dst, kind, st, mb, (src, i) if dst == HOST else None, None if dst == HOST else (dst, i),
                      (src, dst), 1, st) for (src, dst, kind, st, mb), (_, i) in zip(self.host_x, hosts)]
        host_cols = list(zip(*host_rows)) if host_rows else [()] * 10
        cols = [peers.src + list(host_cols[0]), peers.dst + list(host_cols[1]),
                list(map(kinds.__getitem__, peers.kind)) + list(host_cols[2]), peers.stage + list(host_cols[3]),
                peers.mb + list(host_cols[4]), peers.send + list(host_cols[5]), peers.recv + list(host_cols[6]),
                list(zip(peers.src, peers.dst)) + list(host_cols[7]), peers.moved + list(host_cols[8]),
                peers.bytes_stage + list(host_cols[9])]
        link_ids: dict[tuple[int, int], int] = {}
        x_link = [link_ids.setdefault(key, len(link_ids)) for key in cols[7]]
        spec_ids: dict[tuple[int, int, int, bool], int] = {}
        x_spec = [spec_ids.setdefault((lid, moved, bst, moved == 1 and (bst, mb) in recomputed), len(spec_ids))
                  for lid, moved, bst, mb in zip(x_link, cols[8], cols[9], cols[4])]
        return Shape(codes=self.codes, ops=ops_all, delay_specs=self.delay_specs, recomputed=recomputed,
                     num_signals=self.next_signal, x_src=list(cols[0]), x_dst=list(cols[1]), x_kind=list(cols[2]),
                     x_stage=list(cols[3]), x_mb=list(cols[4]), x_send=list(cols[5]), x_recv=list(cols[6]),
                     x_pending=self.x_pending, x_spec=x_spec, specs=list(spec_ids), link_keys=list(link_ids),
                     x_link=x_link, link_order=None, x_linkpos=None, gated=self.gated,
                     data_waiters=self.data_waiters, mixed=frozenset(self.mixed))

    def _match(self) -> tuple["_PeerColumns", list[tuple[int, int]], list[dict[tuple[int, int, int], int]]]:
        """Pair every send with its receive, numbering the messages in the engine's order (when the later side
        is met, ranks in order); host moves are numbered after them, in rank and program order."""
        codes_all, kcodes, xfer_at = self.codes, self.kcodes, self.xfer_at
        match, shift, host_side = PEER, RECV_SHIFT, HOST_SIDE
        send_keys: list[tuple[int, int, int, int, int]] = []
        recv_keys: list[tuple[int, int, int, int, int]] = []
        send_at: list[int] = []  # positions as rank * 2^32 + index: ints compare fast
        recv_at: list[int] = []
        hosts: list[tuple[int, int]] = []
        recv_index: list[dict[tuple[int, int, int], int]] = []
        for r in range(self.schedule.num_ranks):
            codes, kc_r, st_r, mb_r = codes_all[r], kcodes[r], self.stages[r], self.mbs[r]
            moves = [i for i, c in enumerate(codes) if c >= SEND]
            peer_of = dict(zip(moves, map(self.peers[r].__getitem__, moves)))
            hosts += [(r, i) for i in moves if host_side[kc_r[i]]]
            sends = [i for i in moves if codes[i] < RECV and not host_side[kc_r[i]]]
            recvs = [i for i in moves if codes[i] >= RECV and not host_side[kc_r[i]]]
            base = r << 32
            send_keys += [(r, peer_of[i], match[kc_r[i]], st_r[i] + shift[kc_r[i]], mb_r[i]) for i in sends]
            send_at += [base + i for i in sends]
            index_keys = [(kc_r[i], st_r[i], mb_r[i]) for i in recvs]
            recv_keys += [(peer_of[i], r) + k for i, k in zip(recvs, index_keys)]
            recv_at += [base + i for i in recvs]
            recv_index.append(dict(zip(index_keys, recvs)))
        recv_of = dict(zip(recv_keys, range(len(recv_keys))))
        partner = list(map(recv_of.get, send_keys))
        if len(recv_of) != len(recv_keys) or len(send_keys) != len(recv_keys) or None in partner \
                or len(set(partner)) != len(partner):
            raise CannotVouch  # unmatched or repeated messages: the engine names them
        # the engine numbers a message when it meets its later side, ranks in order
        later = list(map(max, send_at, map(recv_at.__getitem__, partner)))  # type: ignore[arg-type]
        low = (1 << 32) - 1
        order = sorted(range(len(send_keys)), key=later.__getitem__)
        sp = [send_at[k] for k in order]
        rp = [recv_at[partner[k]] for k in order]  # type: ignore[index]
        src, si = [p >> 32 for p in sp], [p & low for p in sp]
        dst, ri = [p >> 32 for p in rp], [p & low for p in rp]
        for tid, a, i, b, j in zip(range(len(order)), src, si, dst, ri):
            xfer_at[a][i] = tid
            xfer_at[b][j] = tid
        stages = self.stages
        send_stage = [stages[a][i] for a, i in zip(src, si)]
        recv_stage = [send_keys[k][3] for k in order]
        moved = [0 if codes_all[a][i] == SEND else 1 for a, i in zip(src, si)]  # 1: saved activations move
        peers = _PeerColumns(
            src=src, dst=dst, kind=[kcodes[a][i] for a, i in zip(src, si)], stage=send_stage,
            mb=[send_keys[k][4] for k in order], moved=moved,
            bytes_stage=[min(a, b) if m == 0 else b for a, b, m in zip(send_stage, recv_stage, moved)],
            send=list(zip(src, si)), recv=list(zip(dst, ri)))
        return peers, hosts, recv_index

    def _signal(self) -> int:
        sig = self.next_signal
        self.next_signal += 1
        return sig

    def _data_dep(self, tid: int, sig: int) -> None:
        self.x_pending[tid] += 1
        self.data_waiters.setdefault(sig, []).append(tid)

    def _gate(self, tid: int, landings: list[int]) -> None:
        for landing in landings:
            self.x_pending[tid] += 1
            self.gated.setdefault(landing, []).append(tid)

    def _rank(self, r: int, recv_index: dict[tuple[int, int, int], int]) -> tuple[list[tuple], dict[int, int]]:  # type: ignore[type-arg]
        """Rank ``r``'s ops, and the completion keys its computes produce (key -> action index)."""
        sched = self.schedule
        s2r = sched.stage_to_rank
        num_stages = sched.num_stages
        last = num_stages - 1
        recomputed = self.recomputed
        st = _RankState()
        done, wanted, away, back, evicting = st.done, st.wanted, st.away, st.back, st.evicting
        xat = self.xfer_at[r]
        ops: list[tuple] = []  # type: ignore[type-arg]
        for i, c, kc, s, m in zip(range(len(xat)), self.codes[r], self.kcodes[r], self.stages[r], self.mbs[r]):
            if c == RECV:
                ops.append((c, xat[i]))
                continue
            if c == SEND:
                key = (s << 33) | (m << 1) | (kc != KSEND_F)
                if key not in done:
                    self._data_dep(xat[i], self._want(wanted, key))
                ops.append((c, xat[i]))
                continue
            if c < SEND:
                if s2r[s] != r:
                    raise CannotVouch
                deps: list[int] = []
                used: list[int] = []
                if kc == KF and s > 0:
                    self._input(r, s, m, s - 1, KRECV_F, 0, recv_index, done, wanted, deps, used)
                elif (kc == KB or kc == KI) and s < last:
                    self._input(r, s, m, s + 1, KRECV_B, 1, recv_index, done, wanted, deps, used)
                mk = (s, m)
                if kc != KF:
                    if mk in back:
                        tid = xat[back.pop(mk)]
                        deps.append(tid)
                        used.append(tid)
                    elif mk in away:
                        raise CannotVouch
                announce: tuple[int, ...] = ()
                if kc == KF or kc == KB or kc == KI:
                    key = (s << 33) | (m << 1) | (kc != KF)
                    if key in done:
                        raise CannotVouch  # produced twice
                    done[key] = i
                    if key in wanted:
                        announce = (wanted.pop(key),)
                gate: tuple[int, ...] = ()
                if evicting and (kc == KF or kc == KR):
                    gate = tuple(evicting)
                    evicting.clear()
                ops.append((c, c * num_stages + s, s, mk, s + num_stages if mk in recomputed else s, tuple(deps) + gate,
                            tuple(used), (gate, announce, ()) if gate or announce else None))
                continue
            ops.append((c, xat[i]))
            self._move(r, i, kc, s, m, st)
        if wanted:
            raise CannotVouch  # a completion waited for that this rank never produces: the engine reports it
        return ops, done

    def _want(self, wanted: dict[int, int], key: int) -> int:
        """The signal of completion ``key``, which a consumer met before its producer waits for."""
        sig = wanted.get(key)
        if sig is None:
            sig = wanted[key] = self._signal()
        return sig

    def _move(self, r: int, i: int, kc: int, s: int, m: int, st: "_RankState") -> None:
        """A BPipe or host move of rank ``r``: what its transfer waits for, and the rank's record of moves."""
        tid = self.xfer_at[r][i]
        mk = (s, m)
        if kc == KEVICT or kc == KOFFLOAD:
            st.away.add(mk)
            if kc == KEVICT:
                st.evicting.append(tid)
            else:
                st.offloaded[mk] = tid
                self.host_x.append((r, HOST, KINDS[kc], s, m))
            key = (s << 33) | (m << 1)
            if key not in st.done:
                self._data_dep(tid, self._want(st.wanted, key))
        elif kc == KLOAD or kc == KRELOAD:
            st.away.discard(mk)
            st.back[mk] = i
            if kc == KRELOAD:
                if mk not in st.offloaded:
                    raise CannotVouch
                self.host_x.append((HOST, r, KINDS[kc], s, m))
                self._data_dep(tid, st.offloaded[mk])
            else:
                self._gate(tid, st.evicting)
        elif kc == KACCEPT:
            st.accepted[mk] = i
            self._gate(tid, st.returning)
            st.returning[:] = [tid]
        elif kc == KRETURN:
            if mk not in st.accepted:
                raise CannotVouch
            self._data_dep(tid, self.xfer_at[r][st.accepted.pop(mk)])
            st.returning.append(tid)
        self.mixed.add(r)  # every move changes its rank's memory

    def _input(self, r: int, s: int, m: int, src_stage: int, recv_code: int, gradient: int,
               recv_index: dict[tuple[int, int, int], int], done: dict[int, int], wanted: dict[int, int],
               deps: list[int], used: list[int]) -> None:
        """What compute (s, m) on rank r waits for from stage ``src_stage`` (its input or output gradient)."""
        key = (src_stage << 33) | (m << 1) | gradient
        q = self.schedule.stage_to_rank[src_stage]
        if q != r:
            j = recv_index.get((recv_code, s, m))
            if j is not None:
                tid = self.xfer_at[r][j]
                deps.append(tid)
                used.append(tid)
                return
            entry = self.implicit.get(key)  # no receive in the schedule: an implicit, unserialised transfer
            if entry is None:
                entry = self.implicit[key] = (self._signal(), len(self.delay_specs))
                self.delay_specs.append((q, r, min(s, src_stage)))
            deps.append(entry[0])
            return
        if key in done:
            return
        deps.append(self._want(wanted, key))


def applies(schedule: Schedule, costs: SimCosts) -> bool:
    """Links that charge CPU time to their endpoints (``Link.cpu_s_per_byte``) or cost late receives more
    (``Link.late_receive_s``) are the engine's alone."""
    return not costs.event_engine_only


def run(schedule: Schedule, costs: SimCosts) -> Trace:
    """The dataflow evaluation; raises :class:`~evenpipe.sim.kernel.CannotVouch` where it cannot vouch for being
    identical to the event engine's."""
    return _Run(schedule, compile_shape(schedule), costs).run()


def simulate_fast(schedule: Schedule, costs: SimCosts) -> Trace | None:
    """The trace :func:`evenpipe.sim.engine.simulate_events` would return, or ``None`` where this evaluation
    cannot vouch for being identical (the caller then runs the event engine). ``costs`` must describe every
    stage."""
    return attempt(lambda: run(schedule, costs)) if applies(schedule, costs) else None


class _Run:
    """One evaluation of a compiled shape under costs."""

    def __init__(self, schedule: Schedule, shape: Shape, costs: SimCosts) -> None:
        self.schedule, self.shape, self.costs = schedule, shape, costs

    def _transfer_tables(self) -> tuple[list[float], list[float], list[bool], list[float]]:
        """Per transfer bytes and duration, per link whether every message on it is instant, per delay slot
        its delay."""
        sh, costs = self.shape, self.costs
        stages = costs.stages
        spec_bytes, spec_dur = [], []
        instant = [True] * len(sh.link_keys)
        for lid, moved, bstage, rec in sh.specs:
            st = stages[bstage]
            num_bytes = st.output_bytes if moved == 0 else (st.checkpoint_bytes if rec else st.activation_bytes)
            src, dst = sh.link_keys[lid]
            if src != HOST and dst != HOST:
                timing = costs.link(src, dst)
            else:
                host = max(src, dst)
                timing = costs.link(host, host)
            duration = timing.transfer_time(num_bytes)
            spec_bytes.append(num_bytes)
            spec_dur.append(duration)
            if duration:
                instant[lid] = False
        delays = [costs.link(q, r).transfer_time(stages[s].output_bytes) for q, r, s in sh.delay_specs]
        return [spec_bytes[k] for k in sh.x_spec], [spec_dur[k] for k in sh.x_spec], instant, delays

    def run(self) -> Trace:
        """Evaluate: wake what set signals release, start the transfers whose conditions are met, then run the
        next rank that may move, until none may; raises :class:`CannotVouch` where the engine must decide."""
        st = self._state()
        wake, serve, step = _waker(st), _server(st), _stepper(st)
        woken, ready_x, todo = st.woken, st.ready_x, st.todo
        while True:
            if woken:
                wake()
            if ready_x:
                serve()
            if woken:
                continue
            if not todo:
                break
            step(todo.pop())
        return self._finish(st)

    def _state(self) -> "_RunState":
        """The run's tables and its empty mutable state."""
        sched, sh = self.schedule, self.shape
        n, num_x = sched.num_ranks, len(sh.x_link)
        x_bytes, x_dur, instant, delays = self._transfer_tables()
        table, act, ckpt, wgb = stage_tables(self.costs.stages)
        x_frees = [FREES[k.code] for k in sh.x_kind]
        x_allocs = [ALLOCS[k.code] for k in sh.x_kind]
        # instant messages nobody else waits to land and that move no saved activations complete inline
        plain = [instant[lid] and not fr and not al for lid, fr, al in zip(sh.x_link, x_frees, x_allocs)]
        for tid in sh.gated:
            plain[tid] = False
        link_order, x_linkpos = sh.serving_order() if not all(instant) else ([], [])
        return _RunState(
            sh=sh, x_bytes=x_bytes, x_dur=x_dur, instant=instant, delays=delays, table=table, act=act, ckpt=ckpt,
            fab=act + ckpt, wgb=wgb, x_frees=x_frees, x_allocs=x_allocs, plain=plain, link_order=link_order,
            x_linkpos=x_linkpos, avail=[None] * sh.num_signals,
            waiters={sig: [-1 - t for t in tids] for sig, tids in sh.data_waiters.items()},
            x_pending=list(sh.x_pending), x_ready=[0.0] * num_x, x_rdata=[0.0] * num_x, x_start=[-1.0] * num_x,
            x_end=[-1.0] * num_x, x_exposed=[0.0] * num_x, x_trig=[-2] * num_x, x_trig2=[-2] * num_x,
            link_next=[0] * len(instant), link_end=[0.0] * len(instant), pcs=[0] * n, t_free=[0.0] * n,
            starts=[[0.0] * len(c) for c in sh.codes], ends=[[0.0] * len(c) for c in sh.codes],
            held=[{} for _ in range(n)], mem=[[] for _ in range(n)], todo=list(range(n - 1, -1, -1)), ready_x=[],
            woken=[])

    def _finish(self, st: "_RunState") -> Trace:
        """Check that everything ran and the memory sums are exact; the trace."""
        sh = st.sh
        if any(pc != len(c) for pc, c in zip(st.pcs, sh.codes)) or (st.x_end and min(st.x_end) < 0.0):
            raise CannotVouch  # stuck here: a deadlock, or a link order the engine would not take
        for r in sh.mixed:
            if not sums_exact(st.mem[r]):
                raise CannotVouch
        src, dst = sh.x_src, sh.x_dst
        if HOST in src or HOST in dst:  # a host move names its rank on both sides
            src = [d if s == HOST else s for s, d in zip(sh.x_src, sh.x_dst)]
            dst = [s if d == HOST else d for s, d in zip(sh.x_src, sh.x_dst)]
        records = list(map(tuple.__new__, repeat(TransferRecord),
                           zip(src, dst, sh.x_kind, sh.x_stage, sh.x_mb, st.x_bytes, st.x_start, st.x_end,
                               st.x_exposed)))
        return make_trace(self.schedule, self.costs, st.starts, st.ends, records, st.mem, evaluator=NAME)


class _RunState(RunState):
    """One evaluation's tables (per transfer ``x_*``, per link ``link_*``, per rank) and mutable state."""

    sh: Shape
    x_bytes: list[float]
    x_dur: list[float]
    instant: list[bool]
    """Per link id, whether every message on it takes no time."""
    delays: list[float]
    table: list[float]
    """Compute durations by ``code * stages + stage``."""
    act: list[float]
    ckpt: list[float]
    fab: list[float]
    """What a forward saves: activations, or (second half) the checkpoint when recomputed."""
    wgb: list[float]
    x_frees: list[bool]
    x_allocs: list[bool]
    plain: list[bool]
    """Instant messages nobody else waits to land and that move no saved activations: complete inline."""
    link_order: list[list[int]]
    x_linkpos: list[int]
    avail: list[float | None]
    """Per signal, when it was set."""
    waiters: dict[int, list[int]]
    """Signal -> ranks (>= 0) or transfers (``-1 - id``) waiting for it."""
    x_pending: list[int]
    x_ready: list[float]
    x_rdata: list[float]
    x_start: list[float]
    x_end: list[float]
    x_exposed: list[float]
    x_trig: list[int]
    """What made each transfer ready last: ``rank << 32 | position`` of the send or receive whose time is its ready
    time, -1 when a signal did or tied with them, -2 before any condition."""
    x_trig2: list[int]
    """The other side's position, when both ends were reached at that time."""
    link_next: list[int]
    link_end: list[float]
    pcs: list[int]
    t_free: list[float]
    starts: list[list[float]]
    ends: list[list[float]]
    held: list[dict[tuple[int, int], float]]
    mem: list[list[tuple[float, float]]]
    todo: list[int]
    """Ranks that may move."""
    ready_x: list[int]
    """Transfers whose conditions are all met."""
    woken: list[tuple[int, float]]
    """(signal, time) just set, whose waiters still need waking."""


def _waker(st: _RunState) -> Callable[[], None]:
    """Wake what the signals just set release: ranks become movable, transfers get one condition nearer."""
    woken, waiters, todo, ready_x = st.woken, st.waiters, st.todo, st.ready_x
    x_rdata, x_ready, x_trig, x_pending = st.x_rdata, st.x_ready, st.x_trig, st.x_pending

    def wake() -> None:
        while woken:
            sig, e = woken.pop()
            for w in waiters.pop(sig, ()):
                if w >= 0:
                    todo.append(w)
                else:
                    w = -1 - w
                    if x_rdata[w] < e:
                        x_rdata[w] = e
                    if x_ready[w] <= e:
                        x_ready[w] = e
                        x_trig[w] = -1  # made ready by a signal: no rank order to vouch for ties
                    x_pending[w] -= 1
                    if not x_pending[w]:
                        ready_x.append(w)
    return wake


def _starter(st: _RunState) -> Callable[[int, float], float]:
    """``begin(tid, t)``: transfer ``tid`` starts at ``t``; its memory changes, its ends' times, what its landing
    releases; returns its end."""
    sh = st.sh
    x_start, x_end, x_dur, x_bytes, x_allocs, x_frees = st.x_start, st.x_end, st.x_dur, st.x_bytes, st.x_allocs, \
        st.x_frees
    x_src, x_dst, x_stage, x_mb, x_send, x_recv = sh.x_src, sh.x_dst, sh.x_stage, sh.x_mb, sh.x_send, sh.x_recv
    held, mem, ends, gated, avail, waiters, woken = st.held, st.mem, st.ends, sh.gated, st.avail, st.waiters, \
        st.woken
    x_ready, x_trig, x_pending, ready_x = st.x_ready, st.x_trig, st.x_pending, st.ready_x

    def begin(tid: int, t: float) -> float:
        x_start[tid] = t
        e = x_end[tid] = t + x_dur[tid]
        if x_allocs[tid] and x_bytes[tid]:
            d, key = x_dst[tid], (x_stage[tid], x_mb[tid])
            held[d][key] = held[d].get(key, 0.0) + x_bytes[tid]
            mem[d].append((t, x_bytes[tid]))
        if x_frees[tid] and x_bytes[tid]:
            d, key = x_src[tid], (x_stage[tid], x_mb[tid])
            held[d][key] = held[d].get(key, 0.0) - x_bytes[tid]
            mem[d].append((e, -x_bytes[tid]))
        p = x_recv[tid]
        if p is not None:
            ends[p[0]][p[1]] = e
        p = x_send[tid]
        if p is not None:
            ends[p[0]][p[1]] = e
        for g in gated.get(tid, ()):
            if x_ready[g] <= e:
                x_ready[g] = e
                x_trig[g] = -1
            x_pending[g] -= 1
            if not x_pending[g]:
                ready_x.append(g)
        avail[tid] = e
        if tid in waiters:
            woken.append((tid, e))
        return e
    return begin


def _server(st: _RunState) -> Callable[[], None]:
    """Start the transfers whose conditions are met, each link's in its static order (raising
    :class:`CannotVouch` where that may not be the engine's FIFO order)."""
    begin = _starter(st)
    ready_x, x_start, x_link, instant, x_linkpos = st.ready_x, st.x_start, st.sh.x_link, st.instant, st.x_linkpos
    link_next, link_order, link_end, x_ready, x_trig, x_trig2, x_pending = st.link_next, st.link_order, \
        st.link_end, st.x_ready, st.x_trig, st.x_trig2, st.x_pending

    def serve() -> None:
        while ready_x:
            tid = ready_x.pop()
            if x_start[tid] >= 0.0:
                continue  # started already, behind its predecessor on a busy link
            lid = x_link[tid]
            pos = -1
            if not instant[lid]:
                pos = x_linkpos[tid]
                if link_next[lid] != pos:
                    continue  # its predecessor on the link starts it
                order = link_order[lid]
            while True:
                t = x_ready[tid]
                if pos > 0:
                    before = x_ready[order[pos - 1]]
                    prev = order[pos - 1]
                    if not (t > before or t == before and served_first(x_trig[prev], x_trig2[prev],
                                                                         x_trig[tid], x_trig2[tid])):
                        raise CannotVouch  # maybe not served in FIFO order: the engine decides
                    if link_end[lid] > t:
                        t = link_end[lid]
                e = begin(tid, t)
                if pos < 0:
                    break
                link_end[lid] = e
                pos += 1
                link_next[lid] = pos
                if pos == len(order):
                    break
                tid = order[pos]
                if x_pending[tid]:
                    break
    return serve


def _announcer(st: _RunState) -> Callable[[tuple, tuple[int, ...], float, float, float], None]:  # type: ignore[type-arg]
    """``after(extra, waits, now, start, end)``: a compute's gate exposure and the signals it announces."""
    avail, x_end, x_exposed, woken, delays = st.avail, st.x_end, st.x_exposed, st.woken, st.delays

    def after(extra: tuple, waits: tuple[int, ...], now: float, start: float, end: float) -> None:  # type: ignore[type-arg]
        gate, announce, delayed = extra
        if gate:
            _expose_gate(waits[:len(waits) - len(gate)], gate, avail, x_end, x_exposed, now, start)
        for sig in announce:
            avail[sig] = end
            woken.append((sig, end))
        for sig, slot in delayed:
            t = avail[sig] = end + delays[slot]
            woken.append((sig, t))
    return after


def _stepper(st: _RunState) -> Callable[[int], None]:
    """``step(r)``: run rank ``r`` from its cursor until a compute must wait or the list ends."""
    after = _announcer(st)
    sh, starts, ends, held, mem, pcs, t_free = st.sh, st.starts, st.ends, st.held, st.mem, st.pcs, st.t_free
    x_rdata, x_ready, x_trig, x_trig2, x_pending, plain = st.x_rdata, st.x_ready, st.x_trig, st.x_trig2, \
        st.x_pending, st.plain
    x_start, x_end, x_exposed, avail, waiters, woken, ready_x = st.x_start, st.x_end, st.x_exposed, st.avail, \
        st.waiters, st.woken, st.ready_x
    x_send, x_recv, table, fab, act, ckpt, wgb = sh.x_send, sh.x_recv, st.table, st.fab, st.act, st.ckpt, st.wgb
    avail_at = avail.__getitem__

    def step(r: int) -> None:
        ops = sh.ops[r]
        st_r, en_r, held_r, mem_r = starts[r], ends[r], held[r], mem[r]
        i, count, now = pcs[r], len(ops), t_free[r]
        while i < count:
            op = ops[i]
            c = op[0]
            if c >= SEND:
                tid = op[1]
                st_r[i] = en_r[i] = now
                if c < RECV and x_rdata[tid] < now:
                    x_rdata[tid] = now
                rt = x_ready[tid]
                if rt < now or x_trig[tid] == -2:
                    x_ready[tid] = now
                    x_trig[tid] = (r << 32) | i
                    x_trig2[tid] = -2
                elif rt == now:
                    if x_trig[tid] >= 0 and x_trig2[tid] == -2:
                        x_trig2[tid] = (r << 32) | i  # both ends reached at the same time
                    else:
                        x_trig[tid] = -1
                left = x_pending[tid] - 1
                x_pending[tid] = left
                if not left:
                    if plain[tid]:
                        e = x_start[tid] = x_end[tid] = avail[tid] = x_ready[tid]
                        p = x_recv[tid]
                        ends[p[0]][p[1]] = e
                        p = x_send[tid]
                        ends[p[0]][p[1]] = e
                        if tid in waiters:
                            woken.append((tid, e))
                    else:
                        ready_x.append(tid)
                i += 1
                continue
            _, dk, s, key, mk, waits, used, extra = op
            start = wait_or_park(avail_at, waits, now, waiters, r)  # its inputs, then the evictions gating it
            if start == PARKED:
                break
            for tid in used:
                rd = x_rdata[tid]
                exposed = x_end[tid] - (now if now > rd else rd)
                if exposed > x_exposed[tid]:
                    x_exposed[tid] = exposed
            end = start + table[dk]
            compute_memory(c, key, start, end, fab[mk], act[s] - ckpt[s], wgb[s], held_r, mem_r)
            st_r[i] = start
            en_r[i] = end
            if extra is not None:
                after(extra, waits, now, start, end)
            now = end
            i += 1
        pcs[r] = i
        t_free[r] = now
    return step


def _expose_gate(deps: tuple[int, ...], gate: tuple[int, ...], avail: list[float | None], x_end: list[float],
                 x_exposed: list[float], base: float, start: float) -> None:
    """The engine's ``_expose_gate``: split the delay the eviction gate added among the gating evictions."""
    for sig in deps:
        t = avail[sig]
        assert t is not None
        if t > base:
            base = t
    for tid in sorted(gate, key=x_end.__getitem__):
        end = x_end[tid] if x_end[tid] < start else start
        if end > base:
            x_exposed[tid] += end - base
            base = end
