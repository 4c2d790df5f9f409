"""The flat, layout-free state dictionary a checkpoint stores, in every training mode.

Keys are canonical parameter names (the whole model's), never stage indices or ranks, and values are float32 in
the un-sharded model's layout, so a checkpoint saved by one job loads into any other that trains the same model:

- ``model/<name>``: the weights the optimizer steps -- the fp32 master under ``--dtype bfloat16``, else the
  parameter;
- ``optim/<name>/<exp_avg | exp_avg_sq | step>``: AdamW's state of that tensor.

Each mode's tensors go in as they are, and torch.distributed.checkpoint (DCP) writes and reads every shard:

- **tensor parallelism, FSDP** (``--sharding full``): weights and moments are DTensors; DCP saves their shards
  under the global shape and a later job of any tensor-parallel / data-parallel degree reads the pieces it needs.
  The fused q/k/v weight is the exception: tensor parallelism reorders its rows rank-major
  (:mod:`evenpipe.runtime.tensor_parallel`), so its tensors are gathered, put back in the model's order and
  saved whole; a load reorders them for this job's degree and keeps the local shard.
- **optimizer-state sharding** (``--sharding optimizer``): a replica holds AdamW state (and, in bfloat16, the
  master) only for the parameters it owns; it saves those, and another replica the rest. Plain tensors that
  several ranks hold (replicas, tied weights, tensor-parallel copies) are identical and DCP writes them once.
- **bfloat16**: a parameter without a master here (another replica owns it) is loaded in fp32 and rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from evenpipe.training.params import RankParameters

__all__ = ["CheckpointTarget", "checkpoint_target", "save_entries", "LoadPlan", "load_plan"]

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
_ROW_ORDER = "_evenpipe_tp_row_order"
"""Attribute tensor parallelism sets on a q/k/v linear whose rows it reordered (see runtime.tensor_parallel)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Slot:
    """One canonical parameter as this rank holds it."""

    param: nn.Parameter
    """The model's parameter (maybe bf16, maybe a DTensor)."""
    stepped: torch.Tensor | None
    """The fp32 tensor AdamW steps (the master or the parameter) when this rank steps it, else None."""
    optimizer: torch.optim.Optimizer | None
    """The torch optimizer holding ``stepped``'s state."""
    row_order: torch.Tensor | None
    """Tensor parallelism's row permutation of this parameter, when it has one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointTarget:
    """What a rank saves and loads: its parameters with their optimizer state, by canonical name."""

    slots: dict[str, _Slot]


def _unwrap(optimizer: Any) -> tuple[torch.optim.Optimizer, set[int] | None, dict[int, torch.Tensor]]:
    """The torch optimizer, the ids of the parameters this replica owns (None: all) and the fp32 masters."""
    owned: set[int] | None = None
    masters: dict[int, torch.Tensor] = {}
    if hasattr(optimizer, "owned") and hasattr(optimizer, "inner"):  # ShardedOptimizer
        owned = {id(p) for p in optimizer.owned}
        optimizer = optimizer.inner
    if hasattr(optimizer, "masters"):  # MasterWeightOptimizer
        masters = {id(p): m for p, m in zip(optimizer.masters.model_params, optimizer.masters.params)}
        optimizer = optimizer.inner
    return optimizer, owned, masters


def _row_orders(stages: Iterable[nn.Module]) -> dict[int, torch.Tensor]:
    """Row permutation of every parameter that tensor parallelism reordered, by parameter id."""
    out: dict[int, torch.Tensor] = {}
    for stage in stages:
        for module in stage.modules():
            order = getattr(module, _ROW_ORDER, None)
            if order is not None:
                for p in module.parameters(recurse=False):
                    out[id(p)] = order
    return out


def checkpoint_target(params: RankParameters, optimizer: Any,
                      stages: Iterable[nn.Module] = ()) -> CheckpointTarget:
    """This rank's :class:`CheckpointTarget`; ``stages`` are its stage modules (for tensor parallelism's
    reordered rows)."""
    inner, owned, masters = _unwrap(optimizer)
    orders = _row_orders(stages)
    slots = {}
    for name, p in params.named.items():
        mine = owned is None or id(p) in owned
        stepped = masters.get(id(p)) if masters else (p if mine else None)
        slots[name] = _Slot(param=p, stepped=stepped, optimizer=inner if stepped is not None else None,
                            row_order=orders.get(id(p)))
    return CheckpointTarget(slots=slots)


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of ``p``, created (zeros, step 0) when it does not exist yet, so a load has a target."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _canonical(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``t`` as saved: itself, or (reordered rows) gathered and put back in the model's row order (collective
    over ``t``'s mesh)."""
    if order is None or t.dim() == 0:
        return t.detach()
    from evenpipe.runtime.tensor_parallel import full_tensor
    full = full_tensor(t.detach())
    out = torch.empty_like(full)
    out[order.to(full.device)] = full
    return out


