"""Process groups and point-to-point transfers for the pipeline executor.

Vocabulary: the *world* holds ``dp x pp x tp`` processes (maybe more when tests run several cases inside one
world); :mod:`evenpipe.runtime.mesh` lays them out as a device mesh and creates the groups: per pipeline (same
data- and tensor-parallel coordinates) a pipeline group (activations and gradients) and a separate BPipe group
(evicted activations, so they never reorder with pipeline messages) and an embedding group of its first and last
rank (tied weights), per stage a tensor-parallel group, and per pipeline and tensor-parallel rank a data-parallel
group across replicas (gradient reduction).

All waits go through :func:`wait_all`, which turns a timeout or a dead peer into a :class:`PeerFailure` naming
the transfer that failed, so a rank whose peer raised fails with a clear message instead of hanging forever.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from evenpipe.runtime.mesh import DEFAULT_TIMEOUT_S, ParallelGroups, build_parallel_groups  # the groups' owner

__all__ = [
    "PeerFailure",
    "ParallelGroups",
    "Transfer",
    "PendingBatch",
    "init_from_env",
    "build_groups",
    "post_batch",
    "wait_all",
    "WaitObserver",
    "observe_waits",
    "observed",
    "collective",
    "through_flat",
    "DEFAULT_TIMEOUT_S",
]


class PeerFailure(RuntimeError):
    """A transfer or collective did not complete: a peer failed, exited or timed out."""

    def __init__(self, message: str, *, posting: str = "") -> None:
        super().__init__(message)
        self.posting = posting
        """The transfers being posted when it failed (``SEND_F stage 1 mb 0 to rank 2``), "" when waiting."""


def init_from_env(backend: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def build_groups(pp: int, dp: int, *, tp: int = 1, base: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelGroups | None:
    """The groups of a ``dp x pp x tp`` layout from global rank ``base`` (see :mod:`evenpipe.runtime.mesh`).

    Collective over the whole world: every process must call it with the same arguments, including those
    outside the layout, which get ``None``. Groups are cached, so tests can run many cases in one world.
    """
    return build_parallel_groups(pp, dp, tp, base=base, timeout_s=timeout_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One point-to-point message to post: send or receive ``tensor`` with global rank ``peer``."""

    send: bool
    """True for isend, False for irecv."""
    tensor: torch.Tensor
    """The payload (send) or the buffer to fill (receive)."""
    peer: int
    """Global rank of the other side."""
    group: Any
    """Process group both sides use."""
    tag: int = 0
    """Message tag (honoured by gloo; NCCL matches by posting order, which the schedule validator guarantees)."""
    what: str = ""
    """Human-readable name for error messages, e.g. ``RECV_F stage 2 mb 3``."""


class PendingBatch:
    """The works of one ``batch_isend_irecv`` call; waited once, as a whole."""

    __slots__ = ("works", "transfers", "done", "timeout_s", "observers")

    def __init__(self, works: Sequence[Any], transfers: Sequence[Transfer], timeout_s: float) -> None:
        self.works = list(works)
        self.transfers = tuple(transfers)
        self.done = False
        self.timeout_s = timeout_s
        self.observers: list[tuple[torch.Tensor | None, Callable[[float, float], None]]] = []
        """``(buffer, observer)``: ``observer(wait_start, done_at)`` (``time.perf_counter`` seconds) is called
        once, when the receive into ``buffer`` (``None``: the whole batch) is first seen complete;
        ``wait_start == done_at`` when it was found complete without blocking."""

    def observe(self, observer: Callable[[float, float], None], buffer: torch.Tensor | None = None) -> None:
        """Register a completion observer (used by tracing; it must not hold the batch or its tensors) of the
        receive into ``buffer``, or of the whole batch. gloo's works report completion only once waited, and a
        receive is waited alone (:meth:`wait_for`) while a send of its batch may be waited a compute later, so
        only a per-receive observer learns when the rank stopped waiting for that receive."""
        self.observers.append((buffer, observer))

    def _notify(self, wait_start: float, buffer: torch.Tensor | None = None) -> None:
        """Call the observers of the receive into ``buffer`` (``None``: every observer)."""
        now = time.perf_counter()
        kept = []
        for buf, observer in self.observers:
            if buffer is None or buf is buffer:
                observer(min(wait_start, now), now)
            else:
                kept.append((buf, observer))
        self.observers = kept

    def wait(self) -> None:
        if not self.done:
            wait_all([self])

    def wait_for(self, buffer: torch.Tensor) -> None:
        """Wait for the receive into ``buffer`` only (gloo: one work per transfer), not for the batch's other
        messages: a receive batched with one for a later compute must not wait for that one's sender. A
        coalesced batch (NCCL: one work for all) is waited whole. The receive's own observers fire now, the
        whole batch's once it is seen complete as a whole."""
        if self.done:
            return
        at = next((k for k, t in enumerate(self.transfers) if t.tensor is buffer), None)
        if at is None or len(self.works) != len(self.transfers):
            wait_all([self])
            return
        t = self.transfers[at]
        wait_start = time.perf_counter()
        _wait_works([(self.works[at], t.what, t.peer)], self.timeout_s, self.transfers)
        if self.observers:
            self._notify(wait_start, buffer)
            self.is_completed()

    def is_completed(self) -> bool:
        if self.done:
            return True
        if all(w.is_completed() for w in self.works):  # type: ignore[attr-defined]
            if self.observers:
                self._notify(time.perf_counter())
            return True
        return False

    def wait_sends(self) -> None:
        """Wait for this batch's sends only, then drop every reference to their payloads (so a sent activation's
        memory is really freed: gloo's works report completion only once waited).

        gloo returns one work per operation, so the receives of the batch stay pending; a coalesced batch (NCCL:
        one work for all operations) is waited whole."""
        if self.done:
            self.transfers = tuple(t for t in self.transfers if not t.send)
            return
        if len(self.works) != len(self.transfers):
            wait_all([self])
            self.transfers = tuple(t for t in self.transfers if not t.send)
            return
        sends = PendingBatch([w for w, t in zip(self.works, self.transfers) if t.send],
                             [t for t in self.transfers if t.send], self.timeout_s)
        wait_all([sends])
        kept = [(w, t) for w, t in zip(self.works, self.transfers) if not t.send]
        self.works = [w for w, _ in kept]
        self.transfers = tuple(t for _, t in kept)
        self.done = not self.works


