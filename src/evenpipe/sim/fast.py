"""The simulator's rules evaluated as a dataflow: no clock, no event heap, a schedule's shape compiled once.

Every time the event engine (:mod:`evenpipe.sim.engine`) computes is a max-plus expression of earlier times
(a compute starts at the latest of its rank becoming free, its inputs arriving and its gates landing; a
message starts at the latest of its send being reached, its receive posted and its data ready), with one
exception: the order in which a busy link serves the messages queued on it. So this module computes each time
as soon as the times it depends on are known, in any order, and serves every link in a static order (the
sending side's program order). That static order is the engine's FIFO order exactly when the link's messages
become ready at strictly increasing times along it, which is checked as each message starts; a link whose
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

import gc
from collections import Counter
from dataclasses import dataclass
from typing import Hashable

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.sim import engine as _ref
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["simulate_fast", "compile_shape"]

_F, _B, _I, _W, _R, _SEND, _SEND_FREES, _RECV, _RECV_ALLOC = range(9)
_HOST = _ref._HOST
_CODE, _MATCH, _RECV_SHIFT, _HOST_SIDE = _ref._CODE, _ref._MATCH, _ref._RECV_SHIFT, _ref._HOST_SIDE
_FREES, _ALLOCS = _ref._FREES, _ref._ALLOCS
_KINDS = tuple(ActionKind)
(_KF, _KB, _KI, _KR, _KSEND_F, _KRECV_F, _KRECV_B, _KEVICT, _KACCEPT, _KRETURN, _KLOAD, _KOFFLOAD,
 _KRELOAD) = (_ref._KF, _ref._KB, _ref._KI, _ref._KR, _ref._KSEND_F, _ref._KRECV_F, _ref._KRECV_B, _ref._KEVICT,
              _ref._KACCEPT, _ref._KRETURN, _ref._KLOAD, _ref._KOFFLOAD, _ref._KRELOAD)
_EXACT_LIMIT = 2 ** 53
_CACHE_SIZE = 8


class _Fallback(Exception):
    """An assumption of the dataflow evaluation does not hold: let the event engine decide."""


@dataclass(slots=True)
class Shape:
    """What a schedule's simulation needs that does not depend on the costs. Signals are ints: transfer ids
    ``0..T-1`` (the message arrived), then compute completions and delayed (implicit-transfer) completions."""

    codes: list[list[int]]
    """Per rank and action, the event code."""
    stages: list[list[int]]
    microbatches: list[list[int]]
    xfer_at: list[list[int]]
    """Per rank and action, the transfer id of a send/receive (-1 for computes)."""
    deps: list[list[tuple[int, ...]]]
    """Per rank and action, the signals a compute waits for."""
    used: list[list[tuple[int, ...]]]
    """Per rank and action, the transfers a compute consumes (charged with exposed time)."""
    gates: list[list[tuple[int, ...]]]
    """Per rank and action, the EVICT transfers a ``F``/``R`` waits to land."""
    outs: list[list[tuple[int, ...]]]
    """Per rank and action, the completion signals a compute announces (somebody waits on them)."""
    delayed: list[list[tuple[tuple[int, int], ...]]]
    """Per rank and action, (delayed signal, delay slot) a compute announces at its end plus the slot's delay."""
    delay_specs: list[tuple[int, int, int]]
    """Per delay slot, (src rank, dst rank, stage whose ``output_bytes`` move)."""
    recomputed: frozenset[tuple[int, int]]
    num_signals: int
    # transfers, as parallel lists
    x_src: list[int]
    x_dst: list[int]
    x_kind: list[ActionKind]
    x_stage: list[int]
    x_mb: list[int]
    x_send: list[tuple[int, int] | None]
    x_recv: list[tuple[int, int] | None]
    x_pending: list[int]
    x_spec: list[int]
    """Per transfer, index into ``specs``."""
    specs: list[tuple[int, int, int, bool]]
    """(link id, 0 = stage output / 1 = saved activations moved, stage, recomputed)."""
    link_keys: list[tuple[int, int]]
    x_link: list[int]
    link_order: list[list[int]]
    """Per link id, its transfers in the order the link serves them when busy."""
    x_linkpos: list[int]
    gated: dict[int, list[int]]
    """Transfer id -> transfers that may not start before it lands."""
    data_waiters: dict[int, list[int]]
    """Signal -> transfers whose data it makes ready."""
    mixed: frozenset[int]
    """Ranks whose memory changes also come from transfers."""


