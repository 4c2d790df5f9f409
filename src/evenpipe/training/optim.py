"""The optimizer of one rank: AdamW with weight-decay groups, a warm-up + cosine learning rate, and gradient
clipping by the whole model's norm (summed over every pipeline rank, each parameter once).

Weight decay applies to parameters with two or more dimensions (linear weights, embeddings); biases and norm gains
(one dimension) are not decayed, as in GPT-3 and nanoGPT. Groups list parameters in canonical-name order, so the
optimizer's layout is a function of the parameters this rank holds, not of construction order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from evenpipe.runtime.comm import ParallelGroups, collective
from evenpipe.runtime.tensor_parallel import local_shard
from evenpipe.training.config import OptimizerOptions
from evenpipe.training.params import RankParameters

__all__ = ["build_optimizer", "build_lr_scheduler", "global_grad_norm", "clip_grad_global_norm", "decays"]


def decays(param: nn.Parameter) -> bool:
    """Whether weight decay applies: matrices and embeddings yes, biases and norm gains no."""
    return param.dim() >= 2


def build_optimizer(params: RankParameters, opts: OptimizerOptions) -> torch.optim.AdamW:
    """AdamW over this rank's parameters: a decayed group and an undecayed one (empty groups left out)."""
    names = sorted(params.named)
    decayed = [params.named[n] for n in names if decays(params.named[n])]
    plain = [params.named[n] for n in names if not decays(params.named[n])]
    groups = [g for g in ({"params": decayed, "weight_decay": opts.weight_decay},
                          {"params": plain, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=opts.betas, eps=opts.eps)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, opts: OptimizerOptions, *, total_steps: int,
                       start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Sets the learning rate of step ``k`` to :meth:`OptimizerOptions.lr_at` (call ``.step()`` after each
    optimizer step). ``start_step`` > 0 resumes the schedule there, computing the rate exactly as an
    uninterrupted run would (``initial_lr * factor``)."""
    def factor(k: int) -> float:
        return opts.lr_at(k, total_steps=total_steps) / opts.lr
    if start_step == 0:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", opts.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)


def global_grad_norm(params: RankParameters, groups: ParallelGroups) -> float:
    """L2 norm of the whole model's gradient: squares of the owned gradients, summed in float64 over the
    pipeline ranks of this replica (replicas hold the same averaged gradients, so they are not summed).

    A sharded gradient (a DTensor: tensor parallelism, FSDP) contributes its local shard; its shards are summed
    over the tensor-parallel group and, under FSDP, the data-parallel group. A gradient that those ranks hold
    identical copies of is divided by the number of copies first, so every element counts once."""
    owned = [p.grad for p in params.owned_parameters if p.grad is not None]
    device = local_shard(owned[0]).device if owned else local_shard(next(iter(params.named.values()))).device
    over_dp = groups.dp > 1 and any("dp" in _sharded_dims(g) for g in owned)
    sizes = {"tp": groups.tp, "dp": groups.dp if over_dp else 1}
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in owned:
        sharded = _sharded_dims(g)
        copies = math.prod(n for dim, n in sizes.items() if dim not in sharded)
        total += torch.linalg.vector_norm(local_shard(g).detach(), dtype=torch.float64) ** 2 / copies
    total = total.reshape(1)
    for group, size in ((groups.pp_group, groups.pp), (groups.tp_group, groups.tp),
                        (groups.dp_group, sizes["dp"])):
        if size > 1:
            with collective("the gradient-norm all-reduce"):
                dist.all_reduce(total, group=group)
    return math.sqrt(float(total.sum()))


def _sharded_dims(t: torch.Tensor) -> set[str]:
    """Names of the device-mesh dimensions a DTensor is sharded over (none for a plain tensor); FSDP's
    ``_StridedShard`` counts too (anything not replicated: gradients are never partial here)."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", ())
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return {name for name, pl in zip(names, placements) if not pl.is_replicate()}


def clip_grad_global_norm(params: RankParameters, groups: ParallelGroups, max_norm: float | None) -> float:
    """Scale every gradient of this rank so the whole model's norm is at most ``max_norm`` (None: only measure);
    returns the norm before clipping."""
    norm = global_grad_norm(params, groups)
    if max_norm is not None and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params.named.values():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
