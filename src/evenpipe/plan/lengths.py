"""Document-length distributions for the micro-batch planner (pure Python): read one length per line, or use the
shipped distribution, a log-normal fit to published ShareGPT statistics (see ``evenpipe/data/README.md``).

:func:`synthesize_sharegpt_lengths` is the recipe that wrote the shipped file; it is here so the file can be
checked and regenerated (``python -m evenpipe.plan.lengths > sharegpt_lengths.txt``).
"""

from __future__ import annotations

import importlib.resources
import math
import pathlib
import random
import sys

from evenpipe.errors import ConfigError

__all__ = ["read_lengths", "read_microbatch_lengths", "shipped_lengths_path", "shipped_lengths", "synthesize_sharegpt_lengths",
           "SHAREGPT_MEAN_PROMPT", "SHAREGPT_MEAN_RESPONSE", "ASSUMED_SIGMA", "MAX_LENGTH"]

SHAREGPT_MEAN_PROMPT = 161.31
"""Mean prompt tokens of ShareGPT (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023, Fig. 11)."""
SHAREGPT_MEAN_RESPONSE = 337.99
"""Mean response tokens of ShareGPT (same source)."""
ASSUMED_SIGMA = 1.0
"""Log-space standard deviation of each part. NOT from the source (it publishes means and histograms only): an
assumption, stated as one, giving a long right tail."""
MAX_LENGTH = 2048
"""Longest document kept (lengths are clipped here), the context of the models in that study."""
NUM_SHIPPED = 4096
"""Lengths in the shipped file."""
SEED = 34
"""Seed of the shipped file (issue 34)."""


def _items(path: "str | pathlib.Path") -> list[tuple[int, str]]:
    """(line number, text) of every line of ``path`` that is not blank or a ``#`` comment; ConfigError if unreadable."""
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read lengths file {str(p)!r}: {exc.strerror}") from None
    lines = ((i, line.split("#", 1)[0].strip()) for i, line in enumerate(text.splitlines(), 1))
    return [(i, item) for i, item in lines if item]


def read_lengths(path: "str | pathlib.Path") -> list[int]:
    """One positive integer length per line (blank lines and ``#`` comments skipped); one-line ConfigError else."""
    out = []
    for i, item in _items(path):
        if not item.isdigit() or int(item) < 1:
            raise ConfigError(f"{path}:{i}: {item!r} is not a document length (one integer >= 1 per line)")
        out.append(int(item))
    if not out:
        raise ConfigError(f"lengths file {str(path)!r} holds no lengths (one integer >= 1 per line)")
    return out


def read_microbatch_lengths(path: "str | pathlib.Path") -> list[list[int]]:
    """One micro-batch per line: its documents' lengths, integers >= 1 separated by spaces or commas (blank lines
    and ``#`` comments skipped); one-line ConfigError else."""
    out = []
    for i, item in _items(path):
        words = item.replace(",", " ").split()
        if not all(w.isdigit() and int(w) >= 1 for w in words):
            raise ConfigError(f"{path}:{i}: {item!r} is not a micro-batch's document lengths (integers >= 1 "
                              "separated by spaces or commas, one micro-batch per line)")
        out.append([int(w) for w in words])
    if not out:
        raise ConfigError(f"lengths file {str(path)!r} holds no micro-batches (one line of document lengths each)")
    return out


def shipped_lengths_path() -> pathlib.Path:
    """The shipped ShareGPT-shaped lengths (see ``evenpipe/data/README.md``)."""
    return pathlib.Path(str(importlib.resources.files("evenpipe") / "data" / "sharegpt_lengths.txt"))


def shipped_lengths() -> list[int]:
    """The shipped distribution's lengths, in file order."""
    return read_lengths(shipped_lengths_path())


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)  # E = exp(mu + sigma^2/2) = mean


def synthesize_sharegpt_lengths(count: int = NUM_SHIPPED, *, seed: int = SEED) -> list[int]:
    """``count`` document lengths: prompt + response, each log-normal with the published mean and
    :data:`ASSUMED_SIGMA`, rounded, at least 1 token each, clipped to :data:`MAX_LENGTH`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = max(1, round(_lognormal(rng, SHAREGPT_MEAN_PROMPT, ASSUMED_SIGMA)))
        response = max(1, round(_lognormal(rng, SHAREGPT_MEAN_RESPONSE, ASSUMED_SIGMA)))
        out.append(min(MAX_LENGTH, prompt + response))
    return out


if __name__ == "__main__":  # regenerate the shipped file
    sys.stdout.write("# ShareGPT-shaped document lengths (tokens): see evenpipe/data/README.md\n")
    sys.stdout.write("".join(f"{n}\n" for n in synthesize_sharegpt_lengths()))
