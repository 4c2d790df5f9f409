"""Run one rank's schedule actions with torch.distributed: the pipeline executor.

One :meth:`PipelineExecutor.step` is one global batch: replica ``d`` takes its ``1/dp`` slice, splits it into
``num_microbatches`` equal micro-batches and runs its action list in order. Each micro-batch's loss is divided by
the number of micro-batches and the gradients are averaged over replicas, so loss and gradients equal
un-pipelined training on the whole global batch (mean cross-entropy).

Transfers. Consecutive transfer actions of one process group are posted together with ``batch_isend_irecv``
(NCCL needs grouped sends and receives to avoid deadlock). A receive is posted where its action stands and waited
just before the compute that consumes it; pipeline sends are waited lazily (polled between actions, all waited at
the end of the step). BPipe's sends are waited at the points where the simulator frees their memory (see
:mod:`evenpipe.runtime.bpipe`): a ``F``/``R`` first waits for the rank's earlier ``EVICT``s. The schedule validator
guarantees the per-pair posting order matches, so NCCL (which ignores tags) pairs messages right; on gloo every
message also carries a tag naming it.

Shapes. Tensor shapes between stages are learned by a *shape handshake*, not a hand-written list: the first time
a micro-batch shape is seen, every stage runs one no-grad forward on placeholder input (under a forked RNG) in
stage order and sends its output's shape and dtype to the next stage's rank. The result is cached per input
shape; later steps post receives directly.

Memory. ``free_outputs`` replaces a sent output's ``.data`` with an empty tensor (the send keeps the old storage
alive until it completes) and runs backward through the autograd engine directly, which skips the shape check
between the output and its gradient (Megatron's trick). Under recomputation (``RECOMPUTE`` actions in the
schedule) a stage's forward runs without a graph, keeping only its input; ``RECOMPUTE`` rebuilds the graph with
the RNG state the forward saw.

Zero-bubble split. ``I`` runs the autograd engine with respect to the stage input only, keeping the graph and
the gradients that arrive at the nodes where parameter branches leave the input path; ``W`` restarts the engine
from those gradients and runs only the parameter branches (see :mod:`evenpipe.runtime.split_backward`), so ``I``
plus ``W`` cost one backward.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import (ParallelGroups, PendingBatch, PeerFailure, Transfer, collective, post_batch,
                                  through_flat)
from evenpipe.runtime.tensor_parallel import local_shard
from evenpipe.runtime.split_backward import WeightState, backward_input, backward_weight
from evenpipe.runtime.trace import RankRecorder, SendRecord
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.semantics import kind_table

__all__ = ["PipelineExecutor", "StepResult", "LossFn", "Phase", "register_kinds"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(last_stage_output, targets) -> scalar`` mean loss of one micro-batch."""

_K = ActionKind


class Phase(enum.Enum):
    """How the executor's loop runs an action kind (the dispatch from kind to handler)."""

    COMPUTE = "compute: runs stage layers, one at a time"
    PIPE_MESSAGE = "pipeline message: posted with its neighbours in one batch on the pipeline group"
    EXTENSION = "extension message: posted alone by the add-on that registered the kind (BPipe)"
    HOST_MOVE = "host move: saved activations to host memory and back, on this rank"


_CORE_KINDS: dict[ActionKind, Phase] = {
    _K.FORWARD: Phase.COMPUTE, _K.BACKWARD: Phase.COMPUTE, _K.BACKWARD_INPUT: Phase.COMPUTE,
    _K.BACKWARD_WEIGHT: Phase.COMPUTE, _K.RECOMPUTE: Phase.COMPUTE,
    _K.SEND_F: Phase.PIPE_MESSAGE, _K.RECV_F: Phase.PIPE_MESSAGE, _K.SEND_B: Phase.PIPE_MESSAGE,
    _K.RECV_B: Phase.PIPE_MESSAGE, _K.OFFLOAD: Phase.HOST_MOVE, _K.RELOAD: Phase.HOST_MOVE,
}
_EXTENSIONS: dict[ActionKind, str] = {}
"""Kind -> name of the add-on that runs it (registered with :func:`register_kinds`)."""


