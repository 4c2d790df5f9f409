"""The activation stash: capture, count, export, drop and restore what autograd saves for backward.

One stash per rank. Every stage forward (and every recompute) runs inside ``stash.capture((stage, mb))``;
the stash is then both the *measurement* of activation memory for every schedule and the thing BPipe's
evict/load moves. It knows nothing about communication: the executor ships the flat buffer.

Design (why ``torch.autograd.graph.saved_tensors_hooks``)
--------------------------------------------------------
- **What counts as an activation**: exactly the tensors autograd saves for backward (the pack hook sees each
  one), plus tensors the executor keeps on purpose and declares with :meth:`ActivationStash.hold` (a received
  stage input, a kept stage output, the input kept for recomputation). Nothing else of the graph holds
  tensor memory, so this is the activation memory of a micro-batch on a stage, measured rather than modelled.
  Module wrappers (``torch.utils.checkpoint``-style) would only see stage boundaries; the allocator's
  counters cannot tell micro-batches apart.
- **What is not**: parameters and buffers. They are recognised by storage identity with the parameters and
  buffers of the modules given to the stash (this also catches views such as the ``weight.t()`` a linear layer
  saves), and any ``nn.Parameter`` is recognised by type. ``is_leaf and requires_grad`` would not do: a
  received stage input is such a leaf and *is* an activation. Non-activation tensors pass through the hooks
  untouched; a DTensor (tensor parallelism, FSDP) is counted and moved by its local shard and rebuilt from
  its spec on unpack; other tensor subclasses and non-strided layouts pass through (they are not counted).
- **Dedupe by untyped storage**: a saved tensor is recorded as (its storage, dtype, storage offset, size,
  stride); storages are keyed by the identity of their ``StorageImpl`` (``untyped_storage()._cdata``, stable
  for the storage's life, unlike ``data_ptr`` which changes on resize). A tensor saved twice, or a view of
  another saved or held tensor, costs its storage once, and unpack rebuilds each view on the storage with
  ``Tensor.set_(storage, offset, size, stride)`` (an as_strided view).
- **Lifetime**: each saved tensor is represented in the graph by a small handle; when autograd frees it (after
  the backward node ran, or with the graph) the storage's count drops and, at zero and not held, the stash lets
  the storage go. So the counters follow real lifetimes, including the ``I``/``W`` split of zero-bubble.
- **Evict / load**: :meth:`export` copies the key's unique storages into one flat ``uint8`` buffer;
  :meth:`drop` then frees them *in place* with ``UntypedStorage.resize_(0)`` (as FSDP frees flat parameters).
  In place matters: the autograd graph and the executor still reference those tensors (a leaf input is kept
  alive by its ``AccumulateGrad`` node), so freeing our references alone would free nothing. :meth:`restore`
  resizes each storage back and copies the bytes in; every handle, the graph and the executor's own tensors
  see identical values again. Unpacking a dropped key raises :class:`StashError`.
- **Host offload**: the same three steps with the buffer in host memory: ``export(key, to_host=True)`` (pinned
  and asynchronous on a GPU), :meth:`drop` (told the copying stream, so the memory is reused only after the copy),
  :meth:`shelve` keeps the host copy, counted apart (:attr:`offloaded_bytes`: host memory, not the device's),
  until :meth:`unshelve` and :meth:`restore` bring it back.

Recomputation: :func:`forward_for_recompute` runs the stage under ``torch.no_grad`` and holds only the input;
:func:`recompute_forward` re-runs it with grad inside ``capture`` (same RNG state) just before backward.

Executor sketch (one stash per rank, ``key = (stage, mb)``)::

    stash = ActivationStash(stage_modules.values())
    stash.hold(key, x)                       # F: the received input (tokens on stage 0)
    with stash.capture(key): y = stage(x)     #    everything autograd saves is now counted under key
    meta, flat = stash.export(key); stash.drop(key)      # EVICT (after y's send completed); ship flat
    stash.host(key, meta, flat) ... stash.unhost(key)    # ACCEPT / give back, on the partner
    stash.restore(key, meta, flat)            # LOAD, before the backward
    y.backward(grad); stash.release_all_of(key)           # B (or after W with the zero-bubble split)

Rules for the executor: do not drop a key while an asynchronous operation still reads one of its tensors (wait
for the stage output's send first); a storage shared by two live keys cannot be dropped (it would corrupt the
other key): hand the next stage a copy instead.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from evenpipe.errors import EvenpipeError
from evenpipe.runtime.tensor_parallel import local_shard

__all__ = [
    "ActivationStash",
    "StashMeta",
    "StashError",
    "StashKey",
    "RngSnapshot",
    "forward_for_recompute",
    "recompute_forward",
]

StashKey = tuple[int, int]
"""``(stage, micro-batch)``."""


class StashError(EvenpipeError):
    """The stash was used out of order (unpack after drop, restore with a foreign buffer, ...)."""


def _key_text(key: StashKey) -> str:
    return f"stage {key[0]} micro-batch {key[1]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class StashMeta:
    """What :meth:`ActivationStash.export` produced: enough to check and restore the flat buffer.

    To ship it, ``to_tensor()`` gives ``int64 [stage, mb, n, bytes_0 .. bytes_{n-1}]`` (send its length first,
    or keep the meta on the evictor: the acceptor only needs ``total_bytes`` to allocate the buffer)."""

    key: StashKey
    """``(stage, micro-batch)`` the buffer belongs to."""
    storage_bytes: tuple[int, ...]
    """Byte size of each unique storage, in buffer order."""

    @property
    def total_bytes(self) -> int:
        """Length of the flat buffer."""
        return sum(self.storage_bytes)

    def to_tensor(self) -> torch.Tensor:
        """``int64 [stage, mb, n, *storage_bytes]`` for sending."""
        return torch.tensor([self.key[0], self.key[1], len(self.storage_bytes), *self.storage_bytes],
                            dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StashMeta":
        """Inverse of :meth:`to_tensor`."""
        values = [int(v) for v in t.to("cpu", torch.int64).tolist()]
        if len(values) < 3 or len(values) != 3 + values[2]:
            raise StashError(f"not a stash meta tensor: {values[:8]}")
        return cls(key=(values[0], values[1]), storage_bytes=tuple(values[3:]))


class _Slot:
    """One unique storage of a key: how many saved handles and holds refer to it."""

    __slots__ = ("storage", "nbytes", "saved", "held")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.saved = 0
        self.held = 0


class _KeyState:
    __slots__ = ("key", "slots", "dropped", "released", "exported")

    def __init__(self, key: StashKey) -> None:
        self.key = key
        self.slots: dict[int, _Slot] = {}  # storage identity -> slot, in first-seen order
        self.dropped = False
        self.released = False
        self.exported: tuple[int, ...] | None = None


class _Packed:
    """What the autograd graph holds instead of a saved activation."""

    __slots__ = ("stash", "state", "ident", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, stash: "ActivationStash", state: _KeyState, ident: int, t: torch.Tensor) -> None:
        self.stash, self.state, self.ident = stash, state, ident
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.size(), t.stride()

    def __del__(self) -> None:  # autograd released this saved tensor
        self.stash._unsave(self.state, self.ident)


def _ident(t: torch.Tensor) -> int:
    return int(local_shard(t).untyped_storage()._cdata)


class _PackedDTensor:
    """A saved DTensor: its local tensor goes through the stash like any activation; the spec rebuilds it."""

    __slots__ = ("local", "spec", "requires_grad")

    def __init__(self, local: Any, spec: Any, requires_grad: bool) -> None:
        self.local, self.spec, self.requires_grad = local, spec, requires_grad


@contextlib.contextmanager
def _copy_stream(stream: Any) -> Iterator[None]:
    """Inside, work goes to ``stream`` (a CUDA stream, after the current stream's work so far); None: the
    current stream."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ActivationStash:
    """Saved activations of one rank, keyed by ``(stage, micro-batch)``; see the module docstring.

    ``modules``: the rank's stage modules; their parameters and buffers are never captured or counted.
    """

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._modules: list[nn.Module] = list(modules)
        self._states: dict[StashKey, _KeyState] = {}
        self._refs: dict[int, int] = {}  # storage identity -> number of live (not dropped) keys holding it
        self._hosted: dict[StashKey, tuple[StashMeta | None, torch.Tensor]] = {}
        self._lock = threading.RLock()
        self.own_bytes = 0
        """Bytes of unique storages held by keys that are not dropped (activations on this rank now)."""
        self.hosted_bytes = 0
        """Bytes of partners' buffers hosted now."""
        self._shelved: dict[StashKey, tuple[StashMeta, torch.Tensor]] = {}
        self.offloaded_bytes = 0
        """Bytes of this rank's own activations offloaded to host memory now (not on the device)."""
        self.peak_own_bytes = 0
        self.peak_hosted_bytes = 0
        self.peak_total_bytes = 0
        self.peak_offloaded_bytes = 0

    # ------------------------------------------------------------------ accounting

    def add_modules(self, modules: Iterable[nn.Module]) -> None:
        """Register more modules whose parameters and buffers are not activations."""
        self._modules.extend(modules)

    def _ref(self, ident: int, nbytes: int) -> None:
        count = self._refs.get(ident, 0)
        self._refs[ident] = count + 1
        if count == 0:
            self.own_bytes += nbytes
            self._update_peaks()

    def _unref(self, ident: int, nbytes: int) -> None:
        count = self._refs[ident] - 1
        if count:
            self._refs[ident] = count
        else:
            del self._refs[ident]
            self.own_bytes -= nbytes

    def _update_peaks(self) -> None:
        self.peak_own_bytes = max(self.peak_own_bytes, self.own_bytes)
        self.peak_hosted_bytes = max(self.peak_hosted_bytes, self.hosted_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.own_bytes + self.hosted_bytes)

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current values."""
        with self._lock:
            self.peak_own_bytes, self.peak_hosted_bytes = self.own_bytes, self.hosted_bytes
            self.peak_total_bytes = self.own_bytes + self.hosted_bytes
            self.peak_offloaded_bytes = self.offloaded_bytes

    def bytes_of(self, key: StashKey) -> int:
        """Unique bytes the key holds now (0 when dropped or unknown): one activation unit when measured
        right after a stage's forward."""
        state = self._states.get(key)
        if state is None or state.dropped:
            return 0
        return sum(slot.nbytes for slot in state.slots.values())

    def keys(self) -> list[StashKey]:
        """Keys with own activations (dropped ones included)."""
        return list(self._states)

    def is_empty(self) -> bool:
        """Nothing own, dropped, hosted or offloaded is left."""
        return not self._states and not self._hosted and not self._shelved

    def _excluded(self) -> set[int]:
        return {_ident(t) for m in self._modules for t in (*m.parameters(), *m.buffers())}

    def _state(self, key: StashKey) -> _KeyState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _KeyState(key)
        if state.dropped:
            raise StashError(f"activations of {_key_text(key)} are evicted; restore them before using the key")
        return state

    def _slot(self, state: _KeyState, t: torch.Tensor, ident: int) -> _Slot:
        slot = state.slots.get(ident)
        if slot is None:
            slot = state.slots[ident] = _Slot(t.untyped_storage())
            self._ref(ident, slot.nbytes)
            state.exported = None
        return slot

    def _forget_if_unused(self, state: _KeyState, ident: int) -> None:
        slot = state.slots.get(ident)
        if slot is not None and slot.saved == 0 and slot.held == 0 and not state.dropped:
            del state.slots[ident]
            state.exported = None
            self._unref(ident, slot.nbytes)

    @staticmethod
    def _is_candidate(t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.layout is torch.strided)  # Parameters and subclasses excluded

    # ------------------------------------------------------------------ capture

    @contextlib.contextmanager
    def capture(self, key: StashKey) -> Iterator[None]:
        """Inside, every tensor autograd saves (other than parameters and buffers) belongs to ``key``."""
        with self._lock:
            state = self._state(key)
        excluded = self._excluded()

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight or a view of one
                return t  # (FSDP's gathered parameters appear only inside the forward, after ``excluded`` was
                # taken; under tensor parallelism too, where they and their views are DTensors)
            spec = getattr(t, "_spec", None)
            if spec is not None and type(t) is not torch.Tensor:
                inner = pack(local_shard(t))  # a DTensor: count and move its local shard
                return _PackedDTensor(inner, spec, t.requires_grad) if isinstance(inner, _Packed) else t
            if not self._is_candidate(t):
                return t
            ident = _ident(t)
            if ident in excluded:
                return t
            with self._lock:
                if state.dropped or state.released:
                    raise StashError(f"{_key_text(key)} was evicted or released during its forward")
                self._slot(state, t, ident).saved += 1
            return _Packed(self, state, ident, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _PackedDTensor):
            from torch.distributed.tensor import DTensor
            return DTensor(self._unpack(packed.local), packed.spec, requires_grad=packed.requires_grad)
        if not isinstance(packed, _Packed):
            return packed
        state = packed.state
        if state.released:
            raise StashError(f"activations of {_key_text(state.key)} were released; backward ran twice?")
        if state.dropped:
            raise StashError(f"activations of {_key_text(state.key)} are evicted; restore them before backward")
        storage = state.slots[packed.ident].storage
        out = torch.empty(0, dtype=packed.dtype, device=storage.device)
        return out.set_(storage, packed.offset, packed.size, packed.stride)

    def _unsave(self, state: _KeyState, ident: int) -> None:
        with self._lock:
            slot = state.slots.get(ident)
            if state.released or slot is None:
                return
            slot.saved -= 1
            self._forget_if_unused(state, ident)

    def hold(self, key: StashKey, tensor: torch.Tensor) -> None:
        """Count an executor-held tensor under ``key`` (deduped with what the key saved); it is exported,
        dropped and restored with the key. Undo with :meth:`release`."""
        if not self._is_candidate(tensor) or _ident(tensor) in self._excluded():
            return
        with self._lock:
            self._slot(self._state(key), tensor, _ident(tensor)).held += 1

    def release(self, key: StashKey, tensor: torch.Tensor) -> None:
        """The executor no longer keeps ``tensor`` for ``key``."""
        with self._lock:
            state = self._states.get(key)
            slot = state.slots.get(_ident(tensor)) if state else None
            if state is None or slot is None or slot.held == 0:
                raise StashError(f"release of a tensor that {_key_text(key)} does not hold")
            slot.held -= 1
            self._forget_if_unused(state, _ident(tensor))

    def release_all_of(self, key: StashKey) -> None:
        """After the key's backward: forget everything of it (no-op for an unknown key)."""
        with self._lock:
            state = self._states.pop(key, None)
            if state is None:
                return
            state.released = True
            if not state.dropped:
                for ident, slot in state.slots.items():
                    self._unref(ident, slot.nbytes)
            state.slots = {}

    # ------------------------------------------------------------------ evict / load (own side)

    def export(self, key: StashKey, *, to_host: bool = False) -> tuple[StashMeta, torch.Tensor]:
        """Copy the key's unique storages into one flat ``uint8`` buffer: on their device, or with ``to_host`` in
        host memory (pinned, the copies issued asynchronously on the current stream, when the storages are on a
        GPU: the caller waits for that stream before it reads the buffer)."""
        with self._lock:
            state = self._states.get(key)
            if state is None or state.dropped:
                raise StashError(f"nothing to export for {_key_text(key)}"
                                 + (" (already evicted)" if state else ""))
            slots = list(state.slots.values())
            meta = StashMeta(key=key, storage_bytes=tuple(s.nbytes for s in slots))
            devices = {s.storage.device for s in slots}
            if len(devices) > 1:
                raise StashError(f"{_key_text(key)} has activations on several devices: {sorted(map(str, devices))}")
            device = devices.pop() if devices else torch.device("cpu")
            pinned = to_host and device.type == "cuda"
            flat = torch.empty(meta.total_bytes, dtype=torch.uint8, device="cpu" if to_host else device,
                               pin_memory=pinned)
            offset = 0
            for s in slots:
                flat[offset:offset + s.nbytes].copy_(_bytes_view(s.storage), non_blocking=pinned)
                offset += s.nbytes
            state.exported = tuple(state.slots)
            return meta, flat

    def drop(self, key: StashKey, *, stream: Any = None) -> None:
        """Free the key's storages in place after :meth:`export` (evict). Unpacking raises until restore.
        ``stream``: a CUDA stream still reading the storages (an asynchronous copy to the host); the caching
        allocator hands their memory out again only after the work queued on it so far."""
        with self._lock:
            state = self._states.get(key)
            if state is None or state.dropped:
                raise StashError(f"nothing to drop for {_key_text(key)}" + (" (already evicted)" if state else ""))
            if state.exported != tuple(state.slots):
                raise StashError(f"{_key_text(key)} changed since its export (or was never exported); "
                                 "export right before drop")
            shared = [i for i in state.slots if self._refs[i] > 1]
            if shared:
                raise StashError(f"{_key_text(key)} shares {len(shared)} storage(s) with another key; "
                                 "give the next stage a copy of the output before evicting")
            for ident, slot in state.slots.items():
                if stream is not None:
                    _bytes_view(slot.storage).record_stream(stream)
                slot.storage.resize_(0)
                self._unref(ident, slot.nbytes)
            state.dropped = True

    def restore(self, key: StashKey, meta: StashMeta, flat: torch.Tensor, *, stream: Any = None) -> None:
        """Put back what :meth:`drop` freed (load); unpack works again with identical values. ``stream``: a CUDA
        stream to copy ``flat`` (pinned host memory) in on, asynchronously, after the work queued so far on the
        current stream (which allocates the storages); the caller makes the current stream wait for it before
        the values are used."""
        with self._lock:
            state = self._states.get(key)
            if state is None or not state.dropped:
                raise StashError(f"{_key_text(key)} is not evicted; nothing to restore")
            expected = tuple(s.nbytes for s in state.slots.values())
            if meta.key != key or meta.storage_bytes != expected:
                raise StashError(f"buffer for {_key_text(meta.key)} with storages {meta.storage_bytes[:4]}... does "
                                 f"not match {_key_text(key)} ({len(expected)} storages, {sum(expected)} bytes)")
            if flat.dtype != torch.uint8 or flat.numel() != meta.total_bytes:
                raise StashError(f"restore of {_key_text(key)} needs a uint8 buffer of {meta.total_bytes} bytes, "
                                 f"got {flat.dtype} with {flat.numel()} elements")
            for ident, slot in state.slots.items():
                slot.storage.resize_(slot.nbytes)
                self._ref(ident, slot.nbytes)
            with _copy_stream(stream):
                offset = 0
                for slot in state.slots.values():
                    _bytes_view(slot.storage).copy_(flat[offset:offset + slot.nbytes], non_blocking=stream is not None)
                    offset += slot.nbytes
            state.dropped = False
            for ident in list(state.slots):  # handles autograd freed while evicted
                self._forget_if_unused(state, ident)

    # ------------------------------------------------------------------ host offload (own side)

    def shelve(self, key: StashKey, meta: StashMeta, flat: torch.Tensor) -> None:
        """Keep the host copy of the key's activations (after :meth:`export` to the host and :meth:`drop`) until
        :meth:`unshelve`, counted in :attr:`offloaded_bytes`."""
        with self._lock:
            if key in self._shelved:
                raise StashError(f"{_key_text(key)} is already offloaded")
            self._shelved[key] = (meta, flat)
            self.offloaded_bytes += meta.total_bytes
            self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, self.offloaded_bytes)

    def unshelve(self, key: StashKey) -> tuple[StashMeta, torch.Tensor]:
        """The host copy :meth:`shelve` kept, no longer counted (restore it with :meth:`restore`)."""
        with self._lock:
            if key not in self._shelved:
                raise StashError(f"{_key_text(key)} is not offloaded; offloaded: {sorted(self._shelved)}")
            meta, flat = self._shelved.pop(key)
            self.offloaded_bytes -= meta.total_bytes
            return meta, flat

    # ------------------------------------------------------------------ evict / load (acceptor side)

    def host(self, key: StashKey, meta: StashMeta | None, flat: torch.Tensor) -> None:
        """Keep a partner's evicted buffer (and its meta, when known) until :meth:`unhost`."""
        with self._lock:
            if key in self._hosted:
                raise StashError(f"already hosting {_key_text(key)}")
            self._hosted[key] = (meta, flat)
            self.hosted_bytes += flat.numel() * flat.element_size()
            self._update_peaks()

    def unhost(self, key: StashKey) -> tuple[StashMeta | None, torch.Tensor]:
        """Give back (and stop counting) a hosted buffer."""
        with self._lock:
            if key not in self._hosted:
                raise StashError(f"not hosting {_key_text(key)}; hosting {sorted(self._hosted)}")
            meta, flat = self._hosted.pop(key)
            self.hosted_bytes -= flat.numel() * flat.element_size()
            return meta, flat


