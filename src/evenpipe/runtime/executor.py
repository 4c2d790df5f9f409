"""Run one rank's schedule actions with torch.distributed: the pipeline executor.

One :meth:`PipelineExecutor.step` is one global batch: replica ``d`` takes its ``1/dp`` slice, splits it into
``num_microbatches`` equal micro-batches and runs its action list in order. Each micro-batch's loss is divided by
the number of micro-batches and the gradients are averaged over replicas, so loss and gradients equal
un-pipelined training on the whole global batch (mean cross-entropy).

Dispatch. Each action kind has one handler, registered in :mod:`evenpipe.runtime.step_context` (the compute and
host-move kinds in :mod:`~evenpipe.runtime.step_compute`, pipeline messages in
:mod:`~evenpipe.runtime.step_messages`, BPipe's kinds in :mod:`~evenpipe.runtime.bpipe`); every handler works on
the step's :class:`~evenpipe.runtime.step_context.StepContext`. This module owns the loop, the shape handshake
and the end-of-step gradient and loss collectives.

Transfers. Consecutive transfer actions of one process group are posted together with ``batch_isend_irecv``
(NCCL needs grouped sends and receives to avoid deadlock). A receive is posted where its action stands and waited
just before the compute that consumes it; pipeline sends are waited lazily (polled between actions, all waited at
the end of the step). BPipe's sends are waited at the points where the simulator frees their memory (see
:mod:`evenpipe.runtime.bpipe`): a ``F``/``R`` first waits for the rank's earlier ``EVICT``s. The schedule validator
guarantees the per-pair posting order matches, so NCCL (which ignores tags) pairs messages right; on gloo every
message also carries a tag naming it.

Shapes. Tensor shapes between stages are learned by a *shape handshake*, not a hand-written list, and micro-batches
of one step may differ in length: every receive's shape follows from its micro-batch's input shape, which every
rank holds (see :mod:`evenpipe.runtime.boundary_shapes`); receives are posted with no message ahead of them.

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

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

import evenpipe.runtime.bpipe  # noqa: F401  (registers BPipe's handlers and add-on)
import evenpipe.runtime.host_offload  # noqa: F401  (registers the host-move handlers and their add-on)
import evenpipe.runtime.step_compute  # noqa: F401  (registers the compute handlers)
import evenpipe.runtime.step_messages  # noqa: F401  (registers the pipeline-message handlers)
from evenpipe.errors import ConfigError
from evenpipe.runtime.boundary_shapes import BoundaryShapes, ShapeMap
from evenpipe.runtime.comm import ParallelGroups, PeerFailure, Transfer, collective, through_flat
from evenpipe.runtime.emulation import RankEmulation
from evenpipe.runtime.mailbox import Mailbox
from evenpipe.runtime.stash import StashMeta
from evenpipe.runtime.step_context import (Handler, LiveTensors, LossFn, Phase, Posting, Stash,
                                           StashKey, StepContext, addons, handler_table)
from evenpipe.runtime.tensor_parallel import local_shard, sum_sequence_partial_grads
from evenpipe.runtime.trace import RankRecorder
from evenpipe.schedule.ir import Action, ActionKind, Schedule

__all__ = ["PipelineExecutor", "StepResult", "LossFn", "Phase"]

log = logging.getLogger(__name__)

_K = ActionKind


def _dispatch() -> tuple[Handler | None, ...]:
    """The executor's kind -> handler table, checked to cover every kind (:func:`kind_table`)."""
    return handler_table()


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
    peak_offloaded_bytes: int = 0
    """Peak bytes of this rank's activations offloaded to host memory (``OFFLOAD``; not on the device)."""
    peak_comm_bytes: int = 0
    """Peak bytes of pipeline messages in flight (receive buffers not yet taken, sends not yet waited)."""
    records: RankRecorder | None = field(default=None, repr=False)
    """This rank's measured action records (:class:`evenpipe.runtime.trace.RankRecorder`), when tracing."""
    compute_s: float = 0.0
    """Seconds this rank's compute actions took this step, waits for received inputs excluded (host clock: on
    CUDA it counts launches, and the waits kernels make the host do, not device time)."""


