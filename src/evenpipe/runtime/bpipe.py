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
``uint8`` buffer. Sizes are learned on the first step of each micro-batch shape: that step prefixes every unit
with an ``int64[2]`` header (meta length, flat length); the receiver posts the header receive where ACCEPT/LOAD
stands and the data receives once it sees the header (polled between actions). Every later step posts the data
receives directly where ACCEPT/LOAD stands, with buffers of the learned sizes, so the acceptor's memory is taken
exactly there (as the simulator assumes) and the transfer overlaps compute; a unit whose size changed is an
error. Data is waited just before it is needed (LOAD: before the stage's RECOMPUTE or backward; ACCEPT: at
RETURN). The sender posts everything at once.

Caveat (untested, no GPU here): on NCCL the first step's lazily posted data receives share the BPipe
communicator's stream with that rank's own BPipe sends, which can serialise them; later steps post in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from evenpipe.runtime.comm import PendingBatch, Transfer, post_batch
from evenpipe.schedule.ir import Action, ActionKind

if TYPE_CHECKING:
    from evenpipe.runtime.executor import _StepRun

__all__ = ["BpipeOps"]

_K = ActionKind


def _empty_unit(key: tuple[int, int]) -> Any:
    from evenpipe.runtime.stash import StashMeta
    return StashMeta(key=key, storage_bytes=())


def _meta_from(t: torch.Tensor) -> Any:
    from evenpipe.runtime.stash import StashMeta
    return StashMeta.from_tensor(t)


Sizes = dict[int, tuple[int, int]]
"""Per evicted stage: (meta length in int64 elements, flat length in bytes) of its units."""


@dataclass(slots=True)
class _Incoming:
    role: ActionKind
    peer: int
    group: object
    tag: int
    what: str
    header_batch: PendingBatch | None = None
    header: torch.Tensor | None = None
    data_batch: PendingBatch | None = None
    meta_buf: torch.Tensor | None = None
    flat: torch.Tensor | None = None
    hosted: bool = False


