"""Documents as they come (no torch): token files with document offsets, JSONL and Parquet of token lists or
text, text through a local Hugging Face ``tokenizer.json``. See :mod:`evenpipe.dataset.documents`."""

from evenpipe.dataset.documents import DocumentSet, load_documents, read_offsets, write_offsets

__all__ = ["DocumentSet", "load_documents", "read_offsets", "write_offsets"]