class _NullStash:
    """Accounting-free stand-in used when no activation stash is given (the executor then refuses schedules
    that move activations, so nothing is ever exported, dropped or hosted)."""

    own_bytes = 0
    hosted_bytes = 0
    offloaded_bytes = 0
    peak_own_bytes = 0
    peak_hosted_bytes = 0
    peak_total_bytes = 0
    peak_offloaded_bytes = 0

    def capture(self, key: StashKey) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def add_modules(self, modules: Iterable[nn.Module]) -> None: ...
    def hold(self, key: StashKey, tensor: torch.Tensor) -> None: ...
    def release(self, key: StashKey, tensor: torch.Tensor) -> None: ...
    def release_all_of(self, key: StashKey) -> None: ...
    def reset_peaks(self) -> None: ...
    def is_empty(self) -> bool: return True
    def keys(self) -> list[StashKey]: return []

    def export(self, key: StashKey, *, to_host: bool = False) -> tuple[StashMeta, torch.Tensor]: _no_moves()
    def drop(self, key: StashKey, *, stream: Any = None) -> None: _no_moves()
    def restore(self, key: StashKey, meta: StashMeta, flat: torch.Tensor, *, stream: Any = None) -> None:
        _no_moves()

    def shelve(self, key: StashKey, meta: StashMeta, flat: torch.Tensor) -> None: _no_moves()
    def unshelve(self, key: StashKey) -> tuple[StashMeta, torch.Tensor]: _no_moves()
    def host(self, key: StashKey, meta: StashMeta | None, flat: torch.Tensor) -> None: _no_moves()
    def unhost(self, key: StashKey) -> tuple[StashMeta | None, torch.Tensor]: _no_moves()


def _no_moves() -> NoReturn:
    raise AssertionError("activations moved without an ActivationStash (the executor refuses such schedules)")


