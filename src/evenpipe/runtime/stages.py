"""Cut a model into pipeline stages.

A *stage* is a contiguous run of blocks; stage 0 also holds the model's ``first`` part (embeddings) and the
last stage its ``last`` part (final norm and head). With interleaving, ``num_stages`` counts every virtual
chunk (``ranks * V``) and a layout gives one entry per chunk, in pipeline order; which rank runs which stage is
the schedule's ``stage_to_rank``, not this module's business.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from torch import nn

from evenpipe.cost.parallel import check_layout
from evenpipe.errors import ConfigError
from evenpipe.models.documents import Documents
from evenpipe.models.lm import PipelineParts

__all__ = ["partition_layers", "stage_block_counts", "StageModule", "build_stage_modules", "param_count"]


def _check_layout(num_blocks: int, num_stages: int, layout: Sequence[int]) -> tuple[range, ...]:
    check_layout(num_blocks, num_stages, list(layout))
    bounds = [0]
    for c in layout:
        bounds.append(bounds[-1] + c)
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


def _balanced(weights: Sequence[float], num_stages: int, first: float, last: float) -> list[int]:
    """Contiguous split minimising the heaviest stage, then the sum of squared stage weights (dynamic
    programme, O(stages * blocks^2)); ``first`` and ``last`` weigh on stage 0 and the last stage."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max, sum of squares) for blocks[:i] in k stages; cut[k][i]: start of the k-th stage
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                w = prefix[i] - prefix[j] + (first if k == 1 else 0.0) + (last if k == num_stages else 0.0)
                cand = (max(prev[0], w), prev[1] + w * w)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def partition_layers(num_blocks: int, num_stages: int, *, layout: Sequence[int] | None = None,
                     block_weights: Sequence[float] | None = None, first_weight: float = 0.0,
                     last_weight: float = 0.0) -> tuple[range, ...]:
    """Block index ranges, one per stage (virtual chunk), covering ``0 .. num_blocks-1`` exactly once.

    ``layout`` gives the number of blocks per stage, e.g. ``[5, 6, 6, 5]``; otherwise the split is balanced
    by ``block_weights`` (default: 1 per block) plus ``first_weight`` on stage 0 and ``last_weight`` on the
    last stage. A layout that drops or duplicates a block, or leaves a stage empty, is a ConfigError.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages must be a positive integer, got {num_stages!r}")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if layout is not None:
        return _check_layout(num_blocks, num_stages, layout)
    if num_stages > num_blocks:
        raise ConfigError(f"{num_stages} stages need at least {num_stages} blocks, the model has {num_blocks}; "
                          "use fewer stages (or virtual chunks) or a deeper model")
    weights = [1.0] * num_blocks if block_weights is None else [float(w) for w in block_weights]
    if len(weights) != num_blocks:
        raise ConfigError(f"block_weights has {len(weights)} entries for {num_blocks} blocks")
    if any(not w >= 0 for w in weights + [first_weight, last_weight]):
        raise ConfigError(f"block weights must be >= 0, got {weights} (first {first_weight}, last {last_weight})")
    return _check_layout(num_blocks, num_stages, _balanced(weights, num_stages, first_weight, last_weight))


def stage_block_counts(model_config: Any, num_stages: int, layout: Sequence[int] | None) -> tuple[int, ...]:
    """Blocks per stage as the runtime builds them (the given layout, or balanced by parameters)."""
    ranges = partition_layers(model_config.num_layers, num_stages, layout=layout,
                              block_weights=[model_config.params_per_layer] * model_config.num_layers,
                              first_weight=model_config.embedding_params,
                              last_weight=model_config.final_norm_params + model_config.vocab * model_config.hidden)
    return tuple(len(r) for r in ranges)


def param_count(module: nn.Module) -> int:
    """Number of parameter elements of ``module``."""
    return sum(p.numel() for p in module.parameters())


class StageModule(nn.Module):
    """One pipeline stage: ``first`` (on stage 0), blocks ``layers``, ``last`` (on the last stage).

    ``forward`` maps tokens (stage 0) or hidden states to hidden states, or to logits on the last stage.
    The submodules are the model's own, so parameters are shared with the model the parts came from.
    """

    def __init__(self, *, stage: int, num_stages: int, layers: range, blocks: Sequence[nn.Module],
                 first: nn.Module | None, last: nn.Module | None) -> None:
        super().__init__()
        self.stage = stage
        """Stage index in pipeline order (virtual chunks counted)."""
        self.num_stages = num_stages
        """Total number of stages."""
        self.layers = layers
        """Indices of the model's blocks this stage runs."""
        self.first = first
        self.blocks = nn.ModuleList(blocks)
        self.last = last
        self.packed = False
        """Rows of several documents whose boundaries travel with the activations (see :meth:`packed_forward`)."""
        self.sequence_group: Any = None
        """The tensor-parallel group when sequence parallelism shards the hidden states over the sequence (set by
        :func:`evenpipe.runtime.tensor_parallel.parallelize_stage`): the document channel follows the slices."""
        self.tied_params: tuple[nn.Parameter, ...] = ()
        """Parameters of ``first``/``last`` tied to a weight of the other end (see ``PipelineParts.tied``)."""

    @property
    def is_first(self) -> bool:
        """Stage 0: takes tokens."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """The last stage: returns logits."""
        return self.stage == self.num_stages - 1

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: the micro-batch's document boundaries (packed rows), or None for plain causal rows.
        With :attr:`packed` set, the boundaries travel inside ``x`` instead (see :meth:`packed_forward`)."""
        if self.packed:
            return self.packed_forward(x)
        if documents is None:
            if self.first is not None:
                x = self.first(x)
            for block in self.blocks:
                x = block(x)
        else:
            if self.first is not None:
                x = self.first(x, documents)
            for block in self.blocks:
                x = block(x, documents)
        if self.last is not None:
            x = self.last(x)
        return x

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A packed micro-batch, its document boundaries carried by the activations themselves, so that any
        schedule, recomputation, BPipe move or shape exchange handles them like any other activation.

        Stage 0 takes ``[b, 2, T]`` int64: tokens, then each token's document id (a run of equal ids is one
        document). Between stages the hidden state carries one more channel, ``[b, T, h + 1]``: 1.0 where a
        document starts, else 0.0 (exact in every dtype; no gradient flows through it). The last stage returns
        logits ``[b, T, vocab]`` as usual."""
        if self.first is not None:
            x, doc_ids = x[:, 0], x[:, 1]
        else:
            x, starts = x[..., :-1], x[..., -1].detach()
            if self.sequence_group is not None:  # this rank's slice of the starts: the document ids need all
                from evenpipe.runtime.sequence_parallel import gather_sequence
                starts = gather_sequence(starts, self.sequence_group)
            doc_ids = torch.cumsum(starts != 0, dim=1)
        documents = Documents(doc_ids)
        if self.first is not None:
            x = self.first(x, documents)
        for block in self.blocks:
            x = block(x, documents)
        if self.last is not None:
            return self.last(x)
        starts = (documents.positions == 0).to(x.dtype)
        if self.sequence_group is not None:
            from evenpipe.runtime.sequence_parallel import scatter_sequence
            starts = scatter_sequence(starts, self.sequence_group)
        return torch.cat([x, starts.unsqueeze(-1)], dim=-1)

    def activation_layout(self, tokens: torch.Tensor) -> Hashable:
        """What fixes the sizes of what a micro-batch of stage-0 input ``tokens`` saves for backward on any stage
        (BPipe learns a unit's size once per value): the shape, and for packed documents every row's runs, since
        the reference models' attention core runs, and saves, once per document."""
        if not self.packed:
            return tuple(tokens.shape)
        return tuple(tokens.shape), Documents(tokens[:, 1]).segments

    def extra_repr(self) -> str:
        return f"stage={self.stage}/{self.num_stages}, layers={self.layers.start}..{self.layers.stop - 1}"


def build_stage_modules(parts: PipelineParts, *, num_stages: int, stages: Sequence[int],
                        layout: Sequence[int] | None = None) -> dict[int, StageModule]:
    """The :class:`StageModule` of each stage id in ``stages``, sharing parameters with ``parts``.

    Without ``layout`` the blocks are balanced by parameter count, the embedding counting on stage 0 and
    the head on the last stage (see :func:`partition_layers`).
    """
    ranges = partition_layers(
        len(parts.blocks), num_stages, layout=layout,
        block_weights=[param_count(b) for b in parts.blocks],
        first_weight=param_count(parts.first), last_weight=param_count(parts.last))
    wanted = list(stages)
    bad = [s for s in wanted if not isinstance(s, int) or not 0 <= s < num_stages]
    if bad:
        raise ConfigError(f"stage id {bad[0]!r} is out of range; stages are 0..{num_stages - 1}")
    if len(set(wanted)) != len(wanted):
        raise ConfigError(f"stage ids {wanted} repeat a stage")
    out = {
        s: StageModule(stage=s, num_stages=num_stages, layers=ranges[s],
                       blocks=[parts.blocks[i] for i in ranges[s]],
                       first=parts.first if s == 0 else None,
                       last=parts.last if s == num_stages - 1 else None)
        for s in wanted
    }
    for mod in out.values():
        tied = [mod.first.get_parameter(a) for a, _ in parts.tied] if mod.first is not None else []
        tied += [mod.last.get_parameter(b) for _, b in parts.tied] if mod.last is not None else []
        mod.tied_params = tuple({id(p): p for p in tied}.values())
    return out
