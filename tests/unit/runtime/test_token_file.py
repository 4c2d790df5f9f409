"""Pre-tokenised token files: memory-mapped windows, a deterministic per-epoch order that a resumed job continues,
a held-out split never trained on, and one-line errors for a wrong dtype, a short file or a foreign vocabulary."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.runtime.data import TokenBatches
from evenpipe.runtime.token_file import TokenFile

SEQ = 8


def _file(tmp: pathlib.Path, n: int, dtype: str = "uint16") -> pathlib.Path:
    path = tmp / f"tokens.{dtype}.bin"
    np.arange(n, dtype=dtype).tofile(path)  # token id = position, so a window is recognisable
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_contiguous_with_shifted_targets(tmp_path: pathlib.Path, dtype: str) -> None:
    data = TokenBatches(source="tokens", seq_len=SEQ, vocab=1000, seed=0, path=_file(tmp_path, 801, dtype),
                        token_dtype=dtype)
    b = data.batch(0, 4)
    assert b.tokens.dtype == torch.int64 and b.tokens.shape == (4, SEQ)
    assert torch.equal(b.tokens[:, 1:], b.targets[:, :-1])
    assert all(int(row[0]) % SEQ == 0 and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + SEQ))
               for row in b.tokens)


def test_an_epoch_visits_every_training_window_once_and_never_the_held_out(tmp_path: pathlib.Path) -> None:
    f = TokenFile(_file(tmp_path, 801), dtype="uint16", seq_len=SEQ, vocab=1000, seed=3, held_out=True)
    assert f.num_windows == 100 and f.num_eval == 5 and f.num_train == 95
    epoch = f.train_windows(0, 95)
    assert sorted(epoch) == list(range(95))
    assert f.train_windows(95, 95) != epoch and sorted(f.train_windows(95, 95)) == list(range(95))
    assert f.eval_windows(0, 7) == [95, 96, 97, 98, 99, 95, 96]


def test_the_order_is_a_function_of_seed_and_position(tmp_path: pathlib.Path) -> None:
    path = _file(tmp_path, 801)
    a = TokenBatches(source="tokens", seq_len=SEQ, vocab=1000, seed=1, path=path)
    b = TokenBatches(source="tokens", seq_len=SEQ, vocab=1000, seed=1, path=path)
    assert torch.equal(a.batch(30, 4).tokens, b.batch(30, 4).tokens)  # a fresh reader resumes at step 30
    assert not torch.equal(a.batch(30, 4).tokens,
                           TokenBatches(source="tokens", seq_len=SEQ, vocab=1000, seed=2, path=path).batch(30, 4).tokens)


@pytest.mark.parametrize("n,kw,needle", [
    (801, {"token_dtype": "int8"}, "unknown token dtype 'int8'"),
    (5, {}, "too few for windows of 9"),
    (801, {"vocab": 256}, "outside the model's vocabulary of 256"),
])
def test_bad_token_files_are_one_line_errors(tmp_path: pathlib.Path, n: int, kw: dict, needle: str) -> None:
    args = {"source": "tokens", "seq_len": SEQ, "vocab": 1000, "path": _file(tmp_path, n), **kw}
    with pytest.raises(ConfigError, match=needle):
        TokenBatches(**args).batch(0, 90)


def test_odd_byte_count_names_the_dtype(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\0" * 801)
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        TokenBatches(source="tokens", seq_len=SEQ, path=path)
