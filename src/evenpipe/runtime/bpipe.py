"""BPipe's evict/accept/return/load actions, executed on the pipeline replica's separate BPipe process group.

An *evictor* (rank x) sends one micro-batch's activation unit of one stage to its *acceptor* (rank p-1-x) and
frees it; the acceptor holds it; before the backward the acceptor returns it and the evictor loads it back.

What travels: the stash's ``export(key)``, every unique storage of the unit (what autograd saved in the stage's
forward plus the tensors the executor holds for it: received input, kept output) as one flat ``uint8`` buffer,
with its small picklable ``StashMeta``. ``drop`` frees those storages in place, so the graph's and the
executor's own references really lose their memory, and ``restore`` refills them. Under recomputation the unit
holds only the stage input, so only the stage input travels (a recomputed first stage keeps nothing but token
ids, which are not activations: its unit is empty). The stage output's send is waited before the drop, since
the drop may free the storage being sent.

Wire format, per unit, all on the BPipe group: an ``int64[2]`` header ``(meta bytes, flat bytes)``, then the
pickled meta, then the flat buffer. The receiver posts the header receive where ACCEPT/LOAD stands, posts the two
data receives as soon as it sees the header arrive (polled between actions), and waits for them just before the
data is needed (LOAD: before the stage's RECOMPUTE or backward; ACCEPT: at RETURN). The sender posts all three at
once, so transfers overlap compute on both sides.
"""

from __future__ import annotations

import pickle
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


@dataclass(slots=True)
class _Incoming:
    header_batch: PendingBatch
    header: torch.Tensor
    role: ActionKind
    data_batch: PendingBatch | None = None
    meta_buf: torch.Tensor | None = None
    flat: torch.Tensor | None = None
    hosted: bool = False


class BpipeOps:
    """BPipe transfers of one step on one rank (created by the executor's step run)."""

    def __init__(self, run: "_StepRun") -> None:
        self.run = run
        self.incoming: dict[tuple[int, int], _Incoming] = {}

    # -- posting ---------------------------------------------------------------------------------------------
    def _tag(self, a: Action, part: int) -> int:
        back = a.kind in (_K.RETURN, _K.LOAD)
        return ((a.stage * self.run.ex.schedule.num_microbatches + a.microbatch) * 2 + int(back)) * 3 + part

    def transfers(self, a: Action) -> list[tuple[Transfer, Any]]:
        """The messages one BPipe action posts (three sends, or one header receive)."""
        ex = self.run.ex
        assert a.peer is not None
        peer, grp = ex.groups.global_rank(a.peer), ex.groups.bpipe_group
        key = a.key
        what = f"{a.kind.name} stage {a.stage} mb {a.microbatch}"
        if a.kind in (_K.ACCEPT, _K.LOAD):
            header = torch.zeros(2, dtype=torch.int64, device=ex.device)

            def on_posted(batch: PendingBatch) -> None:
                self.incoming[key] = _Incoming(batch, header, a.kind)
            return [(Transfer(send=False, tensor=header, peer=peer, group=grp, tag=self._tag(a, 0), what=what),
                     on_posted)]
        meta, flat = self._evict(key) if a.kind is _K.EVICT else self._unhost(key)
        meta_bytes = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(ex.device)
        header = torch.tensor([meta_bytes.numel(), flat.numel()], dtype=torch.int64, device=ex.device)
        return [(Transfer(send=True, tensor=t, peer=peer, group=grp, tag=self._tag(a, i), what=what), None)
                for i, t in enumerate((header, meta_bytes, flat))]

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

    def _unhost(self, key: tuple[int, int]) -> tuple[Any, torch.Tensor]:
        self._complete(key)
        self.incoming.pop(key)
        meta, flat = self.run.ex.stash.unhost(key)
        return meta, flat

    # -- receiving -------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Post the data receives of every unit whose header has arrived; host accepted units that arrived."""
        for key, inc in self.incoming.items():
            if inc.data_batch is None and inc.header_batch.is_completed():
                self._post_data(key, inc)
            if (inc.role is _K.ACCEPT and not inc.hosted and inc.data_batch is not None
                    and inc.data_batch.is_completed()):
                self._host(key, inc)

    def _post_data(self, key: tuple[int, int], inc: _Incoming) -> None:
        ex = self.run.ex
        inc.header_batch.wait()
        n_meta, n_flat = (int(v) for v in inc.header.tolist())
        inc.meta_buf = torch.empty(n_meta, dtype=torch.uint8, device=ex.device)
        inc.flat = torch.empty(n_flat, dtype=torch.uint8, device=ex.device)
        t = inc.header_batch.transfers[0]
        tags = [t.tag + 1, t.tag + 2]
        inc.data_batch = post_batch([Transfer(send=False, tensor=b, peer=t.peer, group=t.group, tag=tag, what=t.what)
                                     for b, tag in zip((inc.meta_buf, inc.flat), tags)],
                                    timeout_s=ex.groups.timeout_s)

    def _complete(self, key: tuple[int, int]) -> tuple[Any, torch.Tensor]:
        inc = self.incoming[key]
        if inc.data_batch is None:
            self._post_data(key, inc)
        assert inc.data_batch is not None and inc.meta_buf is not None and inc.flat is not None
        inc.data_batch.wait()
        if inc.role is _K.ACCEPT and not inc.hosted:
            self._host(key, inc)
        return pickle.loads(inc.meta_buf.cpu().numpy().tobytes()), inc.flat

    def _host(self, key: tuple[int, int], inc: _Incoming) -> None:
        assert inc.meta_buf is not None and inc.flat is not None
        meta = pickle.loads(inc.meta_buf.cpu().numpy().tobytes())
        self.run.ex.stash.host(key, meta, inc.flat)
        inc.hosted = True
        inc.flat = None  # the stash holds it now

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
