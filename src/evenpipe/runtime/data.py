"""Training data: byte-level tokens from a text corpus (the shipped one or a file the user names), a pre-tokenised
token file (:mod:`evenpipe.runtime.token_file`) or uniformly random tokens.

Every batch is a pure function of ``(seed, step)``, so every rank can compute the same global batch and take
its slice: data-parallel replica ``r`` of ``R`` gets rows ``[r*B/R, (r+1)*B/R)`` of the ``B`` rows, cut into
micro-batches in order. Targets are the inputs shifted by one token.

Held-out data (``held_out=True``, for ``--eval-every``): the last 5% of a corpus or of a token file's windows is
never trained on and :meth:`TokenBatches.eval_batch` reads it in order; random tokens draw evaluation batches from
their own stream. Without a split, training uses all the data (and batches are what they always were).
"""

from __future__ import annotations

import enum
import hashlib
import importlib.resources
import math
import pathlib
from dataclasses import dataclass

import torch

from evenpipe.errors import ConfigError, parse_choice
from evenpipe.runtime.token_file import HELD_OUT_FRACTION, TokenFile

__all__ = ["TokenSource", "parse_token_source", "Batch", "MicroBatches", "TokenBatches", "read_corpus",
           "shipped_corpus_path"]

BYTE_VOCAB = 256
"""Byte-level tokens: each byte of the text is one token."""


class TokenSource(enum.Enum):
    """Where tokens come from."""

    CORPUS = "corpus"
    """Random windows of a text file's bytes."""
    RANDOM = "random"
    """Uniform random tokens in ``[0, vocab)`` (nothing to learn; for timing and memory)."""
    TOKENS = "tokens"
    """A pre-tokenised flat uint16/uint32 file, read by memory map, windows in a per-epoch permutation."""
    DOCUMENTS = "documents"
    """Whole documents with their boundaries, packed into rows (:mod:`evenpipe.runtime.document_batches`)."""


def parse_token_source(value: "str | TokenSource") -> TokenSource:
    """``"corpus"`` / ``"random"`` -> :class:`TokenSource`; else ConfigError."""
    return parse_choice(TokenSource, value, "data source")


def shipped_corpus_path() -> pathlib.Path:
    """The small corpus shipped with evenpipe (see ``evenpipe/data/README.md``)."""
    return pathlib.Path(str(importlib.resources.files("evenpipe") / "data" / "corpus.txt"))


def read_corpus(path: "str | pathlib.Path | None" = None) -> torch.Tensor:
    """A file's bytes as int64 tokens ``[N]`` (the shipped corpus when ``path`` is None)."""
    p = shipped_corpus_path() if path is None else pathlib.Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read corpus {str(p)!r}: {exc.strerror}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Token ids and next-token targets, both ``[batch, seq]`` int64."""

    tokens: torch.Tensor
    """Model input."""
    targets: torch.Tensor
    """``tokens`` shifted left by one position (the next token at each position)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatches:
    """A step's micro-batches when they differ in shape: ``dp x M`` of them, replica by replica, each in the
    order it runs. ``tokens``/``targets`` are the lists :meth:`evenpipe.runtime.executor.PipelineExecutor.step`
    takes."""

    parts: tuple[Batch, ...]

    @property
    def tokens(self) -> list[torch.Tensor]:
        """Each micro-batch's model input."""
        return [p.tokens for p in self.parts]

    @property
    def targets(self) -> list[torch.Tensor]:
        """Each micro-batch's targets."""
        return [p.targets for p in self.parts]

    @property
    def computed_tokens(self) -> int:
        """Positions computed, padding included (the targets' elements)."""
        return sum(p.targets.numel() for p in self.parts)

    def real_tokens(self, ignore_index: int = -100) -> int:
        """Positions with a target (padding has ``ignore_index``)."""
        return sum(int((p.targets != ignore_index).sum()) for p in self.parts)