class PipelineExecutor:
    """Executes this rank's action list of ``schedule`` on its stage modules.

    ``stages`` maps each stage id this rank holds (``schedule.stages_of(pp_rank)``) to its module; the first
    stage takes the micro-batch ``inputs``, the last stage's output goes to ``loss_fn`` with the targets.
    ``stash`` is an :class:`evenpipe.runtime.stash.ActivationStash` (accounting and BPipe); without one, memory
    is not measured and BPipe actions are refused. ``grad_sync``, when given, replaces the data-parallel
    gradient all-reduce at the end of a step (see :mod:`evenpipe.runtime.sharding`). ``early_receives``
    posts every pipeline receive with the transfer run before its own (off by default: see
    :meth:`_Program.execute`).
    """

    def __init__(self, *, schedule: Schedule, stages: Mapping[int, nn.Module], groups: ParallelGroups,
                 loss_fn: LossFn, free_outputs: bool = True, stash: Stash | None = None,
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
        self.stash: Stash = stash if stash is not None else _NullStash()
        self.stash.add_modules(self.stages.values())  # parameters and buffers are never activations
        self.device = torch.device(device)
        self.trace = trace
        self.grad_sync = grad_sync
        """Run after the schedule instead of the data-parallel all-reduce (FSDP reduce-scatters its own)."""
        self.actions: tuple[Action, ...] = schedule.actions[groups.pp_rank]
        self.recompute_stages = frozenset(a.stage for a in self.actions if a.kind is _K.RECOMPUTE)
        if early_receives and dist.get_backend(groups.pp_group) != "gloo":
            raise ConfigError("early_receives is for gloo; the pipeline group runs "
                              f"{dist.get_backend(groups.pp_group)} (NCCL runs a group's transfers in order on "
                              "one stream, where a receive posted early could wait)")
        self.early_receives = early_receives
        self.emulation: RankEmulation | None = None
        """What this rank emulates in the next step (a slow rank or link; set by the training loop per step)."""
        """Post each pipeline receive one transfer run early (see :meth:`_Program.execute`; gloo only)."""
        self.program = _Program.of(self.actions)
        """This rank's actions with their handlers."""
        moves = sorted({a.kind.name for a, h in zip(self.actions, self.program.handlers)
                        if h.phase in (Phase.EXTENSION, Phase.HOST_MOVE)})
        if stash is None and moves:
            raise ConfigError(f"schedule has activation moves ({', '.join(moves)}); the executor needs an "
                              "ActivationStash")
        self.last_stage = schedule.num_stages - 1
        self.boundaries = BoundaryShapes(schedule=schedule, stages=self.stages, groups=groups, device=self.device)
        """The shapes of the messages between stages, per micro-batch input shape."""
        self._kept: dict[str, dict[object, object]] = {}
        """What each add-on keeps across steps (BPipe: unit sizes learned on the first step of a shape)."""
        self._params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in self.stages.items()}
        if dist.get_backend(groups.pp_group) == "nccl":  # NCCL: first call on a group must involve all its ranks
            for grp in (groups.pp_group, groups.bpipe_group, groups.dp_group):
                if grp is not None:
                    with collective("the first NCCL all-reduce of a group"):
                        dist.all_reduce(torch.zeros(1, device=self.device), group=grp)

    # ------------------------------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor],
             targets: torch.Tensor | Sequence[torch.Tensor]) -> StepResult:
        """Run one global batch, identical on all ranks: ``inputs``/``targets`` hold the whole batch (cut into
        equal micro-batches), or are the ``dp x M`` micro-batches themselves, replica by replica, each of its
        own shape."""
        mb_inputs, mb_targets = self._replica_microbatches(inputs, targets)
        shapes = self.boundaries.for_microbatches(mb_inputs)
        for mod in self.stages.values():
            for p in mod.parameters():
                p.grad = None
        self.stash.reset_peaks()
        ctx = self._context(LiveTensors(mb_inputs, mb_targets), shapes, [self._layout(x) for x in mb_inputs])
        t0 = time.perf_counter()
        try:
            self.program.execute(ctx, early_receives=self.early_receives)
        except PeerFailure:
            raise
        except Exception as e:
            log.error("pipeline rank %d failed at %s: %s", self.groups.pp_rank, ctx.current, e)
            raise
        if self.grad_sync is not None:
            self.grad_sync()
        else:
            self._all_reduce_grads()
        self._sum_tied_grads()
        if self.groups.tp_group is not None:  # norms on sequence slices (nothing to sum without them)
            sum_sequence_partial_grads(self.stages.values(), self.groups.tp_group)
        loss = self._share_loss(ctx.loss_sum)
        dt = time.perf_counter() - t0
        return StepResult(loss=loss, step_time_s=dt, peak_own_bytes=int(self.stash.peak_own_bytes),
                          peak_hosted_bytes=int(self.stash.peak_hosted_bytes),
                          peak_activation_bytes=int(self.stash.peak_total_bytes), evicted_bytes=ctx.evicted_bytes,
                          peak_offloaded_bytes=int(self.stash.peak_offloaded_bytes),
                          peak_comm_bytes=ctx.mail.peak_buffer_bytes, records=ctx.recorder,
                          compute_s=max(0.0, ctx.compute_s - ctx.mail.waited_s))

    def _replica_microbatches(self, inputs: torch.Tensor | Sequence[torch.Tensor],
                              targets: torch.Tensor | Sequence[torch.Tensor]
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This replica's micro-batches (inputs, targets), each on the device with its own storage (the stash
        dedupes, and BPipe moves, by storage)."""
        m = self.schedule.num_microbatches
        dp, d = self.groups.dp, self.groups.dp_rank
        if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor):
            if inputs.shape[0] % (dp * m):
                raise ConfigError(f"global batch {inputs.shape[0]} is not divisible by dp x microbatches = "
                                  f"{dp} x {m}")
            per = inputs.shape[0] // dp
            ins, tgs = inputs[d * per:(d + 1) * per].chunk(m), targets[d * per:(d + 1) * per].chunk(m)
        else:
            if len(inputs) != dp * m or len(targets) != dp * m:
                raise ConfigError(f"{len(inputs)} micro-batches of inputs and {len(targets)} of targets given; "
                                  f"a step takes dp x microbatches = {dp} x {m}")
            ins, tgs = tuple(inputs[d * m:(d + 1) * m]), tuple(targets[d * m:(d + 1) * m])
        return [c.to(self.device).clone() for c in ins], [c.to(self.device).clone() for c in tgs]

    def _layout(self, mb_input: torch.Tensor) -> Hashable:
        """What fixes the sizes of what a micro-batch saves (:attr:`StepContext.layouts`): the stage modules'
        ``activation_layout`` of its input when they have one, else its shape."""
        for mod in self.stages.values():
            layout = getattr(mod, "activation_layout", None)
            if layout is not None:
                return layout(mb_input)  # type: ignore[no-any-return]
        return tuple(mb_input.shape)

    def _context(self, live: LiveTensors, shapes: Sequence[ShapeMap], layouts: Sequence[Hashable]) -> StepContext:
        """A fresh step context, with every registered add-on's state for this step."""
        recorder = RankRecorder(self.groups.pp_rank) if self.trace else None
        ctx = StepContext(schedule=self.schedule, groups=self.groups, stages=self.stages,
                          loss_fn=self.loss_fn, stash=self.stash, device=self.device, free_outputs=self.free_outputs,
                          recompute_stages=self.recompute_stages, shapes=shapes, layouts=layouts, live=live,
                          mail=Mailbox(timeout_s=self.groups.timeout_s, recorder=recorder), recorder=recorder,
                          emulation=self.emulation)
        for owner, make in addons().items():
            ctx.addons[owner] = make(ctx, self._kept.setdefault(owner, {}))
        return ctx

    # ------------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True, slots=True)