def post_batch(transfers: Sequence[Transfer], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> PendingBatch:
    """Post sends and receives of one process group together (NCCL needs them grouped to avoid deadlock).

    ``timeout_s`` bounds the later wait (gloo's point-to-point works otherwise wait forever)."""
    groups = {id(t.group) for t in transfers}
    assert len(groups) == 1, "one batch per process group"
    ops = [dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer, t.group, t.tag) for t in transfers]
    try:
        works = list(dist.batch_isend_irecv(ops)) if ops else []
    except RuntimeError as e:
        what = ", ".join(f"{t.what} {'to' if t.send else 'from'} rank {t.peer}" for t in transfers)
        raise PeerFailure(f"posting {what} failed: {_first_line(e)}", posting=what) from e
    return PendingBatch(works, transfers, timeout_s)


class WaitObserver(Protocol):
    """Told when a wait on a named transfer begins and ends (the training watchdog)."""

    def begin_wait(self, what: str, peer: int) -> None: ...
    def end_wait(self) -> None: ...


_observer: WaitObserver | None = None


def observe_waits(observer: WaitObserver | None) -> None:
    """Report every later wait of this process to ``observer`` (None: to nobody)."""
    global _observer
    _observer = observer


@contextlib.contextmanager
def observed(what: str, peer: int = -1) -> Iterator[None]:
    """Report a blocking call that is not a transfer wait (a collective) to the observer; ``peer`` -1: a group."""
    obs = _observer
    if obs is not None:
        obs.begin_wait(what, peer)
    yield
    if obs is not None:
        obs.end_wait()


@contextlib.contextmanager
def collective(what: str, peer: int = -1) -> Iterator[None]:
    """A blocking collective named ``what`` (e.g. ``the loss broadcast``): reported to the observer like
    :func:`observed`, and a ``RuntimeError`` from inside (a dead peer, a timeout) becomes a :class:`PeerFailure`
    that names it."""
    try:
        with observed(what, peer):
            yield
    except PeerFailure:
        raise
    except RuntimeError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise PeerFailure(f"rank {rank}: {what} failed: {_first_line(e)}") from e


def through_flat(tensors: Sequence[torch.Tensor], run: Callable[[torch.Tensor], None], *,
                 dtype: torch.dtype | None = None) -> None:
    """Run ``run`` (a collective, in place) once on one flat buffer holding every tensor of ``tensors`` (cast to
    ``dtype`` when given), then copy the result back into each tensor."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) if dtype is None else t.reshape(-1).to(dtype) for t in tensors])
    run(flat)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _named_works(b: PendingBatch) -> list[tuple[Any, str, int]]:
    """Each work of a batch with the transfer it completes (gloo: one work per transfer; else the whole batch)."""
    if len(b.works) == len(b.transfers):
        return [(w, t.what, t.peer) for w, t in zip(b.works, b.transfers)]
    return [(w, ", ".join(t.what for t in b.transfers), b.transfers[0].peer if b.transfers else -1)
            for w in b.works]


def wait_all(batches: Sequence[PendingBatch]) -> None:
    """Wait for every batch; a timeout or a dead peer becomes a :class:`PeerFailure` naming the transfer."""
    for b in batches:
        if b.done:
            continue
        wait_start = time.perf_counter()
        _wait_works(_named_works(b), b.timeout_s, b.transfers)
        b.done = True
        b.works = []
        if b.observers:
            b._notify(wait_start)


def _wait_works(works: Sequence[tuple[Any, str, int]], timeout_s: float, transfers: Sequence[Transfer]) -> None:
    """Wait for each ``(work, name, peer)``, telling the watchdog; a timeout or a dead peer becomes a
    :class:`PeerFailure` naming ``transfers``."""
    obs = _observer
    try:
        for w, what, peer in works:
            if obs is not None:
                obs.begin_wait(what, peer)
            w.wait(datetime.timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
            if obs is not None:
                obs.end_wait()
    except RuntimeError as e:
        names = ", ".join(f"{t.what} (rank {t.peer})" for t in transfers)
        raise PeerFailure(f"rank {dist.get_rank()}: waiting for {names} failed, a peer probably failed or "
                          f"timed out: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