def _generator(seed: int, step: "int | str") -> torch.Generator:
    digest = hashlib.blake2b(f"data:{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _batch(rows: torch.Tensor) -> Batch:
    return Batch(tokens=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous())


class TokenBatches:
    """Deterministic batches of ``seq_len`` tokens from ``source`` (see module docstring)."""

    def __init__(self, *, source: "TokenSource | str" = TokenSource.CORPUS, seq_len: int, vocab: int = BYTE_VOCAB,
                 seed: int = 0, path: "str | pathlib.Path | None" = None, token_dtype: str = "uint16",
                 held_out: bool = False) -> None:
        self.source = parse_token_source(source)
        if seq_len < 1:
            raise ConfigError(f"sequence length must be >= 1, got {seq_len}")
        if vocab < 2:
            raise ConfigError(f"vocabulary size must be >= 2, got {vocab}")
        self.seq_len, self.vocab, self.seed, self.held_out = seq_len, vocab, seed, held_out
        self.corpus: torch.Tensor | None = None
        self.token_file: TokenFile | None = None
        self.train_bytes = 0
        if self.source is TokenSource.CORPUS:
            if vocab < BYTE_VOCAB:
                raise ConfigError(f"byte-level text needs a vocabulary of at least {BYTE_VOCAB}, the model has "
                                  f"{vocab}; use --random-tokens, --tokens, or a larger vocabulary")
            self.corpus = read_corpus(path)
            n = self.corpus.numel()
            self.train_bytes = n - math.ceil(n * HELD_OUT_FRACTION) if held_out else n
            if min(self.train_bytes, n - self.train_bytes if held_out else n) < seq_len + 1:
                raise ConfigError(f"corpus has {n} bytes, fewer than seq_len + 1 = {seq_len + 1}"
                                  f"{' in its training or its held-out part (the last 5%)' if held_out else ''}")
        elif self.source is TokenSource.TOKENS:
            if path is None:
                raise ConfigError("the data source 'tokens' needs a token file (--tokens PATH)")
            self.token_file = TokenFile(path, dtype=token_dtype, seq_len=seq_len, vocab=vocab, seed=seed,
                                        held_out=held_out)
        elif path is not None:
            raise ConfigError("a corpus path was given but the data source is 'random'; drop one of them")

    def batch(self, step: int, batch_size: int) -> Batch:
        """The global training batch of ``step``: ``batch_size`` rows."""
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        if self.token_file is not None:
            return _batch(self.token_file.rows(self.token_file.train_windows(step * batch_size, batch_size)))
        gen = _generator(self.seed, step)
        if self.corpus is None:
            rows = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=gen)
        else:
            starts = torch.randint(0, self.train_bytes - self.seq_len, (batch_size,), generator=gen)
            rows = torch.stack([self.corpus[s:s + self.seq_len + 1] for s in starts.tolist()])
        return _batch(rows)

    def eval_batch(self, index: int, batch_size: int) -> Batch:
        """Held-out batch number ``index`` (needs ``held_out=True``): the same for every job on the same data."""
        if not self.held_out:
            raise ConfigError("evaluation batches need a held-out split (TokenBatches(held_out=True))")
        if self.token_file is not None:
            return _batch(self.token_file.rows(self.token_file.eval_windows(index * batch_size, batch_size)))
        if self.corpus is None:
            gen = _generator(self.seed, f"eval:{index}")
            return _batch(torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=gen))
        n, span = self.corpus.numel(), self.seq_len + 1
        held = self.corpus[self.train_bytes:]
        count = (n - self.train_bytes - 1) // self.seq_len
        starts = [(i % count) * self.seq_len for i in range(index * batch_size, (index + 1) * batch_size)]
        return _batch(torch.stack([held[s:s + span] for s in starts]))

    def microbatches(self, step: int, batch_size: int, num_microbatches: int, *, dp_rank: int = 0,
                     dp_size: int = 1) -> list[Batch]:
        """Replica ``dp_rank``'s share of the global batch of ``step``, cut into ``num_microbatches``."""
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data-parallel rank {dp_rank} is outside 0..{dp_size - 1}")
        if num_microbatches < 1 or batch_size % (dp_size * num_microbatches):
            raise ConfigError(f"global batch {batch_size} is not divisible by data-parallel size {dp_size} x "
                              f"{num_microbatches} micro-batches; choose a multiple of {dp_size * num_microbatches}")
        full = self.batch(step, batch_size)
        per_replica = batch_size // dp_size
        per_mb = per_replica // num_microbatches
        lo = dp_rank * per_replica
        # clones: each micro-batch owns its storage (the stash counts and moves storages, not views)
        return [Batch(tokens=full.tokens[lo + i * per_mb: lo + (i + 1) * per_mb].clone(),
                      targets=full.targets[lo + i * per_mb: lo + (i + 1) * per_mb].clone())
                for i in range(num_microbatches)]
