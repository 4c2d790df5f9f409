"""Memory by category on one rank, by accounting the tensors it holds (model states) and from the executor's own
counts (activations from the stash, communication buffers from the mailbox).

Model states count each tensor's local shard (tensor parallelism, FSDP), ``numel · element_size``: parameters
(the model's weights), gradients (the model's ``.grad`` plus the fp32 ``.grad`` of bfloat16's master weights),
master weights (bfloat16's fp32 copies, of the owned parameters under ``--sharding optimizer``) and optimizer
state (AdamW's moments; its scalar step counters are not counted). FSDP's gathered weights and gradients
(``gathered_states``) are counted by :class:`evenpipe.runtime.sharding.FsdpGradientSync` when it syncs. On a
GPU, :func:`allocator_peak_bytes` adds the caching allocator's peak of the whole process.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from evenpipe.cost.categories import MEMORY_CATEGORIES
from evenpipe.runtime.tensor_parallel import local_shard

__all__ = ["state_bytes", "allocator_peak_bytes", "CategoryPeaks"]


def _nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors if t is not None)


def _chain(optimizer: Any) -> list[Any]:
    """The optimizer and every wrapper inside it (state sharding, master weights), outermost first."""
    out = [optimizer]
    while hasattr(out[-1], "inner"):
        out.append(out[-1].inner)
    return out


def state_bytes(params: Iterable[torch.Tensor], optimizer: Any) -> dict[str, int]:
    """Bytes of parameters, gradients, master weights and optimizer state this rank holds now."""
    params = list({id(p): p for p in params}.values())
    chain = _chain(optimizer)
    masters = [p for o in chain if hasattr(o, "masters") for p in o.masters.params]
    inner = chain[-1]
    moments = [v for name_state in inner.state.values() for k, v in name_state.items()
               if isinstance(v, torch.Tensor) and k != "step"]
    return {"parameters": _nbytes(params),
            "gradients": _nbytes(p.grad for p in params) + _nbytes(m.grad for m in masters),
            "master_weights": _nbytes(masters), "optimizer_state": _nbytes(moments)}


def allocator_peak_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak allocated bytes on ``device`` (None off a GPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0))


class CategoryPeaks:
    """The peak of each category over the steps of a run."""

    def __init__(self) -> None:
        self.peaks = dict.fromkeys(MEMORY_CATEGORIES, 0)

    def add(self, values: dict[str, int]) -> None:
        for k, v in values.items():
            self.peaks[k] = max(self.peaks[k], int(v))
