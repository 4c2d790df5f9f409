"""What the executor and its add-ons share: the step context, the stash protocol, the handler registry, tags.

The executor (:mod:`evenpipe.runtime.executor`) runs one rank's actions by looking each kind up in a registry
of handlers (as ``torch.distributed.pipelining``'s ``register_custom_function(kind, fn(action, ctx))`` does);
every handler receives the action and the :class:`StepContext` of the step. The core kinds register themselves
in :mod:`evenpipe.runtime.step_compute` and :mod:`evenpipe.runtime.step_messages`; BPipe registers its own
(:mod:`evenpipe.runtime.bpipe`) together with the per-step state it keeps (an add-on: :class:`StepHooks`). The
executor and BPipe depend on this module, not on each other.

Vocabulary: a *key* ``(stage, micro-batch)`` names one micro-batch on one stage (a :data:`StashKey`). Message
tags come from :func:`evenpipe.schedule.validate.message_key` only (:func:`message_tag`), so a send and its
receive agree by construction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Hashable, Iterable, Mapping, Protocol, Sequence

import torch
from torch import nn

from evenpipe.runtime.comm import ParallelGroups, PendingBatch, Transfer
from evenpipe.runtime.emulation import RankEmulation
from evenpipe.runtime.mailbox import Mailbox
from evenpipe.runtime.split_backward import WeightState
from evenpipe.runtime.stash import ActivationStash, StashKey, StashMeta
from evenpipe.runtime.trace import RankRecorder
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.semantics import kind_table
from evenpipe.schedule.validate import message_key

__all__ = ["StashKey", "Stash", "StepHooks", "Phase", "Posting", "Handler", "register_handler", "register_addon",
           "handler_table", "addons", "message_tag", "HANDSHAKE_TAG", "LiveTensors", "StepContext", "LossFn",
           "RngState"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(last_stage_output, targets) -> scalar`` mean loss of one micro-batch."""

RngState = tuple[torch.Tensor, "torch.Tensor | None"]
"""CPU and (on CUDA) device RNG state, as a forward saw it (replayed by its recomputation)."""


class Stash(Protocol):
    """What the executor and BPipe need of an activation stash (:class:`evenpipe.runtime.stash.ActivationStash`
    implements it; see that module for the meaning of each operation)."""

    own_bytes: int
    hosted_bytes: int
    offloaded_bytes: int
    peak_own_bytes: int
    peak_hosted_bytes: int
    peak_total_bytes: int
    peak_offloaded_bytes: int

    def add_modules(self, modules: Iterable[nn.Module]) -> None: ...
    def capture(self, key: StashKey) -> ContextManager[None]: ...
    def hold(self, key: StashKey, tensor: torch.Tensor) -> None: ...
    def release(self, key: StashKey, tensor: torch.Tensor) -> None: ...
    def release_all_of(self, key: StashKey) -> None: ...
    def reset_peaks(self) -> None: ...
    def is_empty(self) -> bool: ...
    def keys(self) -> list[StashKey]: ...
    def export(self, key: StashKey, *, to_host: bool = False) -> tuple[StashMeta, torch.Tensor]: ...
    def drop(self, key: StashKey, *, stream: Any = None) -> None: ...
    def restore(self, key: StashKey, meta: StashMeta, flat: torch.Tensor, *, stream: Any = None) -> None: ...
    def shelve(self, key: StashKey, meta: StashMeta, flat: torch.Tensor) -> None: ...
    def unshelve(self, key: StashKey) -> tuple[StashMeta, torch.Tensor]: ...
    def host(self, key: StashKey, meta: StashMeta | None, flat: torch.Tensor) -> None: ...
    def unhost(self, key: StashKey) -> tuple[StashMeta | None, torch.Tensor]: ...


def _implements(stash: ActivationStash) -> Stash:
    """The activation stash is a :class:`Stash` (mypy checks this function)."""
    return stash


class StepHooks(Protocol):
    """An add-on's state for one step (BPipe's pending transfers), called at the loop's fixed points."""

    def before_compute(self, a: Action) -> None:
        """Before every compute action, ahead of its timing."""

    def before_backward(self, key: StashKey) -> None:
        """Before a key's recompute or backward uses its saved activations."""

    def finish(self) -> None:
        """After the last action, before the step's own sends are waited."""


