"""The shape of one micro-batch: rows of a sequence length, or documents of varying length (issue 34).

A micro-batch's work is linear in the tokens it computes (matrices, norms, the boundary message) and, in
attention, quadratic in each document's length: under a per-document (block-diagonal causal) mask a document of
``n`` tokens scores ``n**2`` pairs (half of them under the causal mask), so the attention work is proportional to
the sum of its documents' squared lengths. A padded micro-batch of ``b`` rows of ``s`` tokens computes ``b·s``
tokens and ``b·s**2`` squared length; that is the default, and the cost sources' fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evenpipe.errors import ConfigError

__all__ = ["MicrobatchShape"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchShape:
    """The shape of one micro-batch."""

    size: int
    """Sequences (rows) per micro-batch (b)."""
    seq_len: int
    """Tokens per row (s): the longest a row may hold."""
    tokens: int | None = None
    """Tokens computed (documents plus any padding); None: ``size * seq_len``, every row full."""
    squared_lengths: int | None = None
    """Sum over its documents (or padded rows) of their squared lengths; None: ``size * seq_len**2``."""

    def __post_init__(self) -> None:
        if self.tokens is not None and not 0 < self.tokens <= self.size * self.seq_len:
            raise ConfigError(f"a micro-batch of {self.size} x {self.seq_len} tokens cannot compute {self.tokens} "
                              f"tokens; allowed 1..{self.size * self.seq_len}")
        if self.squared_lengths is not None and self.squared_lengths < 0:
            raise ConfigError(f"squared lengths must be >= 0, got {self.squared_lengths}")

    @property
    def padded(self) -> bool:
        """Whether every row is full (``tokens`` and ``squared_lengths`` left to their defaults)."""
        return self.tokens is None and self.squared_lengths is None

    @property
    def num_tokens(self) -> int:
        """Tokens computed."""
        return self.size * self.seq_len if self.tokens is None else self.tokens

    @property
    def sum_squares(self) -> int:
        """Sum of squared document lengths."""
        return self.size * self.seq_len ** 2 if self.squared_lengths is None else self.squared_lengths

    @classmethod
    def of_documents(cls, lengths: Sequence[int], *, size: int, seq_len: int) -> "MicrobatchShape":
        """The shape of ``size`` rows of ``seq_len`` holding documents of ``lengths`` (no padding computed);
        the padded shape when they fill every row exactly with one document each."""
        tokens, squares = sum(lengths), sum(n * n for n in lengths)
        if tokens == size * seq_len and squares == size * seq_len ** 2:
            return cls(size=size, seq_len=seq_len)
        return cls(size=size, seq_len=seq_len, tokens=tokens, squared_lengths=squares)