def register_kinds(owner: str, kinds: "frozenset[ActionKind] | set[ActionKind]") -> None:
    """An add-on (BPipe) declares that it runs ``kinds`` (posted one action at a time, see :class:`Phase`)."""
    for k in kinds:
        assert k not in _CORE_KINDS and _EXTENSIONS.get(k, owner) == owner, f"{k.name} registered twice"
        _EXTENSIONS[k] = owner


def _dispatch() -> tuple[Phase | None, ...]:
    """The executor's kind -> phase table, checked to cover every kind (:func:`kind_table`)."""
    import evenpipe.runtime.bpipe  # noqa: F401  (registers its kinds)
    return kind_table("executor", {**_CORE_KINDS, **{k: Phase.EXTENSION for k in _EXTENSIONS}})
_HANDSHAKE_TAG = 2**30
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one step measured on this rank."""

    loss: float
    """Mean loss over the global batch (the same on every rank)."""
    step_time_s: float
    """Wall-clock seconds of the step on this rank."""
    peak_own_bytes: int
    """Peak bytes of this rank's own activations (saved for backward plus held inputs/outputs)."""
    peak_hosted_bytes: int
    """Peak bytes of a partner's activations hosted here (BPipe acceptor)."""
    peak_activation_bytes: int
    """Peak of own plus hosted bytes."""
    evicted_bytes: int
    """Bytes this rank sent away with EVICT this step."""
    records: Any = field(default=None, repr=False)
    """This rank's measured action records (:class:`evenpipe.runtime.trace.RankRecorder`), when tracing."""


def _run_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *, keep_graph: bool,
                  inputs: Sequence[torch.Tensor] = (), accumulate: bool = True) -> tuple[torch.Tensor, ...]:
    """Autograd engine call without ``torch.autograd.backward``'s grad/output shape check (outputs may be freed)."""
    return Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


class _NullStash:
    """Accounting-free stand-in used when no activation stash is given."""

    def capture(self, key: tuple[int, int]) -> Any:
        import contextlib
        return contextlib.nullcontext()

    def hold(self, key: tuple[int, int], tensor: torch.Tensor) -> None: ...
    def release(self, key: tuple[int, int], tensor: torch.Tensor) -> None: ...
    def release_all_of(self, key: tuple[int, int]) -> None: ...
    def is_empty(self) -> bool: return True
    def reset_peaks(self) -> None: ...
    peak_own_bytes = 0
    peak_hosted_bytes = 0
    peak_total_bytes = 0
    own_bytes = 0
    hosted_bytes = 0


