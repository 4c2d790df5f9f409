"""Length files: the shipped distribution is exactly its documented recipe, and bad files are one-line errors."""

from __future__ import annotations

import pathlib
import statistics

import pytest

from evenpipe.errors import ConfigError
from evenpipe.plan.lengths import (
    MAX_LENGTH,
    SHAREGPT_MEAN_PROMPT,
    SHAREGPT_MEAN_RESPONSE,
    read_lengths,
    shipped_lengths,
    synthesize_sharegpt_lengths,
)


def test_the_shipped_file_is_the_recipe_and_keeps_the_published_mean() -> None:
    lengths = shipped_lengths()
    assert lengths == synthesize_sharegpt_lengths()
    assert max(lengths) <= MAX_LENGTH and min(lengths) >= 2
    # clipping at 2048 only lowers the mean a little below the published prompt + response mean
    assert 0.9 * (SHAREGPT_MEAN_PROMPT + SHAREGPT_MEAN_RESPONSE) < statistics.mean(lengths) \
        < SHAREGPT_MEAN_PROMPT + SHAREGPT_MEAN_RESPONSE


def test_read_lengths_skips_comments_and_blank_lines(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "l.txt"
    path.write_text("# mine\n12\n\n7  # short\n")
    assert read_lengths(path) == [12, 7]


@pytest.mark.parametrize("text,needle", [("12\nx\n", "l.txt:2: 'x' is not a document length"),
                                         ("0\n", "'0' is not a document length"), ("# none\n", "holds no lengths")])
def test_bad_length_files_are_one_line(tmp_path: pathlib.Path, text: str, needle: str) -> None:
    path = tmp_path / "l.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        read_lengths(path)
    with pytest.raises(ConfigError, match="cannot read lengths file"):
        read_lengths(tmp_path / "missing.txt")