class _Program:
    """One rank's actions with their handlers: computes and host moves run in place, each run of transfer
    actions between two of them is posted at once."""

    actions: tuple[Action, ...]
    handlers: tuple[Handler, ...]

    @classmethod
    def of(cls, actions: tuple[Action, ...]) -> _Program:
        table = _dispatch()
        handlers = [table[a.kind.code] for a in actions]
        assert all(h is not None for h in handlers), "every kind has a handler (kind_table checks it)"
        return cls(actions, tuple(h for h in handlers if h is not None))

    def execute(self, ctx: StepContext, *, early_receives: bool = False) -> None:
        """Run the actions in order; each run of transfer actions between two computes is posted at once.

        With ``early_receives`` a run also posts the pipeline receives of the next run (they are skipped there).
        Over gloo posting a receive never waits, so posting it earlier cannot deadlock; it allocates the receive's
        buffer one run earlier. A send whose receive is not posted yet waits for it, so a message posted in place
        can wait for the sender's communication thread on a busy core; posted early, the receiver's thread reads
        it during the receiver's compute instead. On a 2-core host neither way won consistently
        (``benchmarks/bench_early_receives.py``: late/early step 0.96-1.02), so it is off by default.
        """
        acts, handlers = self.actions, self.handlers
        posted_early: set[int] = set()
        i = 0
        while i < len(acts):
            a, h = acts[i], handlers[i]
            if h.run is None:  # a message: post the whole run of them
                j = self._run_end(i)
                run = [k for k in range(i, j) if k not in posted_early] if early_receives else list(range(i, j))
                if early_receives:
                    ahead = self._next_pipeline_receives(j)
                    posted_early.update(ahead)
                    run += ahead
                if run:
                    self._post(ctx, run)
                i = j
                continue
            ctx.current = a
            if h.phase is Phase.COMPUTE:
                ctx.before_compute(a)  # BPipe: earlier evictions land first, so their buffers are freed
            t0 = time.perf_counter()
            h.run(a, ctx)
            t1 = time.perf_counter()
            if h.phase is Phase.COMPUTE:
                ctx.compute_s += t1 - t0
            if ctx.recorder is not None:
                ctx.recorder.action(i, a, t0, t1, ctx.stash)
                ctx.mail.poll_receives()
            ctx.mail.retire_sends()
            i += 1
        ctx.finish_addons()
        ctx.mail.finish()

    def _run_end(self, i: int) -> int:
        """End (exclusive) of the run of transfer actions starting at ``i``."""
        while i < len(self.actions) and self.handlers[i].run is None:
            i += 1
        return i

    def _next_pipeline_receives(self, j: int) -> list[int]:
        """Indices of the pipeline receives (``RECV_F``/``RECV_B``) in the first transfer run at or after ``j``."""
        while j < len(self.actions) and self.handlers[j].run is not None:
            j += 1
        return [k for k in range(j, self._run_end(j)) if self.actions[k].kind in (_K.RECV_F, _K.RECV_B)]

    def _post(self, ctx: StepContext, indices: list[int]) -> None:
        """Post a run of transfer actions: pipeline messages as one batch, then each BPipe action as its own.

        Pipeline messages go first: an EVICT may drop (in place) the storage a SEND_F of the same run sends, so
        that send must be posted, and is then waited, before the evict exports and drops.
        """
        t0 = time.perf_counter()
        pipe = [item for idx in indices if self.handlers[idx].phase is Phase.PIPE_MESSAGE
                for item in self._postings(ctx, idx)]
        if pipe:
            ctx.mail.post(pipe, t0)
        for idx in indices:
            if self.handlers[idx].phase is Phase.EXTENSION:
                # each BPipe action alone: a header receive must be waitable without waiting for other sends
                ctx.mail.post(self._postings(ctx, idx), t0, track_sends=False)
        if ctx.recorder is not None:
            for idx in indices:
                ctx.recorder.action(idx, self.actions[idx], t0, time.perf_counter(), ctx.stash)

    def _postings(self, ctx: StepContext, idx: int) -> list[tuple[Transfer, Callable[..., None] | None, Action]]:
        """The messages of action ``idx`` with their action (the handler runs now: it takes its tensors)."""
        a, post = self.actions[idx], self.handlers[idx].post
        assert post is not None
        ctx.current = a
        postings: list[Posting] = post(a, ctx)
        return [(t, on_posted, a) for t, on_posted in postings]