class BpipeOps:
    """BPipe transfers of one step on one rank (created by the executor's step run)."""

    def __init__(self, run: "_StepRun", sizes: Sizes, learning: bool) -> None:
        self.run = run
        self.sizes = sizes
        self.learning = learning
        self.incoming: dict[tuple[int, int], _Incoming] = {}

    # -- posting ---------------------------------------------------------------------------------------------
    def _tag(self, a: Action, part: int) -> int:
        back = a.kind in (_K.RETURN, _K.LOAD)
        return ((a.stage * self.run.ex.schedule.num_microbatches + a.microbatch) * 2 + int(back)) * 3 + part

    def transfers(self, a: Action) -> list[tuple[Transfer, Any]]:
        """The messages one BPipe action posts."""
        ex = self.run.ex
        assert a.peer is not None
        peer, grp = ex.groups.global_rank(a.peer), ex.groups.bpipe_group
        key = a.key
        what = f"{a.kind.name} stage {a.stage} mb {a.microbatch}"
        if a.kind in (_K.ACCEPT, _K.LOAD):
            inc = _Incoming(a.kind, peer, grp, self._tag(a, 0), what)
            self.incoming[key] = inc
            if self.learning:
                inc.header = torch.zeros(2, dtype=torch.int64, device=ex.device)

                def on_header(batch: PendingBatch) -> None:
                    inc.header_batch = batch
                return [(Transfer(send=False, tensor=inc.header, peer=peer, group=grp, tag=inc.tag, what=what),
                         on_header)]
            n_meta, n_flat = self.sizes[a.stage]
            made = self._data_transfers(inc, n_meta, n_flat)
            if a.kind is _K.ACCEPT:  # the buffer exists from here on: count it as hosted now
                assert inc.flat is not None
                ex.stash.host(key, None, inc.flat)
                inc.hosted = True

            def on_data(batch: PendingBatch) -> None:
                inc.data_batch = batch
            return [(t, on_data) for t in made]
        if a.kind is _K.EVICT:
            meta, flat = self._evict(key)
            meta_t = meta.to_tensor().to(ex.device)
            self._check_size(a.stage, meta_t.numel(), flat.numel())
        else:
            meta_t, flat = self._unhost(key)
        parts: tuple[torch.Tensor, ...] = (meta_t, flat)
        if self.learning:
            parts = (torch.tensor([meta_t.numel(), flat.numel()], dtype=torch.int64, device=ex.device), *parts)
        first = 0 if self.learning else 1
        return [(Transfer(send=True, tensor=t, peer=peer, group=grp, tag=self._tag(a, first + i), what=what), None)
                for i, t in enumerate(parts)]

    def _check_size(self, stage: int, n_meta: int, n_flat: int) -> None:
        if self.learning:
            self.sizes[stage] = (n_meta, n_flat)
        elif self.sizes.get(stage) != (n_meta, n_flat):
            raise RuntimeError(f"BPipe unit of stage {stage} is {n_flat} bytes ({n_meta} meta), the first step's "
                               f"was {self.sizes.get(stage)}; units must keep their size between steps")

    def _data_transfers(self, inc: _Incoming, n_meta: int, n_flat: int) -> list[Transfer]:
        dev = self.run.ex.device
        inc.meta_buf = torch.empty(n_meta, dtype=torch.int64, device=dev)
        inc.flat = torch.empty(n_flat, dtype=torch.uint8, device=dev)
        return [Transfer(send=False, tensor=b, peer=inc.peer, group=inc.group, tag=inc.tag + 1 + i, what=inc.what)
                for i, b in enumerate((inc.meta_buf, inc.flat))]

    def _evict(self, key: tuple[int, int]) -> tuple[Any, torch.Tensor]:
        run, stash = self.run, self.run.ex.stash
        sent = run.output_sends.pop(key, None)
        if sent is not None:  # the stage output may be one of the storages dropped in place: send it first
            sent.wait()
        if key in stash.keys():
            meta, flat = stash.export(key)
            stash.drop(key)
        else:  # nothing kept (a recomputed first stage keeps only its token ids, which are not activations)
            meta, flat = _empty_unit(key), torch.empty(0, dtype=torch.uint8, device=run.ex.device)
        run.evicted_bytes += flat.numel()
        return meta, flat

    def _unhost(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        self._complete(key)
        inc = self.incoming.pop(key)
        _, flat = self.run.ex.stash.unhost(key)
        assert inc.meta_buf is not None
        return inc.meta_buf, flat

    # -- receiving -------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """First step: post the data receives of every unit whose header has arrived; host arrived units."""
        for key, inc in self.incoming.items():
            if inc.data_batch is None and inc.header_batch is not None and inc.header_batch.is_completed():
                self._post_data(key, inc)
            if (inc.role is _K.ACCEPT and not inc.hosted and inc.data_batch is not None
                    and inc.data_batch.is_completed()):
                self._host(key, inc)

    def _post_data(self, key: tuple[int, int], inc: _Incoming) -> None:
        assert inc.header_batch is not None and inc.header is not None
        inc.header_batch.wait()
        n_meta, n_flat = (int(v) for v in inc.header.tolist())
        if inc.role is _K.ACCEPT:
            self.sizes[key[0]] = (n_meta, n_flat)
        inc.data_batch = post_batch(self._data_transfers(inc, n_meta, n_flat), timeout_s=self.run.ex.groups.timeout_s)

    def _complete(self, key: tuple[int, int]) -> tuple[Any, torch.Tensor]:
        inc = self.incoming[key]
        if inc.data_batch is None:
            self._post_data(key, inc)
        assert inc.data_batch is not None and inc.meta_buf is not None and inc.flat is not None
        inc.data_batch.wait()
        if inc.role is _K.ACCEPT and not inc.hosted:
            self._host(key, inc)
        return _meta_from(inc.meta_buf), inc.flat

    def _host(self, key: tuple[int, int], inc: _Incoming) -> None:
        assert inc.meta_buf is not None and inc.flat is not None
        self.run.ex.stash.host(key, None, inc.flat)
        inc.hosted = True

    def before_backward(self, key: tuple[int, int]) -> None:
        """Make a loaded unit usable again before its stage's RECOMPUTE or backward (no-op if never evicted)."""
        inc = self.incoming.get(key)
        if inc is None or inc.role is not _K.LOAD:
            return
        meta, flat = self._complete(key)
        del self.incoming[key]
        if key in self.run.ex.stash.keys():  # dropped at EVICT (possibly an empty unit)
            self.run.ex.stash.restore(key, meta, flat)

    def finish(self) -> None:
        """End of step: every unit came back (the schedule returns everything it evicted)."""
        left = sorted(self.incoming)
        assert not left, f"BPipe units never returned/loaded: {left}"