def _slot_tensors(name: str, slot: _Slot) -> dict[str, torch.Tensor]:
    """The live fp32 tensors of ``slot`` under their keys (none when another replica saves them)."""
    out: dict[str, torch.Tensor] = {}
    if slot.stepped is not None:
        out[f"model/{name}"] = slot.stepped
        assert slot.optimizer is not None
        adam = _adam_state(slot.optimizer, slot.stepped)
        out.update({f"optim/{name}/{key}": adam[key] for key in ADAM_KEYS})
    elif slot.param.dtype == torch.float32:
        out[f"model/{name}"] = slot.param
    return out


def save_entries(target: CheckpointTarget) -> dict[str, torch.Tensor]:
    """The state dictionary this rank contributes to a save (collective for reordered tensor-parallel rows:
    every rank of a stage calls it, in the same name order)."""
    sd: dict[str, torch.Tensor] = {}
    for name in sorted(target.slots):
        slot = target.slots[name]
        sd.update({k: _canonical(v, slot.row_order) for k, v in _slot_tensors(name, slot).items()})
    return sd


@dataclass(slots=True, kw_only=True)
class LoadPlan:
    """What a load reads (``state_dict``, DCP fills it in place) and how to finish (:meth:`finish`)."""

    state_dict: dict[str, torch.Tensor]
    """Key -> the tensor DCP reads into: a live tensor, or a buffer copied afterwards."""
    copies: list[tuple[torch.Tensor, str, torch.Tensor | None]]
    """(live tensor, key, row order): buffers to move into live tensors after the read."""
    rounds: list[tuple[nn.Parameter, torch.Tensor]]
    """(model parameter, fp32 source): parameters refreshed from their loaded weights."""

    @torch.no_grad()
    def finish(self) -> None:
        """Move the read buffers into the live tensors, then refresh the model's parameters."""
        for live, key, order in self.copies:
            _localize_into(live, self.state_dict[key], order)
        for p, source in self.rounds:
            p.copy_(source)


def load_plan(target: CheckpointTarget) -> LoadPlan:
    """The tensors to read for ``target``: every weight this rank holds, and AdamW state for what it steps."""
    plan = LoadPlan(state_dict={}, copies=[], rounds=[])
    for name in sorted(target.slots):
        slot = target.slots[name]
        live = _slot_tensors(name, slot)
        key = f"model/{name}"
        if key not in live:  # bf16 weight stepped by another replica: read it in fp32, round it in
            live[key] = torch.empty_like(slot.param, dtype=torch.float32)
        for k, t in live.items():
            order = slot.row_order if t.dim() else None
            if order is not None:
                plan.state_dict[k] = torch.empty(tuple(t.shape), dtype=t.dtype)
                plan.copies.append((t, k, order))
            else:
                plan.state_dict[k] = t.detach()
        if live[key] is not slot.param:
            plan.rounds.append((slot.param, live[key]))
    return plan


def _localize_into(live: torch.Tensor, full: torch.Tensor, order: torch.Tensor | None) -> None:
    """Copy this rank's part of ``full`` (the whole tensor in the model's layout) into ``live``."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if order is not None:
        full = full[order]
    if isinstance(live, DTensor):
        piece = distribute_tensor(full.to(live.device), live.device_mesh, live.placements, src_data_rank=None)
        live.to_local().copy_(piece.to_local())
    else:
        live.copy_(full)


def missing_weights(target: CheckpointTarget, saved: Mapping[str, Any]) -> list[str]:
    """Canonical names of this rank's parameters that a checkpoint's keys ``saved`` lack."""
    return sorted(name for name in target.slots if f"model/{name}" not in saved)
