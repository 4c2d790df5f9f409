"""BPipe's evict/accept/return/load actions, executed on the pipeline replica's separate BPipe process group.

An *evictor* (rank x) sends one micro-batch's activation unit of one stage to its *acceptor* (rank p-1-x) and
frees it; the acceptor holds it; before the backward the acceptor returns it and the evictor loads it back.

What travels: the stash's ``export(key)``, every unique storage of the unit (what autograd saved in the stage's
forward plus the tensors the executor holds for it: received input, kept output) as one flat ``uint8`` buffer,
with its small ``StashMeta``. ``drop`` frees those storages in place, so the graph's and the
executor's own references really lose their memory, and ``restore`` refills them. Under recomputation the unit
holds only the stage input, so only the stage input travels (a recomputed first stage keeps nothing but token
ids, which are not activations: its unit is empty). The stage output's send is waited before the drop, since
the drop may free the storage being sent.

Wire format, per unit, all on the BPipe group: the meta as ``StashMeta.to_tensor()`` (``int64``), then the flat
``uint8`` buffer. Sizes are learned per stage and micro-batch *layout* (:attr:`StepContext.layouts`: the input's
shape, which may differ between micro-batches of one step, and for packed documents the runs of every row, since
the attention core runs once per document and saves per document): the first unit of a (stage, layout) pair
that was unknown when the step began is prefixed with an ``int64[2]`` header (meta length, flat length), as is
every other unit of that pair in the same step; the receiver waits for the header where ACCEPT/LOAD stands (a
blocking wait at the first sight of a layout only: it is the rendezvous point, see below) and posts the data
receives right there. Both sides hold every micro-batch's input and learn the same pairs in the same steps, so
they agree on which units carry a header. A unit of a known pair posts its data receives directly where
ACCEPT/LOAD stands, with buffers of the learned sizes, so the receiver's memory is taken exactly there and the
transfer overlaps compute; a unit whose size differs from its pair's is an error. (Packed documents rarely
repeat a layout, so their units nearly always carry the header and ACCEPT/LOAD wait there.) Data is waited just before it is needed (LOAD: before the stage's RECOMPUTE or
backward; ACCEPT: at RETURN or the next ACCEPT). The sender posts everything at once.

When memory is freed and taken (the simulator's rules, :mod:`evenpipe.sim.engine`). A send's buffer (an
``EVICT``'s exported copy, a ``RETURN``'s hosted buffer) is freed once the send is *waited*: on gloo a send's
``Work.is_completed()`` stays False until ``wait()``, so polling would keep every such buffer until the step's end.
Hence, with blocking waits:

1. before a ``F`` or ``R``, the rank waits for every ``EVICT`` it issued earlier and lets their buffers go, so
   real memory falls before the new activations are allocated;
2. before a ``LOAD`` allocates its receive buffer, the rank waits for its earlier ``EVICT``s;
3. before an ``ACCEPT`` allocates its receive buffer, the acceptor waits for its earlier ``RETURN``s (and frees
   their buffers) and for its previous ``ACCEPT``'s data.

Everything else stays non-blocking (an acceptor's own ``F`` does not wait for its ``RETURN``s, as in the
simulator). These waits cannot deadlock: :func:`evenpipe.schedule.comm.derive_communication` orders the schedule
so that it progresses under *rendezvous* semantics, where a send blocks at the action itself until its receive
is there and the transfer done. Every wait above is for a message that stands earlier in the same rank's list,
so waiting for it at a later point is never stricter than rendezvous (the first step's header wait blocks at
the receive action itself, exactly as rendezvous does); the validator's dry run checks that order. Once
waited, the batch (its works hold the tensors) is dropped, so nothing references the buffer any more.

Accounting (the activation stash) follows the same points: an ``ACCEPT``'s buffer is counted as hosted, and a
``LOAD``'s as the evictor's own (under a stand-in key, :func:`loading_key`), when it is allocated; the ``LOAD``'s
charge moves to the restored unit at the stage's ``R``/backward. The copies made by ``export``/``restore``
themselves are transient and not counted (neither does the simulator model them): for a moment an evictor holds
a unit and its copy (at ``EVICT``) or the received buffer and the restored unit (before the backward). Avoiding
that would need the stash to ship and refill its storages directly instead of one flat copy.

Caveat (untested, no GPU here): on NCCL the blocking waits and the separate header/data batches of the first
step have not been run; the BPipe group's sends and receives share one communicator stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from evenpipe.runtime.comm import PendingBatch, Transfer, post_batch
from evenpipe.runtime.stash import StashMeta
from evenpipe.runtime.step_context import (Handler, Phase, Posting, StashKey, StepContext, register_addon,
                                           register_handler)
from evenpipe.schedule.ir import Action, ActionKind

__all__ = ["BPIPE_KINDS", "BpipeOps", "loading_key"]

_K = ActionKind
BPIPE_KINDS = frozenset({_K.EVICT, _K.ACCEPT, _K.RETURN, _K.LOAD})
"""The kinds BPipe runs; the executor dispatches them to :meth:`BpipeOps.transfers`."""
_PARTS = 3
"""Messages per unit: the first step's size header, the meta, the flat buffer (tags ``part`` 0, 1, 2)."""


