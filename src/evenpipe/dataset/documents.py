"""A set of documents with their boundaries: one flat token array and ``offsets`` (document ``i`` is
``tokens[offsets[i]:offsets[i + 1]]``). numpy, no torch.

Formats read by :func:`load_documents` (chosen by the file name):

- ``NAME.bin``: flat token ids (``uint16`` or ``uint32``, nanoGPT's ``train.bin``) with its offsets beside it,
  either ``NAME.idx`` -- the little-endian ``int64`` array ``offsets`` (``N + 1`` values, the first 0, never
  decreasing, the last the file's token count; :func:`write_offsets` writes one) -- or ``NAME.offsets.npy`` (the
  same array saved by ``numpy.save``).
- ``*.jsonl``: one JSON object a line, ``{"tokens": [ids...]}`` or ``{"text": "..."}``.
- ``*.parquet``: a ``tokens`` (list of integers) or ``text`` column (needs ``pyarrow``).

Text is tokenised by a Hugging Face tokenizer read from a local ``tokenizer.json`` (the ``tokenizers`` library;
never a hub download). Documents with fewer than 2 tokens (nothing to predict) are skipped and counted.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from evenpipe.errors import ConfigError

__all__ = ["DocumentSet", "load_documents", "read_offsets", "write_offsets", "load_tokenizer", "MIN_TOKENS"]

MIN_TOKENS = 2
"""A document needs two tokens to give one next-token target."""
_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentSet:
    """Documents of token ids: ``tokens`` flat, ``offsets`` ``[N + 1]`` int64 boundaries."""

    tokens: np.ndarray
    """Every document's tokens, one after another (any unsigned or signed integer dtype; may be a memory map)."""
    offsets: np.ndarray
    """``[N + 1]`` int64: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""
    source: str
    """Where the documents came from."""
    num_skipped: int = 0
    """Documents dropped for having fewer than :data:`MIN_TOKENS` tokens."""
    num_split: int = 0
    """Documents cut into pieces by :meth:`split_long` (0 if none was)."""

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` int64 token counts."""
        return np.diff(self.offsets)

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s token ids as int64."""
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], dtype=np.int64)

    def check_vocab(self, vocab: int) -> None:
        """ConfigError naming the first token id outside ``[0, vocab)``."""
        if len(self.tokens) and (int(self.tokens.max()) >= vocab or int(self.tokens.min()) < 0):
            bad = int(self.tokens.max()) if int(self.tokens.max()) >= vocab else int(self.tokens.min())
            raise ConfigError(f"token id {bad} in {self.source!r} is outside the model's vocabulary of {vocab}")

    def fit_to(self, max_tokens: int, *, split: bool) -> "DocumentSet":
        """Documents of at most ``max_tokens`` tokens: longer ones cut into pieces (``split``), or ConfigError
        naming the first too long."""
        lengths = self.lengths
        if max_tokens < MIN_TOKENS:
            raise ConfigError(f"the per-document token budget must be >= {MIN_TOKENS}, got {max_tokens}")
        long = np.flatnonzero(lengths > max_tokens)
        if not len(long):
            return self
        if not split:
            i = int(long[0])
            raise ConfigError(f"document {i} of {self.source!r} has {int(lengths[i])} tokens, more than the budget "
                              f"of {max_tokens} ({len(long)} such document(s)); use --split-long-documents or a "
                              "longer --seq-len")
        return self._split(max_tokens, num_long=len(long))

    def _split(self, max_tokens: int, *, num_long: int) -> "DocumentSet":
        """Cut every document longer than ``max_tokens`` at multiples of ``max_tokens`` from its start (a
        one-token tail moves the last cut one token earlier, so every piece has a target)."""
        cuts = [self.offsets]
        for start, end in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()):
            if end - start > max_tokens:
                inner = list(range(start + max_tokens, end, max_tokens))
                if end - inner[-1] < MIN_TOKENS:
                    inner[-1] -= 1
                cuts.append(np.asarray(inner, dtype=np.int64))
        offsets = np.unique(np.concatenate(cuts))
        return _drop_short(self.tokens, offsets, self.source, self.num_skipped, num_split=num_long)


def _drop_short(tokens: np.ndarray, offsets: np.ndarray, source: str, skipped: int, *,
                num_split: int = 0) -> DocumentSet:
    """Keep documents of at least :data:`MIN_TOKENS` tokens (the others counted in ``num_skipped``)."""
    lengths = np.diff(offsets)
    keep = lengths >= MIN_TOKENS
    if keep.all():
        return DocumentSet(tokens=tokens, offsets=offsets, source=source, num_skipped=skipped, num_split=num_split)
    starts, ends = offsets[:-1][keep], offsets[1:][keep]
    flat = np.concatenate([np.asarray(tokens[s:e]) for s, e in zip(starts.tolist(), ends.tolist())]) \
        if keep.any() else np.zeros(0, dtype=tokens.dtype)
    new = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=new[1:])
    return DocumentSet(tokens=flat, offsets=new, source=source, num_skipped=skipped + int((~keep).sum()),
                       num_split=num_split)


def _from_lists(docs: Iterable[list[int]], source: str) -> DocumentSet:
    """A :class:`DocumentSet` from token lists (short ones skipped and counted)."""
    lists = list(docs)
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in lists], out=offsets[1:])
    tokens = np.fromiter((t for d in lists for t in d), dtype=np.int64, count=int(offsets[-1]))
    return _drop_short(tokens, offsets, source, 0)


# --- offsets files ----------------------------------------------------------------------------------------------

def write_offsets(path: "str | pathlib.Path", offsets: "np.ndarray | list[int]") -> None:
    """Write ``offsets`` as an ``.idx`` file: little-endian int64, ``N + 1`` values."""
    np.asarray(offsets, dtype="<i8").tofile(str(path))


def read_offsets(path: "str | pathlib.Path", num_tokens: int) -> np.ndarray:
    """An ``.idx`` (raw little-endian int64) or ``.npy`` offsets file, checked against ``num_tokens``."""
    p = pathlib.Path(path)
    try:
        offsets = np.load(p) if p.suffix == ".npy" else np.fromfile(p, dtype="<i8")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read offsets file {str(p)!r}: {exc}") from None
    offsets = np.asarray(offsets).astype(np.int64, copy=False).reshape(-1)
    if p.suffix != ".npy" and p.stat().st_size % 8:
        raise ConfigError(f"offsets file {str(p)!r} has {p.stat().st_size} bytes, not a multiple of 8 (int64)")
    problem = _offsets_problem(offsets, num_tokens)
    if problem:
        raise ConfigError(f"offsets {str(p)!r} do not match the token file: {problem}")
    return offsets


def _offsets_problem(offsets: np.ndarray, num_tokens: int) -> str | None:
    if offsets.shape[0] < 2:
        return f"{offsets.shape[0]} value(s); need the first offset 0, one per document boundary and {num_tokens}"
    if offsets[0] != 0:
        return f"the first offset is {int(offsets[0])}, not 0"
    if offsets[-1] != num_tokens:
        return f"the last offset is {int(offsets[-1])} but the token file holds {num_tokens} tokens"
    down = np.flatnonzero(np.diff(offsets) < 0)
    if len(down):
        i = int(down[0])
        return f"offset {i + 1} ({int(offsets[i + 1])}) is below offset {i} ({int(offsets[i])})"
    return None


def _from_bin(path: pathlib.Path, token_dtype: str) -> DocumentSet:
    if token_dtype not in _DTYPES:
        raise ConfigError(f"unknown token dtype {token_dtype!r}; choose one of: {', '.join(_DTYPES)}")
    itemsize = np.dtype(token_dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ConfigError(f"token file {str(path)!r} has {size} bytes, not a multiple of {itemsize} ({token_dtype}); "
                          "is --token-dtype right?")
    stem = path.with_suffix("")
    index = next((c for c in (stem.with_suffix(".idx"), pathlib.Path(f"{stem}.offsets.npy")) if c.exists()), None)
    if index is None:
        raise ConfigError(f"token file {str(path)!r} has no offsets beside it: write {stem}.idx (int64, see "
                          "evenpipe.dataset.write_offsets) or {stem}.offsets.npy")
    tokens = np.memmap(path, dtype=token_dtype, mode="r") if size else np.zeros(0, dtype=token_dtype)
    return _drop_short(tokens, read_offsets(index, size // itemsize), str(path), 0)


# --- JSONL, Parquet, text ---------------------------------------------------------------------------------------

def load_tokenizer(path: "str | pathlib.Path | None") -> Any:
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json``; one-line ConfigError if missing or bad."""
    if path is None:
        raise ConfigError("documents given as text need a tokenizer: --tokenizer PATH/tokenizer.json")
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"tokenizer file {str(p)!r} does not exist (a Hugging Face tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("text documents need the 'tokenizers' package (installed with transformers)") from None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the library raises its own exception types
        raise ConfigError(f"cannot read tokenizer {str(p)!r}: {str(exc).splitlines()[0]}") from None


