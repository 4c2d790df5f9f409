"""Document boundaries inside packed rows: positions that restart per document and a block-diagonal causal mask,
so a row holding several documents trains exactly like each document on its own.

A packed micro-batch is ``[B, T]`` tokens plus ``doc_ids`` ``[B, T]``: the document each token belongs to. A
document is a contiguous run of equal ids in its row (ids need not be sorted or distinct across rows); padding is
its own run (its targets are ignored, and giving it an id keeps every query with at least one key, so no softmax
row is empty). Token ``i`` may attend to token ``j`` of the same row when ``j <= i`` and both lie in the same run.

Passing no :class:`Documents` (``documents=None``) leaves every model on its unmasked causal path, unchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["Documents", "doc_ids_from_lengths"]


class Documents:
    """Per-token document structure of one micro-batch, computed once per forward and shared by every block.

    ``doc_ids`` ``[B, T]`` (int), ``positions`` ``[B, T]`` (int64, the index of each token inside its document),
    ``mask`` ``[B, 1, T, T]`` (bool, True where a query may attend a key: same document and not in the future) and
    ``segments``: per row, each run's ``(start, end)``; the last two are computed when first asked for.
    """

    __slots__ = ("doc_ids", "positions", "_run_start", "_mask", "_segments")

    def __init__(self, doc_ids: torch.Tensor) -> None:
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [batch, seq], got shape {tuple(doc_ids.shape)}")
        self.doc_ids = doc_ids
        seq = doc_ids.shape[1]
        index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # a new run begins here
        run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        self.positions = index - run_start
        self._run_start = run_start
        self._mask: torch.Tensor | None = None
        self._segments: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool: True where a query may attend a key."""
        if self._mask is None:
            run_start, seq = self._run_start, self._run_start.shape[1]
            # same run (not just the same id): a run's start index names it uniquely within the row
            same = run_start[:, :, None] == run_start[:, None, :]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=run_start.device).tril()
            self._mask = (same & causal).unsqueeze(1)
        return self._mask

    @property
    def segments(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per row, the ``(start, end)`` of each run in order (read to the host once)."""
        if self._segments is None:
            batch, seq = self.positions.shape
            at: list[list[int]] = [[] for _ in range(batch)]
            for row, col in (self.positions == 0).nonzero().tolist():
                at[row].append(col)
            self._segments = tuple(tuple(zip(a, a[1:] + [seq])) for a in at)
        return self._segments

    def to(self, device: "torch.device | str") -> "Documents":
        """The same structure on ``device``."""
        return Documents(self.doc_ids.to(device))

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return (int(self.doc_ids.shape[0]), int(self.doc_ids.shape[1]))


def doc_ids_from_lengths(rows: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """``[len(rows), seq_len]`` int64 document ids for rows of documents of the given lengths, packed from the
    left; each row's remainder (padding) gets one more id. ``ValueError`` if a row's lengths exceed ``seq_len``."""
    out = torch.empty(len(rows), seq_len, dtype=torch.int64)
    for r, lengths in enumerate(rows):
        if any(n < 1 for n in lengths) or sum(lengths) > seq_len:
            raise ValueError(f"row {r}: document lengths {list(lengths)} must be >= 1 and sum to at most {seq_len}")
        ids = [i for i, n in enumerate(lengths) for _ in range(n)]
        out[r] = torch.tensor(ids + [len(lengths)] * (seq_len - len(ids)), dtype=torch.int64)
    return out