_cache: list[tuple[Schedule, Shape]] = []


def compile_shape(schedule: Schedule) -> Shape:
    """The cost-independent part of a simulation (raises ``_Fallback`` for schedules the engine must judge)."""
    for i, (sched, shape) in enumerate(_cache):
        if sched is schedule:
            if i:
                _cache.insert(0, _cache.pop(i))
            return shape
    shape = _Compiler(schedule).run()
    _cache.insert(0, (schedule, shape))
    del _cache[_CACHE_SIZE:]
    return shape


class _Compiler:
    """Port of the engine's preparation with integer signals; any irregularity raises ``_Fallback``."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.x_src: list[int] = []
        self.x_dst: list[int] = []
        self.x_kind: list[ActionKind] = []
        self.x_stage: list[int] = []
        self.x_mb: list[int] = []
        self.x_send: list[tuple[int, int] | None] = []
        self.x_recv: list[tuple[int, int] | None] = []
        self.x_pending: list[int] = []
        self.x_bytes: list[tuple[int, int]] = []  # (0, stage) output / (1, stage) moved
        self.x_linkkey: list[tuple[int, int]] = []
        self.gated: dict[int, list[int]] = {}
        self.waiters: dict[Hashable, list[int]] = {}  # signal -> transfers (data deps)
        self.needed: set[Hashable] = set()
        self.delay_slots: dict[tuple[str, int, int], int] = {}
        self.delay_specs: list[tuple[int, int, int]] = []
        self.mixed: set[int] = set()
        self.off_signal: dict[tuple[int, int, int], int] = {}  # (rank, stage, mb) -> its OFFLOAD transfer

    def new_xfer(self, src: int, dst: int, kind: ActionKind, stage: int, mb: int, moved: int, bytes_stage: int,
                 send_pos: tuple[int, int] | None, recv_pos: tuple[int, int] | None, link: tuple[int, int]) -> int:
        tid = len(self.x_src)
        self.x_src.append(src)
        self.x_dst.append(dst)
        self.x_kind.append(kind)
        self.x_stage.append(stage)
        self.x_mb.append(mb)
        self.x_send.append(send_pos)
        self.x_recv.append(recv_pos)
        self.x_pending.append((send_pos is not None) + (recv_pos is not None))
        self.x_bytes.append((moved, bytes_stage))
        self.x_linkkey.append(link)
        if send_pos is not None:
            self.xfer_at[send_pos[0]][send_pos[1]] = tid
        if recv_pos is not None:
            self.xfer_at[recv_pos[0]][recv_pos[1]] = tid
        if _FREES[kind.code]:
            self.mixed.add(src)
        if _ALLOCS[kind.code]:
            self.mixed.add(dst)
        return tid

    def data_dep(self, tid: int, signal: Hashable) -> None:
        self.x_pending[tid] += 1
        self.waiters.setdefault(signal, []).append(tid)

    def gate(self, tid: int, landings: list[int]) -> None:
        for landing in landings:
            self.x_pending[tid] += 1
            self.gated.setdefault(landing, []).append(tid)

    def run(self) -> Shape:
        sched = self.schedule
        code = _CODE
        actions = sched.actions
        self.codes = [[code[a.kind.code] for a in acts] for acts in actions]  # type: ignore[misc]
        self.stages = [[a.stage for a in acts] for acts in actions]
        self.mbs = [[a.microbatch for a in acts] for acts in actions]
        self.recomputed = frozenset((a.stage, a.microbatch) for acts, codes in zip(actions, self.codes)
                                    if _R in codes for a, c in zip(acts, codes) if c == _R)
        self.xfer_at = [[-1] * len(acts) for acts in actions]
        self._match()
        self.gates: list[list[tuple[int, ...]]] = [[()] * len(acts) for acts in actions]
        raw = [self._rank(r) for r in range(sched.num_ranks)]
        return self._finish(raw)

    def _match(self) -> None:
        sched = self.schedule
        unmatched: dict[tuple[int, int, int, int, int], tuple[int, int]] = {}
        pop, match, shift, host_side = unmatched.pop, _MATCH, _RECV_SHIFT, _HOST_SIDE
        self.recv_index: list[dict[tuple[int, int, int], int]] = []
        for r, acts in enumerate(sched.actions):
            idx: dict[tuple[int, int, int], int] = {}
            codes = self.codes[r]
            for i, c in enumerate(codes):
                if c < _SEND:
                    continue
                a = acts[i]
                kc = a.kind.code
                peer = a.peer
                if peer is None or host_side[kc]:
                    continue
                if c < _RECV:
                    key = (r, peer, match[kc], a.stage + shift[kc], a.microbatch)
                    side = (r, i)
                else:
                    key = (peer, r, kc, a.stage, a.microbatch)
                    idx[key[2:]] = i
                    side = (-1 - r, i)
                other = pop(key, None)
                if other is None:
                    unmatched[key] = side
                    continue
                if (other[0] < 0) == (side[0] < 0):
                    raise _Fallback
                send_pos, recv_pos = (side, other) if side[0] >= 0 else (other, side)
                recv_pos = (-1 - recv_pos[0], recv_pos[1])
                send = sched.actions[send_pos[0]][send_pos[1]]
                if self.codes[send_pos[0]][send_pos[1]] == _SEND:
                    moved, bstage = 0, min(send.stage, key[3])
                else:
                    moved, bstage = 1, key[3]
                self.new_xfer(key[0], key[1], send.kind, send.stage, key[4], moved, bstage, send_pos, recv_pos,
                              key[:2])
            self.recv_index.append(idx)
        if unmatched:
            raise _Fallback

    def _rank(self, r: int) -> list[tuple[tuple[Hashable, ...], ...] | None]:
        """Per action, a compute's dependencies as (signal, delayed) pairs (``None`` for transfers)."""
        sched = self.schedule
        last = sched.num_stages - 1
        recv_index = self.recv_index[r]
        done: set[tuple[str, int, int]] = set()
        away: set[tuple[int, int]] = set()
        back: dict[tuple[int, int], int] = {}
        accepted: dict[tuple[int, int], int] = {}
        offloaded: set[tuple[int, int]] = set()
        xfer_at, gates = self.xfer_at[r], self.gates[r]
        evicting: list[int] = []
        returning: list[int] = []
        out: list[tuple[tuple[Hashable, ...], ...] | None] = []
        codes = self.codes[r]
        for i, a in enumerate(sched.actions[r]):
            c = codes[i]
            if c == _RECV:
                out.append(None)
                continue
            s, m = a.stage, a.microbatch
            if c == _SEND:
                signal = ("F", s, m) if a.kind.code == _KSEND_F else ("G", s, m)
                if signal not in done:
                    self.data_dep(xfer_at[i], signal)
                    self.needed.add(signal)
                out.append(None)
                continue
            kc = a.kind.code
            if c < _SEND:
                deps: list[tuple[Hashable, ...]] = []
                if kc == _KF and s > 0:
                    deps.extend(self._input_dep(r, s, m, s - 1, _KRECV_F, "F", recv_index, done))
                elif (kc == _KB or kc == _KI) and s < last:
                    deps.extend(self._input_dep(r, s, m, s + 1, _KRECV_B, "G", recv_index, done))
                if kc != _KF:
                    if (s, m) in back:
                        deps.append((xfer_at[back.pop((s, m))],))
                    elif (s, m) in away:
                        raise _Fallback
                if kc == _KF:
                    done.add(("F", s, m))
                elif kc == _KB or kc == _KI:
                    done.add(("G", s, m))
                if evicting and (kc == _KF or kc == _KR):
                    gates[i] = tuple(evicting)
                    evicting.clear()
                out.append(tuple(deps))
                continue
            out.append(None)
            if kc == _KEVICT or kc == _KOFFLOAD:
                away.add((s, m))
                if kc == _KEVICT:
                    evicting.append(xfer_at[i])
                else:
                    offloaded.add((s, m))
                    self.new_xfer(r, _HOST, a.kind, s, m, 1, s, (r, i), None, (r, _HOST))
                    self.off_signal[(r, s, m)] = xfer_at[i]
            elif kc == _KLOAD or kc == _KRELOAD:
                away.discard((s, m))
                back[(s, m)] = i
                if kc == _KRELOAD:
                    if (s, m) not in offloaded:
                        raise _Fallback
                    tid = self.new_xfer(_HOST, r, a.kind, s, m, 1, s, None, (r, i), (_HOST, r))
                    self.data_dep(tid, self.off_signal[(r, s, m)])
                else:
                    self.gate(xfer_at[i], evicting)
            elif kc == _KACCEPT:
                accepted[(s, m)] = i
                self.gate(xfer_at[i], returning)
                returning[:] = [xfer_at[i]]
            elif kc == _KRETURN:
                if (s, m) not in accepted:
                    raise _Fallback
                self.data_dep(xfer_at[i], xfer_at[accepted.pop((s, m))])
                returning.append(xfer_at[i])
            if (kc == _KEVICT or kc == _KOFFLOAD) and ("F", s, m) not in done:
                self.data_dep(xfer_at[i], ("F", s, m))
                self.needed.add(("F", s, m))
        return out

    def _input_dep(self, r: int, s: int, m: int, src_stage: int, recv_code: int, signal: str,
                   recv_index: dict[tuple[int, int, int], int], done: set[tuple[str, int, int]]
                   ) -> list[tuple[Hashable, ...]]:
        q = self.schedule.stage_to_rank[src_stage]
        if q != r:
            j = recv_index.get((recv_code, s, m))
            if j is not None:
                return [(self.xfer_at[r][j],)]
            key = (signal, src_stage, m)
            slot = self.delay_slots.get(key)
            if slot is None:
                slot = self.delay_slots[key] = len(self.delay_specs)
                self.delay_specs.append((q, r, min(s, src_stage)))
            return [(key, slot)]
        if (signal, src_stage, m) in done:
            return []
        self.needed.add((signal, src_stage, m))
        return [((signal, src_stage, m),)]

    def _finish(self, raw: list[list[tuple[tuple[Hashable, ...], ...] | None]]) -> Shape:
        sched = self.schedule
        num_x = len(self.x_src)
        ids: dict[Hashable, int] = {}
        nxt = num_x
        for key in sorted(self.needed, key=repr):
            ids[key] = nxt
            nxt += 1
        delayed_ids: dict[int, int] = {}
        for slot in range(len(self.delay_specs)):
            delayed_ids[slot] = nxt
            nxt += 1
        # the compute that announces each signal
        producer: dict[tuple[str, int, int], tuple[int, int]] = {}
        deps_all, used_all, outs_all, delayed_all = [], [], [], []
        slot_of = {key: slot for key, slot in self.delay_slots.items()}
        for r, row in enumerate(raw):
            deps_r: list[tuple[int, ...]] = []
            used_r: list[tuple[int, ...]] = []
            codes = self.codes[r]
            for i, entry in enumerate(row):
                if entry is None or not entry:
                    deps_r.append(())
                    used_r.append(())
                    continue
                sigs = []
                used = []
                for dep in entry:
                    if len(dep) == 2:
                        sigs.append(delayed_ids[dep[1]])  # type: ignore[index]
                    elif isinstance(dep[0], int):
                        sigs.append(dep[0])
                        used.append(dep[0])
                    else:
                        sigs.append(ids[dep[0]])
                deps_r.append(tuple(sigs))
                used_r.append(tuple(used))
            deps_all.append(deps_r)
            used_all.append(used_r)
            outs_r: list[tuple[int, ...]] = [()] * len(codes)
            delayed_r: list[tuple[tuple[int, int], ...]] = [()] * len(codes)
            stages, mbs = self.stages[r], self.mbs[r]
            for i, c in enumerate(codes):
                if c == _F or c == _B or c == _I:
                    key = ("F" if c == _F else "G", stages[i], mbs[i])
                    sig = ids.get(key)
                    if sig is not None:
                        outs_r[i] = (sig,)
                    slot = slot_of.get(key)
                    if slot is not None:
                        delayed_r[i] = ((delayed_ids[slot], slot),)
                    producer[key] = (r, i)
            outs_all.append(outs_r)
            delayed_all.append(delayed_r)
        for key in self.needed:  # a signal nobody produces: the engine reports the deadlock
            if key not in producer:
                raise _Fallback
        for key in self.delay_slots:
            if key not in producer:
                raise _Fallback
        data_waiters: dict[int, list[int]] = {}
        for key, tids in self.waiters.items():
            data_waiters[key if isinstance(key, int) else ids[key]] = tids
        # links and byte specs
        link_ids: dict[tuple[int, int], int] = {}
        link_order: list[list[int]] = []
        x_link = []
        for key in self.x_linkkey:
            lid = link_ids.get(key)
            if lid is None:
                lid = link_ids[key] = len(link_order)
                link_order.append([])
            x_link.append(lid)

        def order_key(tid: int) -> tuple[int, int]:
            pos = self.x_send[tid] or self.x_recv[tid]
            assert pos is not None
            return pos
        for tid in range(num_x):
            link_order[x_link[tid]].append(tid)
        x_linkpos = [0] * num_x
        for tids in link_order:
            tids.sort(key=order_key)
            for k, tid in enumerate(tids):
                x_linkpos[tid] = k
        spec_ids: dict[tuple[int, int, int, bool], int] = {}
        x_spec = []
        for tid in range(num_x):
            moved, bstage = self.x_bytes[tid]
            spec = (x_link[tid], moved, bstage, moved == 1 and (bstage, self.x_mb[tid]) in self.recomputed)
            sid = spec_ids.get(spec)
            if sid is None:
                sid = spec_ids[spec] = len(spec_ids)
            x_spec.append(sid)
        return Shape(codes=self.codes, stages=self.stages, microbatches=self.mbs, xfer_at=self.xfer_at,
                     deps=deps_all, used=used_all, gates=self.gates, outs=outs_all, delayed=delayed_all,
                     delay_specs=self.delay_specs, recomputed=self.recomputed, num_signals=nxt,
                     x_src=self.x_src, x_dst=self.x_dst, x_kind=self.x_kind, x_stage=self.x_stage, x_mb=self.x_mb,
                     x_send=self.x_send, x_recv=self.x_recv, x_pending=self.x_pending, x_spec=x_spec,
                     specs=list(spec_ids), link_keys=list(link_ids), x_link=x_link, link_order=link_order,
                     x_linkpos=x_linkpos, gated=self.gated, data_waiters=data_waiters,
                     mixed=frozenset(self.mixed))