def _token_lists(records: Iterable[tuple[str, Any]], tokenizer_path: "str | pathlib.Path | None",
                 source: str) -> Iterator[list[int]]:
    """Token lists from ``(field, value)`` records, ``field`` 'tokens' or 'text'."""
    tokenizer = None
    for i, (field, value) in enumerate(records):
        if field == "tokens":
            if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and t >= 0 for t in value):
                raise ConfigError(f"{source}: document {i}'s 'tokens' must be a list of integers >= 0")
            yield list(value)
        else:
            if not isinstance(value, str):
                raise ConfigError(f"{source}: document {i}'s 'text' must be a string")
            tokenizer = tokenizer or load_tokenizer(tokenizer_path)
            yield list(tokenizer.encode(value).ids)


def _jsonl_records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not JSON ({exc.msg})") from None
            field = next((k for k in ("tokens", "text") if isinstance(obj, dict) and k in obj), None)
            if field is None:
                raise ConfigError(f"{path}:{n}: a line must be an object with 'tokens' (ids) or 'text'")
            yield field, obj[field]


def _parquet_records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet documents need pyarrow: pip install pyarrow (or convert to JSONL)") from None
    table = pq.read_table(path)
    field = next((k for k in ("tokens", "text") if k in table.column_names), None)
    if field is None:
        raise ConfigError(f"{path}: needs a 'tokens' or 'text' column; it has {', '.join(table.column_names)}")
    for value in table.column(field).to_pylist():
        yield field, value


def load_documents(path: "str | pathlib.Path", *, token_dtype: str = "uint16",
                   tokenizer: "str | pathlib.Path | None" = None) -> DocumentSet:
    """Documents from ``path`` (``.bin`` with offsets, ``.jsonl`` or ``.parquet``; see the module docstring)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"documents file {str(p)!r} does not exist")
    if p.suffix == ".bin":
        return _from_bin(p, token_dtype)
    if p.suffix in (".jsonl", ".parquet"):
        records = _jsonl_records(p) if p.suffix == ".jsonl" else _parquet_records(p)
        return _from_lists(_token_lists(records, tokenizer, str(p)), str(p))
    raise ConfigError(f"documents file {str(p)!r}: unknown format {p.suffix!r}; use .bin (with .idx or "
                      ".offsets.npy offsets), .jsonl or .parquet")
