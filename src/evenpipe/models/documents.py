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

    ``doc_ids`` ``[B, T]`` (int), ``positions`` ``[B, T]`` (int64, the index of each token inside its document)
    and ``mask`` ``[B, 1, T, T]`` (bool, True where a query may attend a key: same document and not in the future).
    """

    __slots__ = ("doc_ids", "positions", "mask")

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
        # same run (not just the same id): a run's start index names it uniquely within the row
        same = run_start[:, :, None] == run_start[:, None, :]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
        self.mask = (same & causal).unsqueeze(1)

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