def simulate_fast(schedule: Schedule, costs: SimCosts) -> Trace | None:
    """The trace :func:`evenpipe.sim.engine.simulate_events` would return, or ``None`` where this evaluation
    cannot vouch for being identical (the caller then runs the event engine). ``costs`` must describe every
    stage."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        shape = compile_shape(schedule)
        return _Run(schedule, shape, costs).run()
    except _Fallback:
        return None
    finally:
        if collecting:
            gc.enable()


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
            if src != _HOST and dst != _HOST:
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
        sched, sh, costs = self.schedule, self.shape, self.costs
        stages = costs.stages
        num_stages = len(stages)
        n = sched.num_ranks
        x_bytes, x_dur, instant, delays = self._transfer_tables()
        table = ([st.forward for st in stages] + [st.backward for st in stages]
                 + [st.backward_input for st in stages] + [st.backward_weight for st in stages]
                 + [st.recompute_time for st in stages])
        act = [st.activation_bytes for st in stages]
        ckpt = [st.checkpoint_bytes for st in stages]
        wgb = [st.weight_grad_bytes for st in stages]
        recomputed = sh.recomputed
        num_x = len(x_dur)
        avail: list[float | None] = [None] * sh.num_signals
        waiters: dict[int, list[int]] = {sig: [-1 - t for t in tids] for sig, tids in sh.data_waiters.items()}
        x_pending = list(sh.x_pending)
        x_ready = [0.0] * num_x
        x_rdata = [0.0] * num_x
        x_start = [-1.0] * num_x
        x_end = [-1.0] * num_x
        x_exposed = [0.0] * num_x
        x_link, x_linkpos, link_order = sh.x_link, sh.x_linkpos, sh.link_order
        link_next = [0] * len(link_order)
        link_end = [0.0] * len(link_order)
        x_src, x_dst, x_stage, x_mb, x_send, x_recv = sh.x_src, sh.x_dst, sh.x_stage, sh.x_mb, sh.x_send, sh.x_recv
        x_frees = [_FREES[k.code] for k in sh.x_kind]
        x_allocs = [_ALLOCS[k.code] for k in sh.x_kind]
        gated = sh.gated
        pcs = [0] * n
        t_free = [0.0] * n
        starts = [[0.0] * len(c) for c in sh.codes]
        ends = [[0.0] * len(c) for c in sh.codes]
        held: list[dict[tuple[int, int], float]] = [{} for _ in range(n)]
        mem: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        durs = [[table[c * num_stages + s] if c < _SEND else 0.0 for c, s in zip(codes, ss)]
                for codes, ss in zip(sh.codes, sh.stages)]
        todo = list(range(n - 1, -1, -1))
        ready_x: list[int] = []

        while True:
            while ready_x:  # transfers whose conditions are all met
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
                        if not t > x_ready[order[pos - 1]]:
                            raise _Fallback  # not served in FIFO order: the engine decides
                        if link_end[lid] > t:
                            t = link_end[lid]
                    x_start[tid] = t
                    e = x_end[tid] = t + x_dur[tid]
                    if x_allocs[tid] and x_bytes[tid]:
                        d, key = x_dst[tid], (x_stage[tid], x_mb[tid])
                        held[d][key] = held[d].get(key, 0.0) + x_bytes[tid]
                        mem[d].append((t, x_bytes[tid]))
                    if x_frees[tid] and x_bytes[tid]:
                        s_, key = x_src[tid], (x_stage[tid], x_mb[tid])
                        held[s_][key] = held[s_].get(key, 0.0) - x_bytes[tid]
                        mem[s_].append((e, -x_bytes[tid]))
                    p = x_recv[tid]
                    if p is not None:
                        ends[p[0]][p[1]] = e
                    p = x_send[tid]
                    if p is not None:
                        ends[p[0]][p[1]] = e
                    for g in gated.get(tid, ()):
                        if x_ready[g] < e:
                            x_ready[g] = e
                        x_pending[g] -= 1
                        if not x_pending[g]:
                            ready_x.append(g)
                    avail[tid] = e
                    waiting = waiters.pop(tid, None)
                    if waiting is not None:
                        for w in waiting:
                            if w >= 0:
                                todo.append(w)
                            else:
                                w = -1 - w
                                if x_rdata[w] < e:
                                    x_rdata[w] = e
                                if x_ready[w] < e:
                                    x_ready[w] = e
                                x_pending[w] -= 1
                                if not x_pending[w]:
                                    ready_x.append(w)
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
            if not todo:
                break
            r = todo.pop()
            codes, xat, deps, used, gates = sh.codes[r], sh.xfer_at[r], sh.deps[r], sh.used[r], sh.gates[r]
            outs, delayed, dur, ss, mbs = sh.outs[r], sh.delayed[r], durs[r], sh.stages[r], sh.microbatches[r]
            st_r, en_r, held_r, mem_r = starts[r], ends[r], held[r], mem[r]
            i, count, now = pcs[r], len(codes), t_free[r]
            while i < count:
                c = codes[i]
                if c >= _SEND:
                    tid = xat[i]
                    st_r[i] = en_r[i] = now
                    if c < _RECV and x_rdata[tid] < now:
                        x_rdata[tid] = now
                    if x_ready[tid] < now:
                        x_ready[tid] = now
                    x_pending[tid] -= 1
                    if not x_pending[tid]:
                        ready_x.append(tid)
                    i += 1
                    continue
                start = now
                blocked = -1
                for sig in deps[i]:
                    t = avail[sig]
                    if t is None:
                        blocked = sig
                        break
                    if t > start:
                        start = t
                gate = gates[i]
                if gate and blocked < 0:
                    for sig in gate:
                        t = avail[sig]
                        if t is None:
                            blocked = sig
                            break
                        if t > start:
                            start = t
                if blocked >= 0:
                    waiting = waiters.get(blocked)
                    if waiting is None:
                        waiters[blocked] = [r]
                    else:
                        waiting.append(r)
                    break
                for tid in used[i]:
                    rd = x_rdata[tid]
                    exposed = x_end[tid] - (now if now > rd else rd)
                    if exposed > x_exposed[tid]:
                        x_exposed[tid] = exposed
                if gate:
                    self._expose_gate(deps[i], gate, avail, x_end, x_exposed, now, start)
                s = ss[i]
                end = start + dur[i]
                key = (s, mbs[i])
                if c == _F:
                    nb = ckpt[s] if recomputed and key in recomputed else act[s]
                    if nb:
                        held_r[key] = held_r.get(key, 0.0) + nb
                        mem_r.append((start, nb))
                elif c == _B or c == _W:
                    nb = held_r.pop(key, 0.0)
                    if nb:
                        mem_r.append((end, -nb))
                elif c == _I:
                    h = held_r.get(key, 0.0)
                    nb = h - wgb[s]
                    if nb > 0.0:
                        held_r[key] = h - nb
                        mem_r.append((end, -nb))
                else:
                    nb = act[s] - ckpt[s]
                    if nb > 0.0:
                        held_r[key] = held_r.get(key, 0.0) + nb
                        mem_r.append((start, nb))
                st_r[i] = start
                en_r[i] = end
                now = end
                i += 1
                announce = outs[i - 1]
                if announce or delayed[i - 1]:
                    for sig, t in [(sig, end) for sig in announce] + [(sig, end + delays[slot])
                                                                     for sig, slot in delayed[i - 1]]:
                        avail[sig] = t
                        waiting = waiters.pop(sig, None)
                        if waiting is not None:
                            for w in waiting:
                                if w >= 0:
                                    todo.append(w)
                                else:
                                    w = -1 - w
                                    if x_rdata[w] < t:
                                        x_rdata[w] = t
                                    if x_ready[w] < t:
                                        x_ready[w] = t
                                    x_pending[w] -= 1
                                    if not x_pending[w]:
                                        ready_x.append(w)
            pcs[r] = i
            t_free[r] = now

        if any(pc != len(c) for pc, c in zip(pcs, sh.codes)) or (num_x and min(x_end) < 0.0):
            raise _Fallback  # stuck here: a deadlock, or a link order the engine would not take
        for r in sh.mixed:
            if not _sums_exact(mem[r]):
                raise _Fallback
        kinds = sh.x_kind
        new = tuple.__new__
        records = [new(TransferRecord, (x_src[t] if x_src[t] != _HOST else x_dst[t],
                                        x_dst[t] if x_dst[t] != _HOST else x_src[t], kinds[t], x_stage[t], x_mb[t],
                                        x_bytes[t], x_start[t], x_end[t], x_exposed[t])) for t in range(num_x)]
        return _ref.make_trace(sched, costs, starts, ends, records, mem)

    @staticmethod
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


def _sums_exact(events: list[tuple[float, float]]) -> bool:
    """Whether every partial sum of these deltas, in any order, is exact in binary floating point."""
    counts = Counter(delta for _, delta in events)
    den = 1
    for delta in counts:
        den = max(den, delta.as_integer_ratio()[1])  # powers of two: the largest is a common multiple
    total = 0
    for delta, count in counts.items():
        num, q = delta.as_integer_ratio()
        total += abs(num) * (den // q) * count
    return total < _EXACT_LIMIT
