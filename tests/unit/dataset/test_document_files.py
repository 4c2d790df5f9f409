"""Documents in: token files with offsets, JSONL and Parquet of tokens or text (a local tokenizer.json), short
documents skipped and counted, long ones refused or split, and one-line errors for every bad input."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from evenpipe.dataset import load_documents, write_offsets
from evenpipe.errors import ConfigError

DOCS = [[5, 6, 7], [8], [], [9, 10, 11, 12, 13], [14, 15]]
"""Document 1 (one token) and 2 (empty) give nothing to predict: skipped."""
KEPT = [[5, 6, 7], [9, 10, 11, 12, 13], [14, 15]]


def _bin(tmp: pathlib.Path, offsets_as: str = "idx", dtype: str = "uint16") -> pathlib.Path:
    path = tmp / "train.bin"
    np.asarray([t for d in DOCS for t in d], dtype=dtype).tofile(path)
    offsets = np.cumsum([0] + [len(d) for d in DOCS])
    if offsets_as == "idx":
        write_offsets(tmp / "train.idx", offsets)
    else:
        np.save(tmp / "train.offsets.npy", offsets)
    return path


def _as_lists(docs) -> list[list[int]]:
    return [docs.document(i).tolist() for i in range(len(docs))]


@pytest.mark.parametrize("offsets_as", ["idx", "npy"])
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_with_offsets(tmp_path: pathlib.Path, offsets_as: str, dtype: str) -> None:
    docs = load_documents(_bin(tmp_path, offsets_as, dtype), token_dtype=dtype)
    assert _as_lists(docs) == KEPT and docs.num_skipped == 2
    assert docs.lengths.tolist() == [3, 5, 2]


def test_jsonl_of_tokens(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"tokens": d}) + "\n" for d in DOCS) + "\n")
    docs = load_documents(path)
    assert _as_lists(docs) == KEPT and docs.num_skipped == 2


def _tokenizer(tmp: pathlib.Path) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


def test_jsonl_of_text_through_a_local_tokenizer(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("tokenizers")
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "the cat sat"}) + "\n" + json.dumps({"text": "on the mat dog"}) + "\n"
                    + json.dumps({"text": "cat"}) + "\n")
    docs = load_documents(path, tokenizer=_tokenizer(tmp_path))
    assert _as_lists(docs) == [[1, 2, 3], [4, 1, 5, 0]] and docs.num_skipped == 1
    assert _as_lists(load_documents(path, tokenizer=tmp_path)) == _as_lists(docs)  # the directory holding it


def test_parquet_of_tokens_or_a_one_line_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="Parquet documents need pyarrow"):
            load_documents(path)
        return
    pq.write_table(pa.table({"tokens": DOCS}), path)
    assert _as_lists(load_documents(path)) == KEPT


def test_long_documents_are_refused_or_split(tmp_path: pathlib.Path) -> None:
    docs = load_documents(_bin(tmp_path))
    with pytest.raises(ConfigError, match="document 1 of .* has 5 tokens, more than the budget of 4 .* "
                                          "--split-long-documents"):
        docs.fit_to(4, split=False)
    assert docs.fit_to(5, split=False) is docs
    split = docs.fit_to(4, split=True)
    # 5 tokens at budget 4 would leave a 1-token tail: the cut moves one earlier, so every piece has a target
    assert _as_lists(split) == [[5, 6, 7], [9, 10, 11], [12, 13], [14, 15]] and split.num_split == 1


def test_split_pieces_cover_every_token_of_long_documents() -> None:
    from evenpipe.dataset.documents import DocumentSet
    tokens = np.arange(23)
    docs = DocumentSet(tokens=tokens, offsets=np.asarray([0, 10, 23]), source="mem")
    split = docs.fit_to(4, split=True)
    assert np.concatenate(_as_lists(split)).tolist() == list(range(23))
    assert split.lengths.tolist() == [4, 4, 2, 4, 4, 3, 2] and split.num_skipped == 0


@pytest.mark.parametrize("offsets,needle", [
    ([0, 3, 4, 4, 9], "the last offset is 9 but the token file holds 11 tokens"),
    ([1, 3, 4, 4, 9, 11], "the first offset is 1, not 0"),
    ([0, 3, 2, 4, 9, 11], r"offset 2 \(2\) is below offset 1 \(3\)"),
    ([0], "1 value"),
])
def test_offsets_that_do_not_match_the_token_file(tmp_path: pathlib.Path, offsets: list[int], needle: str) -> None:
    path = _bin(tmp_path)
    write_offsets(tmp_path / "train.idx", offsets)
    with pytest.raises(ConfigError, match="do not match the token file: " + needle):
        load_documents(path)


@pytest.mark.parametrize("setup,kwargs,needle", [
    (lambda t: t / "none.jsonl", {}, "does not exist"),
    (lambda t: (t / "d.txt").write_text("x") and t / "d.txt", {}, "unknown format '.txt'"),
    (lambda t: (t / "d.jsonl").write_text('{"text": "a b"}\n') and t / "d.jsonl", {},
     "need a tokenizer: --tokenizer"),
    (lambda t: (t / "d.jsonl").write_text('{"text": "a b"}\n') and t / "d.jsonl", {"tokenizer": "/nope/tok.json"},
     "tokenizer file '/nope/tok.json' does not exist"),
    (lambda t: (t / "d.jsonl").write_text('{"ids": [1]}\n') and t / "d.jsonl", {}, "d.jsonl:1: a line must be"),
    (lambda t: (t / "d.jsonl").write_text('{"tokens": [1, -2]}\n') and t / "d.jsonl", {}, "integers >= 0"),
    (lambda t: (t / "d.jsonl").write_text('{"tokens": [1\n') and t / "d.jsonl", {}, "d.jsonl:1: not JSON"),
    (lambda t: (t / "x.bin").write_bytes(b"\0\0") and t / "x.bin", {}, "has no offsets beside it"),
    (lambda t: (t / "x.bin").write_bytes(b"\0\0\0") and t / "x.bin", {}, "not a multiple of 2"),
    (lambda t: (t / "x.bin").write_bytes(b"\0\0") and t / "x.bin", {"token_dtype": "int8"}, "unknown token dtype"),
])
def test_bad_input_is_one_line(tmp_path: pathlib.Path, setup, kwargs: dict, needle: str) -> None:
    path = setup(tmp_path)
    with pytest.raises(ConfigError, match=needle) as err:
        load_documents(path, **kwargs)
    assert "\n" not in str(err.value)


def test_vocabulary_check_names_the_token(tmp_path: pathlib.Path) -> None:
    docs = load_documents(_bin(tmp_path))
    docs.check_vocab(16)
    with pytest.raises(ConfigError, match="token id 15 .* outside the model's vocabulary of 15"):
        docs.check_vocab(15)
