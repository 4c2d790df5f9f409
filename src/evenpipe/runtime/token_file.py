"""Pre-tokenised training data: a flat array of uint16 or uint32 token ids (nanoGPT's ``train.bin``, the tokens of
a Megatron ``.bin`` without its index), read by memory map, so only the windows a batch uses are paged in.

The file is cut into ``W = (N - 1) // seq_len`` windows of ``seq_len + 1`` tokens at stride ``seq_len`` (each
window's last token is the next one's first, so every token but the first is a target exactly once per epoch).
With a held-out split the last ``ceil(W / 20)`` windows are kept for evaluation. Training windows are visited
in a random permutation per epoch, a pure function of ``(seed, epoch)``: sample ``i`` of the job is window
``perm(seed, i // W_train)[i % W_train]``, so the order is deterministic and a job resumed at any sample index
continues it exactly.
"""

from __future__ import annotations

import enum
import hashlib
import math
import pathlib

import numpy as np
import torch

from evenpipe.errors import ConfigError, parse_choice

__all__ = ["TokenDtype", "parse_token_dtype", "TokenFile", "HELD_OUT_FRACTION"]

HELD_OUT_FRACTION = 0.05
"""Share of the windows (or corpus bytes) held out for evaluation when a split is asked for."""


class TokenDtype(enum.Enum):
    """Element type of a token file."""

    UINT16 = "uint16"
    """Vocabularies up to 65 536 (GPT-2's 50 257)."""
    UINT32 = "uint32"
    """Larger vocabularies (LLaMA 3's 128 256)."""


def parse_token_dtype(value: "str | TokenDtype") -> TokenDtype:
    """``"uint16"`` / ``"uint32"`` -> :class:`TokenDtype`; else ConfigError."""
    return parse_choice(TokenDtype, value, "token dtype")


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class TokenFile:
    """Windows of a memory-mapped token file (see the module docstring)."""

    def __init__(self, path: "str | pathlib.Path", *, dtype: "TokenDtype | str", seq_len: int, vocab: int,
                 seed: int, held_out: bool) -> None:
        self.path = str(path)
        self.dtype = parse_token_dtype(dtype)
        itemsize = np.dtype(self.dtype.value).itemsize
        p = pathlib.Path(path)
        try:
            size = p.stat().st_size
        except OSError as exc:
            raise ConfigError(f"cannot read token file {self.path!r}: {exc.strerror}") from None
        if size % itemsize:
            raise ConfigError(f"token file {self.path!r} has {size} bytes, not a multiple of {itemsize} "
                              f"({self.dtype.value}); is --token-dtype right?")
        num_tokens = size // itemsize
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.num_windows = (num_tokens - 1) // seq_len if num_tokens else 0
        self.num_eval = math.ceil(self.num_windows * HELD_OUT_FRACTION) if held_out else 0
        self.num_train = self.num_windows - self.num_eval
        if self.num_train < 1 or (held_out and self.num_windows < 2):
            raise ConfigError(f"token file {self.path!r} holds {num_tokens} tokens, too few for windows of "
                              f"{seq_len + 1}{' and a held-out split' if held_out else ''}")
        self.tokens = np.memmap(p, dtype=self.dtype.value, mode="r", shape=(num_tokens,))
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.num_train, generator=_generator("tokens", self.seed, epoch)))
        return self._perm[1]

    def train_windows(self, first_sample: int, count: int) -> list[int]:
        """Window indices of training samples ``first_sample .. first_sample + count - 1``."""
        out = []
        for i in range(first_sample, first_sample + count):
            out.append(int(self._permutation(i // self.num_train)[i % self.num_train]))
        return out

    def eval_windows(self, first_sample: int, count: int) -> list[int]:
        """Window indices of held-out samples, in file order, wrapping around."""
        if not self.num_eval:
            raise ConfigError("this token file was opened without a held-out split")
        return [self.num_train + i % self.num_eval for i in range(first_sample, first_sample + count)]

    def rows(self, windows: list[int]) -> torch.Tensor:
        """``[len(windows), seq_len + 1]`` int64 token ids (ConfigError if one is outside the vocabulary)."""
        n = self.seq_len
        rows = torch.from_numpy(np.stack([np.asarray(self.tokens[w * n: w * n + n + 1], dtype=np.int64)
                                          for w in windows]))
        top = int(rows.max())
        if top >= self.vocab:
            raise ConfigError(f"token id {top} in {self.path!r} is outside the model's vocabulary of {self.vocab}")
        return rows
