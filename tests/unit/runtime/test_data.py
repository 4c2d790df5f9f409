"""Training data: shipped corpus, deterministic batches, data-parallel slicing, errors."""

from __future__ import annotations

import pathlib

import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.runtime.data import TokenBatches, TokenSource, parse_token_source, read_corpus, shipped_corpus_path


def test_shipped_corpus_is_real_text() -> None:
    tokens = read_corpus()
    assert tokens.dtype == torch.int64 and 100_000 < tokens.numel() < 1_000_000
    assert int(tokens.max()) < 128  # ASCII
    text = bytes(tokens[:20_000].to(torch.uint8).tolist()).decode()
    assert "GNU GENERAL PUBLIC LICENSE" in text
    assert (shipped_corpus_path().parent / "README.md").exists()


def test_corpus_batches_are_windows_with_shifted_targets() -> None:
    data = TokenBatches(source="corpus", seq_len=32, seed=3)
    batch = data.batch(0, 4)
    assert batch.tokens.shape == batch.targets.shape == (4, 32)
    assert torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1])
    corpus = read_corpus()
    for row, tgt in zip(batch.tokens, batch.targets):
        window = torch.cat([row, tgt[-1:]])
        hits = (corpus.unfold(0, 33, 1) == window).all(dim=1)
        assert bool(hits.any())


@pytest.mark.parametrize("source", ["corpus", "random"])
def test_batches_are_a_function_of_seed_and_step(source: str) -> None:
    a = TokenBatches(source=source, seq_len=16, seed=1)
    b = TokenBatches(source=source, seq_len=16, seed=1)
    assert torch.equal(a.batch(5, 8).tokens, b.batch(5, 8).tokens)
    assert not torch.equal(a.batch(5, 8).tokens, a.batch(6, 8).tokens)
    assert not torch.equal(a.batch(5, 8).tokens, TokenBatches(source=source, seq_len=16, seed=2).batch(5, 8).tokens)


def test_random_tokens_respect_the_vocabulary() -> None:
    batch = TokenBatches(source=TokenSource.RANDOM, seq_len=64, vocab=10).batch(0, 16)
    assert int(batch.tokens.min()) >= 0 and int(batch.tokens.max()) == 9
    assert torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1])


def test_microbatches_partition_the_global_batch_across_replicas() -> None:
    data = TokenBatches(seq_len=8, seed=0)
    full = data.batch(2, 12)
    parts = [data.microbatches(2, 12, 3, dp_rank=r, dp_size=2) for r in range(2)]
    rows = torch.cat([mb.tokens for replica in parts for mb in replica])
    assert torch.equal(rows, full.tokens)
    assert all(mb.tokens.shape == (2, 8) for replica in parts for mb in replica)
    # each micro-batch owns its storage (the activation stash dedupes and moves whole storages)
    storages = {mb.tokens.untyped_storage()._cdata for replica in parts for mb in replica}
    assert len(storages) == 6


def test_user_corpus_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"abcdefghij")
    batch = TokenBatches(seq_len=4, path=path).batch(0, 3)
    assert int(batch.tokens.min()) >= ord("a") and int(batch.targets.max()) <= ord("j")


@pytest.mark.parametrize(("call", "match"), [
    (lambda: parse_token_source("wiki"), "unknown data source 'wiki'; choose one of: corpus, random"),
    (lambda: TokenBatches(seq_len=8, vocab=100), "vocabulary of at least 256"),
    (lambda: TokenBatches(seq_len=8, path="/nonexistent/x.txt"), "cannot read corpus"),
    (lambda: TokenBatches(source="random", seq_len=8, path="x.txt"), "data source is 'random'"),
    (lambda: TokenBatches(seq_len=8).microbatches(0, 10, 4), "global batch 10 is not divisible"),
    (lambda: TokenBatches(seq_len=8).microbatches(0, 8, 2, dp_rank=2, dp_size=2), "rank 2 is outside 0..1"),
])
def test_bad_data_settings(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        call()


def test_too_short_corpus(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "short.txt"
    path.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="corpus has 3 bytes, fewer than seq_len \\+ 1 = 9"):
        TokenBatches(seq_len=8, path=path)
