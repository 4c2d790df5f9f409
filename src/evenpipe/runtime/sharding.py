"""Sharded data parallelism for pipeline stages: a distributed optimizer, or full sharding with FSDP2.

Two modes beyond plain replicas (which all-reduce gradients and each keep a whole AdamW):

- **optimizer** (:class:`ShardedOptimizer`, ZeRO stage 1 / Megatron's distributed optimizer): gradients are
  still all-reduced over data parallelism, but each replica keeps AdamW state (both moments) only for the
  parameters it *owns* -- parameters are dealt to replicas whole, largest first, onto the least-loaded one --
  updates those, and broadcasts them to the other replicas. Optimizer state per rank drops to about ``1/dp``.
  Parameter granularity (not a flat buffer cut at arbitrary offsets) keeps it simple and works for DTensor
  shards unchanged: a tensor-parallel shard is owned by one replica of its tensor-parallel coordinate.
- **full** (:func:`fully_shard_stages`, FSDP2 ``fully_shard`` per stage module over the ``dp`` mesh dimension):
  parameters, gradients and optimizer state are sharded. Resharding policy for pipelines (as torchtitan and
  ``torch.distributed.pipelining`` do): parameters are gathered at a stage's first forward and stay gathered
  across all micro-batches of the step (``reshard_after_forward=False``, no resharding after each backward),
  gradients accumulate unsharded with gradient sync off, and once the schedule has run every micro-batch
  :class:`FsdpGradientSync` reduce-scatters them once and reshards (FSDP's post-backward, called by hand because
  a pipeline step is many backward calls, not one). Gradients are averaged over replicas, as without sharding.
  So a zero-bubble schedule's deferred weight pass (``W``, :mod:`evenpipe.runtime.split_backward`) needs nothing
  of FSDP: it runs on the gathered parameters, which are its graph's leaves
  (:meth:`evenpipe.runtime.step_context.StepContext.graph_params`), before the sync.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import collective, through_flat
from evenpipe.runtime.tensor_parallel import local_shard

__all__ = ["ShardedOptimizer", "deal_parameters", "fully_shard_stages", "FsdpGradientSync"]


def deal_parameters(sizes: Sequence[int], num_owners: int) -> list[int]:
    """Owner (0 .. num_owners-1) of each parameter: largest first onto the least-loaded owner (ties: lowest)."""
    load = [0] * num_owners
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        o = min(range(num_owners), key=lambda k: (load[k], k))
        owner[i] = o
        load[o] += sizes[i]
    return owner


class ShardedOptimizer:
    """An optimizer whose state is sharded over data-parallel replicas (see the module docstring).

    ``params`` is this rank's :class:`evenpipe.training.params.RankParameters`; ``make_optimizer(owned)`` builds
    the inner optimizer (AdamW) over the subset this replica owns. Gradients must already be averaged over
    replicas when :meth:`step` runs.
    """

    def __init__(self, params: Any, *, make_optimizer: Callable[[Any], Any], dp_group: Any,
                 dp_ranks: Sequence[int], dp_rank: int) -> None:
        names = sorted(params.named)  # the same order on every replica
        self.params = [params.named[n] for n in names]
        self.dp_group, self.dp_ranks = dp_group, tuple(dp_ranks)
        self.owners = deal_parameters([local_shard(p).numel() for p in self.params], len(self.dp_ranks))
        owned = {n for n, o in zip(names, self.owners) if o == dp_rank}
        if not owned:
            raise ConfigError(f"--sharding optimizer: {len(self.dp_ranks)} replicas but this pipeline rank holds "
                              f"only {len(names)} parameters; use fewer replicas or --sharding none")
        self.owned = [params.named[n] for n in names if n in owned]
        """The parameters whose optimizer state this replica keeps (and which it updates)."""
        self.inner = make_optimizer(type(params)(named={n: params.named[n] for n in names if n in owned},
                                                 owned=params.owned & owned))
        self.param_groups = self.inner.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        if len(self.dp_ranks) == 1:
            return
        for owner, src in enumerate(self.dp_ranks):  # one broadcast per owner: its updated parameters
            mine = [local_shard(p) for p, o in zip(self.params, self.owners) if o == owner]
            if not mine:
                continue
            through_flat(mine, self._broadcaster(src))

    def _broadcaster(self, src: int) -> Callable[[torch.Tensor], None]:
        def broadcast(flat: torch.Tensor) -> None:
            with collective("the broadcast of updated parameters across replicas", src):
                dist.broadcast(flat, src=src, group=self.dp_group)
        return broadcast

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def fully_shard_stages(stages: Iterable[nn.Module], dp_mesh: Any) -> "FsdpGradientSync":
    """Apply FSDP2 to each stage module over ``dp_mesh`` (in place, before building the optimizer), with the
    pipeline resharding policy; the gradient sync the executor runs after the schedule.

    A parameter two of these stages share (a tied embedding when one rank holds the first and the last stage, as
    the V-shaped schedules place them) is left out of FSDP and stays one replicated object: each stage's
    ``fully_shard`` would give it a sharded copy of its own, which would then take its gradient and its update
    apart from the other. Its gradient is averaged over replicas by the sync instead."""
    from torch.distributed.fsdp import fully_shard
    modules = list(stages)
    shared = _shared_parameters(modules)
    for m in modules:
        tied = getattr(m, "tied_params", ())  # weights tied across the pipeline's ends: find them again by name
        names = [n for n, p in m.named_parameters(remove_duplicate=False) if any(p is t for t in tied)]
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=False,
                    ignored_params={p for p in m.parameters() if id(p) in shared} or None)
        if tied:
            setattr(m, "tied_params", tuple({id(q): q for q in (m.get_parameter(n) for n in names)}.values()))
    sync = FsdpGradientSync(modules, replicated=list(shared.values()), dp_group=dp_mesh.get_group())
    sync.accumulate()
    return sync


def _shared_parameters(modules: Sequence[nn.Module]) -> dict[int, nn.Parameter]:
    """Parameters (by id) that more than one of ``modules`` holds."""
    seen: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
            params[id(p)] = p
    return {i: p for i, p in params.items() if seen[i] > 1}


class FsdpGradientSync:
    """Run by the executor once per step after the last backward: reduce-scatter and reshard every stage, and
    average the gradients of the ``replicated`` parameters (left out of FSDP) over ``dp_group``."""

    def __init__(self, modules: Sequence[nn.Module], *, replicated: Sequence[nn.Parameter] = (),
                 dp_group: Any = None) -> None:
        self.modules = list(modules)
        self.replicated = list(replicated)
        self.dp_group = dp_group
        self.gathered_bytes = 0
        """Bytes of the whole weights and unsharded gradients FSDP held when the last sync began (the peak of a
        step: the weights stay gathered and the gradients accumulate until then)."""

    def accumulate(self) -> None:
        """Micro-batch mode: no gradient sync, no resharding after a backward."""
        for m in self.modules:
            m.set_is_last_backward(False)  # type: ignore[operator]
            m.set_reshard_after_backward(False)  # type: ignore[operator]
            m.set_requires_gradient_sync(False)  # type: ignore[operator]

    def __call__(self) -> None:
        from torch.distributed.fsdp import fully_shard
        self.gathered_bytes = _gathered_bytes(self.modules)
        for m in self.modules:
            m.set_is_last_backward(True)  # type: ignore[operator]
            m.set_reshard_after_backward(True)  # type: ignore[operator]
            m.set_requires_gradient_sync(True)  # type: ignore[operator]
            state = fully_shard.state(m)  # type: ignore[attr-defined]
            with collective("the FSDP gradient reduce-scatter across replicas"):
                self._post_backward(state)
        self.accumulate()
        if self.replicated:
            self._average_replicated()

    def _average_replicated(self) -> None:
        size = dist.get_world_size(self.dp_group)
        grads = []
        for p in self.replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local_shard(p.grad))

        def mean(flat: torch.Tensor) -> None:
            with collective("the gradient all-reduce of parameters shared by stages across replicas"):
                dist.all_reduce(flat, group=self.dp_group)
            flat /= size
        through_flat(grads, mean, dtype=torch.float32)

    @staticmethod
    def _post_backward(state: Any) -> None:
        """FSDP's post-backward for every parameter group of ``state``'s module, then its final callback."""
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def _gathered_bytes(modules: Sequence[nn.Module]) -> int:
    """What FSDP holds of ``modules`` besides the shards: each unsharded parameter's all-gather output and its
    unsharded (and accumulated) gradient, local to this tensor-parallel rank."""
    from torch.distributed.fsdp import fully_shard
    total = 0
    for m in modules:
        for group in fully_shard.state(m)._fsdp_param_groups:  # type: ignore[attr-defined]
            for fp in group.fsdp_params:
                total += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
                unsharded = getattr(fp, "_unsharded_param", None)
                for g in (None if unsharded is None else unsharded.grad, fp.unsharded_accumulated_grad):
                    if g is not None:
                        total += local_shard(g).numel() * local_shard(g).element_size()
    return total