class PipelineExecutor:
    """Executes this rank's action list of ``schedule`` on its stage modules.

    ``stages`` maps each stage id this rank holds (``schedule.stages_of(pp_rank)``) to its module; the first
    stage takes the micro-batch ``inputs``, the last stage's output goes to ``loss_fn`` with the targets.
    ``stash`` is an :class:`evenpipe.runtime.stash.ActivationStash` (accounting and BPipe); without one, memory
    is not measured and BPipe actions are refused. ``grad_sync``, when given, replaces the data-parallel
    gradient all-reduce at the end of a step (see :mod:`evenpipe.runtime.sharding`). ``early_receives``
    posts every pipeline receive with the transfer run before its own (off by default: see
    :meth:`_StepRun.execute`).
    """

    def __init__(self, *, schedule: Schedule, stages: Mapping[int, nn.Module], groups: ParallelGroups,
                 loss_fn: LossFn, free_outputs: bool = True, stash: Any = None,
                 device: torch.device | str = "cpu", trace: bool = False,
                 grad_sync: Callable[[], None] | None = None, early_receives: bool = False) -> None:
        if schedule.num_ranks != groups.pp:
            raise ConfigError(f"schedule has {schedule.num_ranks} ranks but the pipeline has {groups.pp}")
        mine = schedule.stages_of(groups.pp_rank)
        if set(mine) != set(stages):
            raise ConfigError(f"pipeline rank {groups.pp_rank} holds stages {list(mine)}, got modules for "
                              f"{sorted(stages)}")
        self.schedule = schedule
        self.stages = dict(stages)
        self.groups = groups
        self.loss_fn = loss_fn
        self.free_outputs = free_outputs
        self.stash: Any = stash if stash is not None else _NullStash()
        if hasattr(self.stash, "add_modules"):  # parameters and buffers are never activations
            self.stash.add_modules(self.stages.values())
        self.device = torch.device(device)
        self.trace = trace
        self.grad_sync = grad_sync
        """Run after the schedule instead of the data-parallel all-reduce (FSDP reduce-scatters its own)."""
        self.actions: tuple[Action, ...] = schedule.actions[groups.pp_rank]
        self.phases = _dispatch()
        self.recompute_stages = {a.stage for a in self.actions if a.kind is _K.RECOMPUTE}
        moves = sorted({a.kind.name for a in self.actions if self.phases[a.kind.code] in (Phase.EXTENSION,
                                                                                           Phase.HOST_MOVE)})
        if stash is None and moves:
            raise ConfigError(f"schedule has activation moves ({', '.join(moves)}); the executor needs an "
                              "ActivationStash")
        self.last_stage = schedule.num_stages - 1
        self._shapes: dict[tuple[int, ...], dict[int, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._bpipe_sizes: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}  # learned on the first step
        self._params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in self.stages.items()}
        if early_receives and dist.get_backend(groups.pp_group) != "gloo":
            raise ConfigError("early_receives is for gloo; the pipeline group runs "
                              f"{dist.get_backend(groups.pp_group)} (NCCL runs a group's transfers in order on "
                              "one stream, where a receive posted early could wait)")
        self.early_receives = early_receives
        """Post each pipeline receive one transfer run early (see :meth:`_StepRun.execute`; gloo only)."""
        if dist.get_backend(groups.pp_group) == "nccl":  # NCCL: first call on a group must involve all its ranks
            for grp in (groups.pp_group, groups.bpipe_group, groups.dp_group):
                if grp is not None:
                    dist.all_reduce(torch.zeros(1, device=self.device), group=grp)

    # ------------------------------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """Run one global batch (``inputs``/``targets`` hold the whole global batch, identical on all ranks)."""
        m = self.schedule.num_microbatches
        dp, d = self.groups.dp, self.groups.dp_rank
        if inputs.shape[0] % (dp * m):
            raise ConfigError(f"global batch {inputs.shape[0]} is not divisible by dp x microbatches = "
                              f"{dp} x {m}")
        per = inputs.shape[0] // dp
        # own storage per micro-batch: the stash dedupes (and BPipe moves) by storage
        mb_inputs = [c.to(self.device).clone() for c in inputs[d * per:(d + 1) * per].chunk(m)]
        mb_targets = [c.to(self.device).clone() for c in targets[d * per:(d + 1) * per].chunk(m)]
        shapes = self._boundary_shapes(mb_inputs[0])
        for mod in self.stages.values():
            for p in mod.parameters():
                p.grad = None
        self.stash.reset_peaks()
        run = _StepRun(self, mb_inputs, mb_targets, shapes)
        t0 = time.perf_counter()
        try:
            run.execute()
        except PeerFailure:
            raise
        except Exception as e:
            log.error("pipeline rank %d failed at %s: %s", self.groups.pp_rank, run.current, e)
            raise
        if self.grad_sync is not None:
            self.grad_sync()
        else:
            self._all_reduce_grads()
        self._sum_tied_grads()
        loss = self._share_loss(run.loss_sum)
        dt = time.perf_counter() - t0
        return StepResult(loss=loss, step_time_s=dt, peak_own_bytes=int(self.stash.peak_own_bytes),
                          peak_hosted_bytes=int(self.stash.peak_hosted_bytes),
                          peak_activation_bytes=int(self.stash.peak_total_bytes), evicted_bytes=run.evicted_bytes,
                          records=run.recorder)

    # ------------------------------------------------------------------------------------------------------
    def _boundary_shapes(self, mb_input: torch.Tensor) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each stage's output that crosses to another rank (cached per input shape)."""
        key = tuple(mb_input.shape)
        if key in self._shapes:
            return self._shapes[key]
        g = self.groups
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        x: torch.Tensor | None = None
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            for s in range(self.schedule.num_stages - 1):
                here, nxt = self.schedule.rank_of(s), self.schedule.rank_of(s + 1)
                if here == g.pp_rank:
                    if x is None or s - 1 not in self.stages:
                        if s == 0:
                            x = torch.zeros_like(mb_input)
                        else:
                            shape, dtype = shapes[s - 1]
                            x = torch.zeros(shape, dtype=dtype, device=self.device)
                    x = self.stages[s](x)
                    shapes[s] = (tuple(x.shape), x.dtype)
                    if nxt != here:
                        header = torch.tensor(_encode_shape(x), dtype=torch.int64, device=self.device)
                        post_batch([Transfer(send=True, tensor=header, peer=g.global_rank(nxt), group=g.pp_group,
                                             tag=_HANDSHAKE_TAG, what=f"shape of stage {s} output")],
                                   timeout_s=g.timeout_s).wait()
                elif nxt == g.pp_rank:
                    header = torch.zeros(10, dtype=torch.int64, device=self.device)
                    post_batch([Transfer(send=False, tensor=header, peer=g.global_rank(here), group=g.pp_group,
                                         tag=_HANDSHAKE_TAG, what=f"shape of stage {s} output")],
                               timeout_s=g.timeout_s).wait()
                    shapes[s] = _decode_shape(header)
                    x = None
        self._shapes[key] = shapes
        return shapes

    def _all_reduce_grads(self) -> None:
        g = self.groups
        if g.dp == 1:
            return
        # a tensor-parallel shard reduces with its own coordinate
        grads = _local_grads(p for ps in self._params.values() for p in ps)

        def mean(flat: torch.Tensor) -> None:
            with collective("the gradient all-reduce across replicas"):
                dist.all_reduce(flat, group=g.dp_group)
            flat /= g.dp

        through_flat(grads, mean, dtype=torch.float32)  # reduced in fp32 whatever the model's dtype

    def _sum_tied_grads(self) -> None:
        """Sum the gradients of weights tied between the first and the last stage when two ranks hold copies
        (Megatron's embedding all-reduce), so both copies take the same optimizer step."""
        first_rank, last_rank = self.schedule.rank_of(0), self.schedule.rank_of(self.last_stage)
        tied = list({id(p): p for m in self.stages.values() for p in getattr(m, "tied_params", ())}.values())
        if not tied or first_rank == last_rank:
            return
        g = self.groups
        if (first_rank, last_rank) != (0, g.pp - 1) or g.embedding_group is None:
            raise ConfigError(f"tied weights need the first stage on pipeline rank 0 and the last on rank "
                              f"{g.pp - 1}; this schedule puts them on {first_rank} and {last_rank}")
        grads = _local_grads(tied)  # a shard (tensor parallel, FSDP) sums with its own coordinate
        other = g.global_rank(last_rank if g.pp_rank == first_rank else first_rank)

        def total(flat: torch.Tensor) -> None:
            with collective("the tied-weight gradient all-reduce", other):
                dist.all_reduce(flat, group=g.embedding_group)

        through_flat(grads, total, dtype=torch.float32)

    def _share_loss(self, loss_sum: float) -> float:
        g = self.groups
        t = torch.tensor([loss_sum], dtype=torch.float64, device=self.device)
        src = g.global_rank(self.schedule.rank_of(self.last_stage))
        with collective("the loss broadcast", src):
            if g.dp > 1:
                dist.all_reduce(t, group=g.dp_group)
                t /= g.dp
            if g.pp > 1:
                dist.broadcast(t, src, group=g.pp_group)
        return float(t.item())