def loading_key(key: StashKey) -> StashKey:
    """Stash key under which a ``LOAD``'s receive buffer for ``key = (stage, mb)`` is counted until restored
    (a negative micro-batch index, which no real key has)."""
    return key[0], -1 - key[1]


Sizes = dict[tuple[int, Hashable], tuple[int, int]]
"""Per evicted stage and micro-batch layout: (meta length in int64 elements, flat length in bytes) of its units."""


@dataclass(slots=True)
class _Incoming:
    role: ActionKind
    peer: int
    group: object
    tags: list[int]
    """The tags of its header, meta and flat buffer."""
    what: str
    data_batch: PendingBatch | None = None
    meta_buf: torch.Tensor | None = None
    flat: torch.Tensor | None = None


class BpipeOps:
    """BPipe transfers of one step on one rank (the executor's add-on ``"bpipe"``, made for each step)."""

    def __init__(self, ctx: StepContext, sizes: Sizes) -> None:
        self.ctx = ctx
        self.sizes = sizes
        self.known = frozenset(sizes)
        """The (stage, layout) pairs whose sizes were known when the step began: their units carry no header."""
        self.incoming: dict[StashKey, _Incoming] = {}
        self.evicts: list[PendingBatch] = []
        """EVICT send batches not waited yet (their works hold the exported buffers)."""
        self.returns: list[PendingBatch] = []
        """RETURN send batches not waited yet (their works hold the returned buffers)."""
        self.last_accept: StashKey | None = None
        """Key of the previous ACCEPT (its data is waited before the next ACCEPT allocates)."""
        self.loading: dict[StashKey, torch.Tensor] = {}
        """LOAD buffers counted under :func:`loading_key` until their unit is restored."""

    # -- memory waits (see the module docstring) -------------------------------------------------------------
    def before_compute(self, a: Action) -> None:
        """Rule 1: a ``F`` or ``R`` waits for the rank's earlier evictions and frees their buffers."""
        if a.kind in (_K.FORWARD, _K.RECOMPUTE):
            self._wait_sends(self.evicts)

    def _wait_sends(self, batches: list[PendingBatch]) -> None:
        """Wait every batch, stamp its send records, and drop the batches (and so the buffers they hold)."""
        while batches:
            batch = batches.pop(0)
            batch.wait()
            self.ctx.mail.sent(batch)

    def _before_alloc(self, inc: _Incoming, key: StashKey) -> None:
        """Rules 2 and 3: what a LOAD's or ACCEPT's receive buffer waits for before it is allocated."""
        if inc.role is _K.LOAD:
            self._wait_sends(self.evicts)
            return
        self._wait_sends(self.returns)
        prev = self.incoming.get(self.last_accept) if self.last_accept is not None else None
        if prev is not None and prev.role is _K.ACCEPT and prev.data_batch is not None:
            prev.data_batch.wait()

    def _charge(self, key: StashKey, inc: _Incoming) -> None:
        """Count a just-allocated receive buffer: hosted for an ACCEPT, own (stand-in key) for a LOAD."""
        assert inc.flat is not None
        stash = self.ctx.stash
        if inc.role is _K.ACCEPT:
            stash.host(key, None, inc.flat)
        elif inc.flat.numel():
            stash.hold(loading_key(key), inc.flat)
            self.loading[key] = inc.flat

    # -- posting ---------------------------------------------------------------------------------------------
    def transfers(self, a: Action) -> list[Posting]:
        """The messages one BPipe action posts (an EVICT's or RETURN's batch is kept until its wait point)."""
        ctx = self.ctx
        assert a.peer is not None
        peer, grp = ctx.groups.global_rank(a.peer), ctx.groups.bpipe_group
        key = a.key
        what = f"{a.kind.name} stage {a.stage} mb {a.microbatch}"
        if a.kind in (_K.ACCEPT, _K.LOAD):
            inc = _Incoming(a.kind, peer, grp, [ctx.tag(a, part=i, num_parts=_PARTS) for i in range(_PARTS)], what)
            self._before_alloc(inc, key)
            self.incoming[key] = inc
            if a.kind is _K.ACCEPT:
                self.last_accept = key
            unit = self._unit(key)
            if unit not in self.known:  # a new layout: the sizes come first (waited here, where rendezvous blocks)
                header = torch.zeros(2, dtype=torch.int64, device=ctx.device)
                post_batch([Transfer(send=False, tensor=header, peer=peer, group=grp, tag=inc.tags[0], what=what)],
                           timeout_s=ctx.groups.timeout_s).wait()
                n_meta, n_flat = (int(v) for v in header.tolist())
                if a.kind is _K.ACCEPT:
                    self.sizes[unit] = (n_meta, n_flat)
            else:
                n_meta, n_flat = self.sizes[unit]
            made = self._data_transfers(inc, n_meta, n_flat)
            self._charge(key, inc)  # the buffer exists from here on

            def on_data(batch: PendingBatch) -> None:
                inc.data_batch = batch
            return [(t, on_data) for t in made]
        if a.kind is _K.EVICT:
            meta, flat = self._evict(key)
            meta_t = meta.to_tensor().to(ctx.device)
            self._check_size(key, meta_t.numel(), flat.numel())
        else:
            meta_t, flat = self._unhost(key)
        parts: tuple[torch.Tensor, ...] = (meta_t, flat)
        if self._unit(key) not in self.known:
            parts = (torch.tensor([meta_t.numel(), flat.numel()], dtype=torch.int64, device=ctx.device), *parts)
        first = _PARTS - len(parts)
        pending = self.evicts if a.kind is _K.EVICT else self.returns

        def keep(batch: PendingBatch) -> None:
            pending.append(batch)
        return [(Transfer(send=True, tensor=t, peer=peer, group=grp, tag=ctx.tag(a, part=first + i, num_parts=_PARTS),
                          what=what), keep if i == 0 else None)
                for i, t in enumerate(parts)]

    def _unit(self, key: StashKey) -> tuple[int, Hashable]:
        """The (stage, micro-batch layout) pair whose units share one size."""
        return key[0], self.ctx.layouts[key[1]]

    def _check_size(self, key: StashKey, n_meta: int, n_flat: int) -> None:
        unit = self._unit(key)
        if unit not in self.known:
            self.sizes[unit] = (n_meta, n_flat)
        elif self.sizes[unit] != (n_meta, n_flat):
            raise RuntimeError(f"BPipe unit of stage {key[0]} mb {key[1]} is {n_flat} bytes ({n_meta} meta), an "
                               f"earlier unit of its layout was {self.sizes[unit]}; units of one layout must keep "
                               "their size")

    def _data_transfers(self, inc: _Incoming, n_meta: int, n_flat: int) -> list[Transfer]:
        dev = self.ctx.device
        inc.meta_buf = torch.empty(n_meta, dtype=torch.int64, device=dev)
        inc.flat = torch.empty(n_flat, dtype=torch.uint8, device=dev)
        return [Transfer(send=False, tensor=b, peer=inc.peer, group=inc.group, tag=inc.tags[1 + i], what=inc.what)
                for i, b in enumerate((inc.meta_buf, inc.flat))]

    def _evict(self, key: StashKey) -> tuple[StashMeta, torch.Tensor]:
        ctx, stash = self.ctx, self.ctx.stash
        sent = ctx.mail.output_sends.pop(key, None)
        if sent is not None:  # the stage output may be one of the storages dropped in place: send it first
            sent.wait_sends()
        if key in stash.keys():
            meta, flat = stash.export(key)
            stash.drop(key)
        else:  # nothing kept (a recomputed first stage keeps only its token ids, which are not activations)
            meta, flat = StashMeta(key=key, storage_bytes=()), torch.empty(0, dtype=torch.uint8, device=ctx.device)
        ctx.evicted_bytes += flat.numel()
        return meta, flat

    def _unhost(self, key: StashKey) -> tuple[torch.Tensor, torch.Tensor]:
        self._complete(key)
        inc = self.incoming.pop(key)
        _, flat = self.ctx.stash.unhost(key)
        assert inc.meta_buf is not None
        return inc.meta_buf, flat

    # -- receiving -------------------------------------------------------------------------------------------
    def _complete(self, key: StashKey) -> tuple[StashMeta, torch.Tensor]:
        inc = self.incoming[key]
        assert inc.data_batch is not None and inc.meta_buf is not None and inc.flat is not None
        inc.data_batch.wait()
        return StashMeta.from_tensor(inc.meta_buf), inc.flat

    def before_backward(self, key: StashKey) -> None:
        """Make a loaded unit usable again before its stage's RECOMPUTE or backward (no-op if never evicted)."""
        inc = self.incoming.get(key)
        if inc is None or inc.role is not _K.LOAD:
            return
        meta, flat = self._complete(key)
        del self.incoming[key]
        stash = self.ctx.stash
        if self.loading.pop(key, None) is not None:  # the unit's own charge replaces the buffer's
            stash.release_all_of(loading_key(key))
        if key in stash.keys():  # dropped at EVICT (possibly an empty unit)
            stash.restore(key, meta, flat)

    def finish(self) -> None:
        """End of step: wait the last evictions and returns; every unit came back (the schedule returns
        everything it evicted)."""
        self._wait_sends(self.evicts)
        self._wait_sends(self.returns)
        left = sorted(self.incoming)
        assert not left, f"BPipe units never returned/loaded: {left}"
        assert not self.loading, f"LOAD buffers never restored: {sorted(self.loading)}"


def _post(a: Action, ctx: StepContext) -> list[Posting]:
    ops = ctx.addons["bpipe"]
    assert isinstance(ops, BpipeOps)
    return ops.transfers(a)


def _make_ops(ctx: StepContext, kept: dict[Any, Any]) -> BpipeOps:
    """This step's :class:`BpipeOps`; unit sizes are learned at the first sight of each (stage, layout) pair and
    kept across steps."""
    return BpipeOps(ctx, kept)


for _kind in sorted(BPIPE_KINDS, key=lambda k: k.code):
    register_handler(_kind, Handler(owner="bpipe", phase=Phase.EXTENSION, post=_post))
register_addon("bpipe", _make_ops)