# ---------------------------------------------------------------------- recomputation


@dataclass(frozen=True, slots=True)
class RngSnapshot:
    """CPU (and the input's CUDA device) random state before a forward, so a recompute draws the same
    dropout masks."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def take(cls, device: torch.device) -> "RngSnapshot":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with this random state, then put the caller's state back."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def forward_for_recompute(stage: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                          stash: ActivationStash, key: StashKey) -> tuple[torch.Tensor, RngSnapshot]:
    """Forward of a recomputed stage: no autograd graph, the stash holds only ``x`` (its checkpoint).

    Returns the output (to send on; it needs no grad) and the RNG snapshot for :func:`recompute_forward`."""
    rng = RngSnapshot.take(x.device)
    stash.hold(key, x)
    with torch.no_grad():
        out = stage(x)
    return out, rng


def recompute_forward(stage: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                      stash: ActivationStash, key: StashKey, rng: RngSnapshot) -> torch.Tensor:
    """The ``RECOMPUTE`` action: run the stage again on the same ``x`` (restored if it was evicted), with
    grad and the same random state, capturing its saved tensors under ``key``. Backward the returned
    output as usual, then :meth:`ActivationStash.release_all_of` the key (which also drops the hold)."""
    with rng.replay(), stash.capture(key):
        return stage(x)