def _local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where it has none yet, set on the parameter) as its local shard."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local_shard(p.grad))
    return grads


def _encode_shape(x: torch.Tensor) -> list[int]:
    if x.dim() > 8:
        raise ConfigError(f"stage outputs of more than 8 dimensions are not supported, got {tuple(x.shape)}")
    return [x.dim(), _DTYPES.index(x.dtype), *x.shape, *([0] * (8 - x.dim()))]


def _decode_shape(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    vals = header.tolist()
    return tuple(vals[2:2 + vals[0]]), _DTYPES[vals[1]]


class _StepRun:
    """State of one step on one rank: live inputs/outputs, pending messages, the action loop."""

    def __init__(self, ex: PipelineExecutor, mb_inputs: Sequence[torch.Tensor], mb_targets: Sequence[torch.Tensor],
                 shapes: Mapping[int, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.ex = ex
        self.mb_inputs = mb_inputs
        self.mb_targets = mb_targets
        self.shapes = shapes
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}   # gradient of a stage output (local handoff)
        self.in_grads: dict[tuple[int, int], torch.Tensor] = {}    # gradient of a stage input, to send
        self.deferred_w: dict[tuple[int, int], WeightState] = {}  # I -> W hand-off
        self.rng: dict[tuple[int, int], Any] = {}
        self.recvs: dict[tuple[ActionKind, int, int], tuple[PendingBatch, Any]] = {}
        self.sends: list[PendingBatch] = []  # send batches posted since the last compute
        self.earlier_sends: list[PendingBatch] = []  # ... posted before it: waited after the next compute
        self.loss_sum = 0.0
        self.evicted_bytes = 0
        self.current: Action | None = None
        self.recorder = RankRecorder(ex.groups.pp_rank) if ex.trace else None
        self._send_records: dict[int, list[SendRecord]] = {}
        self.output_sends: dict[tuple[int, int], PendingBatch] = {}  # SEND_F batch per key (BPipe waits on it)
        self.offloaded: dict[tuple[int, int], Any] = {}  # OFFLOAD -> RELOAD: (meta, host copy) or None
        from evenpipe.runtime.bpipe import BpipeOps  # local: BPipe is an add-on of the executor
        shape = tuple(mb_inputs[0].shape)
        learning = shape not in ex._bpipe_sizes
        self.bpipe = BpipeOps(self, ex._bpipe_sizes.setdefault(shape, {}), learning)

    # -- loop ------------------------------------------------------------------------------------------------
    def execute(self) -> None:
        """Run this rank's actions in order; each run of transfer actions between two computes is posted at once.

        With ``early_receives`` a run also posts the pipeline receives of the next run (they are skipped there).
        Over gloo posting a receive never waits, so posting it earlier cannot deadlock; it allocates the receive's
        buffer one run earlier. A send whose receive is not posted yet waits for it, so a message posted in place
        can wait for the sender's communication thread on a busy core; posted early, the receiver's thread reads
        it during the receiver's compute instead. On a 2-core host neither way won consistently
        (``benchmarks/bench_early_receives.py``: late/early step 0.96-1.02), so it is off by default.
        """
        acts, phases = self.ex.actions, self.ex.phases
        compute, host_move = Phase.COMPUTE, Phase.HOST_MOVE
        early = self.ex.early_receives
        posted_early: set[int] = set()
        i = 0
        while i < len(acts):
            a = acts[i]
            phase = phases[a.kind.code]
            if phase is not compute and phase is not host_move:
                j = self._run_end(i)
                run = [k for k in range(i, j) if k not in posted_early] if early else list(range(i, j))
                if early:
                    ahead = self._next_pipeline_receives(j)
                    posted_early.update(ahead)
                    run += ahead
                if run:
                    self._post(run)
                i = j
                continue
            self.current = a
            if phase is compute:
                self.bpipe.before_compute(a)  # F/R: earlier evictions land first, so their buffers are freed
            t0 = time.perf_counter()
            if phase is host_move:
                self._host_move(a)
            else:
                self._compute(a)
            if self.recorder is not None:
                self.recorder.action(i, a, t0, time.perf_counter(), self.ex.stash)
                for batch, _ in self.recvs.values():  # stamps arrivals (see RankRecorder.received)
                    batch.is_completed()
            self._retire_sends()
            i += 1
        self.bpipe.finish()
        for b in self.earlier_sends + self.sends:  # a send posted before the last compute is still unwaited
            b.wait_sends()
            self._sent(b)
        self.sends.clear()
        self.earlier_sends.clear()
        self.output_sends.clear()
        leftover = [k for k in self.recvs]
        assert not leftover, f"receives never consumed: {leftover}"
        self.bpipe = None  # type: ignore[assignment]  # break the run <-> BpipeOps cycle: free the step at once

    def _run_end(self, i: int) -> int:
        """End (exclusive) of the run of transfer actions starting at ``i``."""
        acts, phases = self.ex.actions, self.ex.phases
        while i < len(acts) and phases[acts[i].kind.code] not in (Phase.COMPUTE, Phase.HOST_MOVE):
            i += 1
        return i

    def _next_pipeline_receives(self, j: int) -> list[int]:
        """Indices of the pipeline receives (``RECV_F``/``RECV_B``) in the first transfer run at or after ``j``."""
        acts, phases = self.ex.actions, self.ex.phases
        while j < len(acts) and phases[acts[j].kind.code] in (Phase.COMPUTE, Phase.HOST_MOVE):
            j += 1
        return [k for k in range(j, self._run_end(j)) if acts[k].kind in (_K.RECV_F, _K.RECV_B)]

    def _retire_sends(self) -> None:
        """After each compute: wait for the sends posted before the compute that just ran, and release them.

        Each send so overlaps at least one compute, and its payload (a stage output, a gradient) is freed one
        compute later instead of at the end of the step (gloo reports a send complete only once it is waited).
        Waiting for a send later than its own place in the rank's list is never stricter than the rendezvous
        semantics the validator proves deadlock-free, so this cannot deadlock.
        """
        for b in self.earlier_sends:
            b.wait_sends()
            self._sent(b)
        self.earlier_sends = self.sends
        self.sends = []

    def _sent(self, batch: PendingBatch) -> None:
        if self.recorder is not None:
            now = time.perf_counter()
            for rec in self._send_records.pop(id(batch), []):
                rec.end = now

    def _post(self, indices: list[int]) -> None:
        """Post a run of transfer actions: pipeline messages as one batch, then each BPipe action as its own.

        Pipeline messages go first: an EVICT may drop (in place) the storage a SEND_F of the same run sends, so
        that send must be posted, and is then waited, before the evict exports and drops.
        """
        t0 = time.perf_counter()
        pp_items: list[tuple[Transfer, Any, Action]] = []
        for idx in indices:
            a = self.ex.actions[idx]
            if self.ex.phases[a.kind.code] is Phase.PIPE_MESSAGE:
                self.current = a
                t, on_posted = self._pp_transfer(a)
                pp_items.append((t, on_posted, a))
        if pp_items:
            self._post_items(pp_items, t0)
        for idx in indices:
            a = self.ex.actions[idx]
            if self.ex.phases[a.kind.code] is Phase.EXTENSION:
                # each BPipe action alone: a header receive must be waitable without waiting for other sends
                self.current = a
                batch = self._post_items([(t, on_posted, a) for t, on_posted in self.bpipe.transfers(a)], t0,
                                         track_sends=False)
                self.bpipe.posted(a, batch)
        if self.recorder is not None:
            for idx in indices:
                self.recorder.action(idx, self.ex.actions[idx], t0, time.perf_counter(), self.ex.stash)

    def _post_items(self, items: list[tuple[Transfer, Any, Action]], t0: float, *,
                    track_sends: bool = True) -> PendingBatch:
        """Post ``items`` as one batch; its sends are polled and waited by the step unless ``track_sends`` is
        False (BPipe's, which :class:`~evenpipe.runtime.bpipe.BpipeOps` waits itself)."""
        g = self.ex.groups
        batch = post_batch([t for t, _, _ in items], timeout_s=g.timeout_s)
        for t, on_posted, a in items:
            if on_posted is not None:
                on_posted(batch)
            if a.kind is _K.SEND_F:
                self.output_sends[a.key] = batch
            if t.send and self.recorder is not None:  # one record per sending action (all its messages)
                recs = self._send_records.setdefault(id(batch), [])
                if not recs or recs[-1].action is not a:
                    recs.append(SendRecord(action=a, dst=a.peer if a.peer is not None else -1, num_bytes=0,
                                           start=t0))
                    self.recorder.sends.append(recs[-1])
                recs[-1].num_bytes += t.tensor.numel() * t.tensor.element_size()
            elif self.recorder is not None:
                self.recorder.received(a, t.tensor, t0, batch)
        if track_sends and any(t.send for t, _, _ in items):
            self.sends.append(batch)
        return batch

    def _tag(self, a: Action) -> int:
        m = self.ex.schedule.num_microbatches
        boundary = a.stage if a.kind in (_K.SEND_F, _K.RECV_B) else a.stage - 1
        forward = a.kind in (_K.SEND_F, _K.RECV_F)
        return (boundary * m + a.microbatch) * 2 + (0 if forward else 1)

    def _pp_transfer(self, a: Action) -> tuple[Transfer, Any]:
        g = self.ex.groups
        assert a.peer is not None
        peer = g.global_rank(a.peer)
        what = f"{a.kind.name} stage {a.stage} mb {a.microbatch}"
        key = (a.stage, a.microbatch)
        if a.kind is _K.SEND_F:
            out = self.outputs[key]
            payload = out.detach()
            if a.stage in self.ex.recompute_stages:
                self.ex.stash.release(key, self.outputs.pop(key))
            elif self.ex.free_outputs:
                self.ex.stash.release(key, out)
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            return Transfer(send=True, tensor=payload, peer=peer, group=g.pp_group, tag=self._tag(a), what=what), None
        if a.kind is _K.SEND_B:
            grad = self.in_grads.pop(key)
            return Transfer(send=True, tensor=grad, peer=peer, group=g.pp_group, tag=self._tag(a), what=what), None
        boundary = a.stage - 1 if a.kind is _K.RECV_F else a.stage
        shape, dtype = self.shapes[boundary]
        buf = torch.empty(shape, dtype=dtype, device=self.ex.device)
        rkey = (a.kind, a.stage, a.microbatch)

        def on_posted(batch: PendingBatch) -> None:
            self.recvs[rkey] = (batch, buf)
        return Transfer(send=False, tensor=buf, peer=peer, group=g.pp_group, tag=self._tag(a), what=what), on_posted

    def _take_recv(self, kind: ActionKind, stage: int, mb: int) -> torch.Tensor | None:
        item = self.recvs.pop((kind, stage, mb), None)
        if item is None:
            return None
        batch, buf = item
        batch.wait_for(buf)
        return buf

    # -- compute ---------------------------------------------------------------------------------------------
    def _compute(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        k = a.kind
        if k is _K.FORWARD:
            self._forward(key)
        elif k is _K.RECOMPUTE:
            self._recompute(key)
        elif k is _K.BACKWARD or k is _K.BACKWARD_INPUT:
            self._backward(key, split=k is _K.BACKWARD_INPUT)
        else:
            assert k is _K.BACKWARD_WEIGHT, f"{a} is not a compute"
            self._weight(key)

    def _host_move(self, a: Action) -> None:
        """``OFFLOAD``: the key's saved activations go to host memory (one flat copy) and their device storages
        are freed in place; ``RELOAD``: they come back, so the graph sees identical values again."""
        key = a.key
        stash = self.ex.stash
        if a.kind is _K.OFFLOAD:
            sent = self.output_sends.pop(key, None)
            if sent is not None:  # the stage output may be one of the storages freed in place: send it first
                sent.wait_sends()
            if key not in stash.keys():  # nothing saved (a recomputed first stage keeps only token ids)
                self.offloaded[key] = None
                return
            meta, flat = stash.export(key)
            host = flat.to("cpu", copy=True) if flat.device.type != "cpu" else flat
            stash.drop(key)
            self.offloaded[key] = (meta, host)
            return
        assert a.kind is _K.RELOAD, f"{a} is not a host move"
        item = self.offloaded.pop(key)
        if item is not None:
            meta, host = item
            stash.restore(key, meta, host.to(self.ex.device))

    def _stage_input(self, key: tuple[int, int]) -> torch.Tensor:
        s, mb = key
        if s == 0:
            return self.mb_inputs[mb]
        buf = self._take_recv(_K.RECV_F, s, mb)
        if buf is None:  # previous stage on this rank: local hand-off (its output stays the root of its backward)
            buf = self.outputs[(s - 1, mb)].detach()
        return buf

    def _run_stage(self, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        s, mb = key
        out = self.ex.stages[s](x)
        if s == self.ex.last_stage:
            loss = self.ex.loss_fn(out, self.mb_targets[mb])
            return loss / self.ex.schedule.num_microbatches
        return out

    def _forward(self, key: tuple[int, int]) -> None:
        s, mb = key
        x = self._stage_input(key)
        stash = self.ex.stash
        if s in self.ex.recompute_stages:
            self.rng[key] = _rng_state(self.ex.device)
            with torch.no_grad():
                out = self._run_stage(key, x)
        else:
            if s > 0 and x.is_floating_point():
                x.requires_grad_(True)
            with stash.capture(key):
                out = self._run_stage(key, x)
        if s > 0:
            self.inputs[key] = x
            stash.hold(key, x)
        if s == self.ex.last_stage:
            self.loss_sum += float(out.detach())
            if s in self.ex.recompute_stages:
                return
        self.outputs[key] = out
        if s != self.ex.last_stage:
            stash.hold(key, out)

    def _recompute(self, key: tuple[int, int]) -> None:
        s, mb = key
        self.bpipe.before_backward(key)
        x = self.mb_inputs[mb] if s == 0 else self.inputs[key]
        if s > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
            self.ex.stash.release(key, self.inputs[key])
            self.inputs[key] = x
            self.ex.stash.hold(key, x)
        with _restored_rng(self.rng.pop(key), self.ex.device), self.ex.stash.capture(key):
            out = self._run_stage(key, x)
        if self.ex.free_outputs and s != self.ex.last_stage:
            out.data = torch.empty(0, dtype=out.dtype, device=out.device)
        self.outputs[key] = out

    def _output_grad(self, key: tuple[int, int]) -> torch.Tensor | None:
        s, mb = key
        if s == self.ex.last_stage:
            return None
        buf = self._take_recv(_K.RECV_B, s, mb)
        if buf is None:
            buf = self.out_grads.pop(key)
        return buf

    def _deliver_input_grad(self, key: tuple[int, int], grad: torch.Tensor | None) -> None:
        s, mb = key
        if s == 0 or grad is None:
            return
        if self.ex.schedule.rank_of(s - 1) == self.ex.groups.pp_rank and (s - 1) in self.ex.stages:
            self.out_grads[(s - 1, mb)] = grad
        else:
            self.in_grads[key] = grad

    def _backward(self, key: tuple[int, int], *, split: bool) -> None:
        s, _ = key
        self.bpipe.before_backward(key)
        out = self.outputs.pop(key)
        grad = self._output_grad(key)
        x = self.inputs.get(key)
        roots, grads = [out], [grad if grad is not None else torch.ones_like(out)]
        needs_x = x is not None and x.requires_grad
        if split:
            xs = (x,) if needs_x and x is not None else ()
            gxs, self.deferred_w[key] = backward_input(roots, grads, xs, self.ex._params[s])
            self._deliver_input_grad(key, gxs[0] if xs else None)
            return
        if needs_x:
            assert x is not None
            x.grad = None
        _run_backward(roots, grads, keep_graph=False)
        self._deliver_input_grad(key, x.grad if needs_x and x is not None else None)
        self._done(key)

    def _weight(self, key: tuple[int, int]) -> None:
        backward_weight(self.deferred_w.pop(key), self.ex._params[key[0]])
        self._done(key)

    def _done(self, key: tuple[int, int]) -> None:
        x = self.inputs.pop(key, None)
        if x is not None:
            self.ex.stash.release(key, x)
        self.ex.stash.release_all_of(key)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _restored_rng:
    """Run a block with a saved RNG state (for recomputation), restoring the current state afterwards."""

    def __init__(self, state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)