class Phase(enum.Enum):
    """How the executor's loop runs an action kind."""

    COMPUTE = "compute: runs stage layers, one at a time"
    PIPE_MESSAGE = "pipeline message: posted with its neighbours in one batch on the pipeline group"
    EXTENSION = "extension message: posted alone by the add-on that registered the kind (BPipe)"
    HOST_MOVE = "host move: saved activations to host memory and back, on this rank"

    @property
    def posts(self) -> bool:
        """Whether the kind's handler returns messages to post (else it runs the action itself)."""
        return self in (Phase.PIPE_MESSAGE, Phase.EXTENSION)


Posting = tuple[Transfer, "Callable[[PendingBatch], None] | None"]
"""One message to post and what to do with the batch it was posted in (or None)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Handler:
    """How the executor runs one action kind: ``run`` (compute, host move) or ``post`` (messages)."""

    owner: str
    """Who registered it (``"executor"``, ``"bpipe"``)."""
    phase: Phase
    run: Callable[[Action, StepContext], None] | None = None
    """Runs the action (:attr:`Phase.COMPUTE`, :attr:`Phase.HOST_MOVE`)."""
    post: Callable[[Action, StepContext], list[Posting]] | None = None
    """The messages the action posts (:attr:`Phase.PIPE_MESSAGE`, :attr:`Phase.EXTENSION`)."""

    def __post_init__(self) -> None:
        assert (self.post is not None) == self.phase.posts and (self.run is not None) != self.phase.posts, \
            f"{self.owner}: a {self.phase.name} handler gives {'post' if self.phase.posts else 'run'} only"


_HANDLERS: dict[ActionKind, Handler] = {}
_ADDONS: dict[str, Callable[[StepContext, dict[Any, Any]], StepHooks]] = {}


def register_handler(kind: ActionKind, handler: Handler) -> None:
    """Declare how the executor runs ``kind`` (once per kind; the core kinds and BPipe's register on import)."""
    assert kind not in _HANDLERS, f"{kind.name} registered twice ({_HANDLERS[kind].owner}, {handler.owner})"
    _HANDLERS[kind] = handler


def register_addon(owner: str, make: Callable[[StepContext, dict[Any, Any]], StepHooks]) -> None:
    """``make(ctx, kept)`` builds ``owner``'s state for each step (``kept``: what it keeps across one
    executor's steps); the context holds it under ``ctx.addons[owner]``."""
    assert owner not in _ADDONS, f"add-on {owner} registered twice"
    _ADDONS[owner] = make


def handler_table() -> tuple[Handler | None, ...]:
    """The registered handlers indexed by ``kind.code``, checked to cover every kind (:func:`kind_table`)."""
    return kind_table("executor", dict(_HANDLERS))


def addons() -> Mapping[str, Callable[[StepContext, dict[Any, Any]], StepHooks]]:
    """The registered add-ons by owner."""
    return dict(_ADDONS)


HANDSHAKE_TAG = 2**30
"""Tag of the shape handshake's messages; every action's tag is smaller."""


def message_tag(a: Action, *, rank: int, num_stages: int, num_microbatches: int, part: int = 0,
                num_parts: int = 1) -> int:
    """Tag of message ``part`` (of ``num_parts`` one action sends) of transfer action ``a`` on pipeline rank
    ``rank``: :func:`~evenpipe.schedule.validate.message_key` folded into one int, equal on both sides."""
    channel, stage, mb = message_key(rank, a)
    assert 0 <= part < num_parts and 0 <= stage < num_stages and 0 <= mb < num_microbatches, (a, part)
    tag = ((channel * num_stages + stage) * num_microbatches + mb) * num_parts + part
    assert tag < HANDSHAKE_TAG, f"tag of {a} overflows: {tag}"
    return tag


@dataclass(slots=True)
class LiveTensors:
    """The tensors one step keeps between actions, by key."""

    mb_inputs: Sequence[torch.Tensor]
    """Each micro-batch's input (token ids) of this replica."""
    mb_targets: Sequence[torch.Tensor]
    """Each micro-batch's targets."""
    inputs: dict[StashKey, torch.Tensor] = field(default_factory=dict)
    """A stage's input, kept for its backward (or recompute)."""
    outputs: dict[StashKey, torch.Tensor] = field(default_factory=dict)
    """A stage's output (the root of its backward; the loss on the last stage)."""
    out_grads: dict[StashKey, torch.Tensor] = field(default_factory=dict)
    """The gradient of a stage output, handed over locally by the next stage on this rank."""
    in_grads: dict[StashKey, torch.Tensor] = field(default_factory=dict)
    """The gradient of a stage input, waiting for its ``SEND_B``."""
    deferred_w: dict[StashKey, WeightState] = field(default_factory=dict)
    """``I`` -> ``W`` hand-off of the zero-bubble split."""
    rng: dict[StashKey, RngState] = field(default_factory=dict)
    """RNG state a recomputed stage's forward saw."""
    handoffs: dict[StashKey, torch.Tensor] = field(default_factory=dict)
    """A copy of a stage output for the next stage on this rank, made when the output was offloaded before that
    stage read it (:mod:`evenpipe.runtime.host_offload`)."""


@dataclass(slots=True, kw_only=True)
class StepContext:
    """One step on one rank as its handlers see it: the executor's fixed parts, then the step's state."""

    schedule: Schedule
    groups: ParallelGroups
    stages: Mapping[int, nn.Module]
    """This rank's stage modules by stage id."""
    loss_fn: LossFn
    stash: Stash
    device: torch.device
    free_outputs: bool
    """Free a sent output's storage (see :mod:`evenpipe.runtime.executor`)."""
    recompute_stages: frozenset[int]
    """Stages whose forward runs without a graph (the schedule recomputes them)."""
    shapes: Sequence[Mapping[int, tuple[tuple[int, ...], torch.dtype]]]
    """Per micro-batch: shape and dtype of each stage's output crossing to another rank (receive buffers)."""
    live: LiveTensors
    mail: Mailbox
    layouts: Sequence[Hashable] = ()
    """Per micro-batch, what fixes the sizes of what its stages save for backward (BPipe learns a unit's size once
    per value): its input's shape, or what the stage modules' ``activation_layout`` says (packed documents: the
    shape and every row's runs)."""
    recorder: RankRecorder | None = None
    """This rank's measured records, when tracing."""
    addons: dict[str, StepHooks] = field(default_factory=dict)
    """Each add-on's state for this step (:func:`register_addon`)."""
    current: Action | None = None
    """The action running or being posted (for error messages)."""
    loss_sum: float = 0.0
    """Sum of the micro-batch losses (each already divided by the number of micro-batches)."""
    evicted_bytes: int = 0
    """Bytes sent away with EVICT."""
    emulation: RankEmulation | None = None
    """An emulated slow rank or link this step (tests and benchmarks, :mod:`evenpipe.runtime.emulation`)."""
    compute_s: float = 0.0
    """Seconds this step's compute actions took, their waits for received inputs included (the executor
    subtracts :attr:`Mailbox.waited_s`)."""

    @property
    def last_stage(self) -> int:
        return self.schedule.num_stages - 1

    def graph_params(self, stage: int) -> list[torch.Tensor]:
        """The trainable parameters of ``stage`` as its autograd graphs hold them, for the split backward: read
        from the module now, because under FSDP (:mod:`evenpipe.runtime.sharding`) the module holds the
        gathered (unsharded) parameters from its first forward of a step until the step's gradient sync, and
        those, not the sharded ones the optimizer sees, are the graph's leaves."""
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def tag(self, a: Action, *, part: int = 0, num_parts: int = 1) -> int:
        """:func:`message_tag` of ``a`` in this schedule."""
        return message_tag(a, rank=self.groups.pp_rank, num_stages=self.schedule.num_stages,
                           num_microbatches=self.schedule.num_microbatches, part=part, num_parts=num_parts)

    def before_compute(self, a: Action) -> None:
        for hooks in self.addons.values():
            hooks.before_compute(a)

    def before_backward(self, key: StashKey) -> None:
        for hooks in self.addons.values():
            hooks.before_backward(key)

    def finish_addons(self) -> None:
        """Every add-on's end of step; then drop them (they reference this context: free the step at once)."""
        for hooks in self.addons.values():
            hooks.finish()
        self.addons.clear()
