"""Hugging Face causal LMs pipelined against the un-pipelined Hugging Face model (issue 8).

Tiny Llama (grouped-query attention, untied head) and tiny GPT-2 (tied embeddings) from ``tests/fixtures/hf``:
loss and every parameter's gradient on every rank equal the model's own forward-with-labels loss and its
gradients, for 1F1B, interleaved, ZB-H1 and BPipe at P = 2 and 4, DP = 1 and 2, over two SGD steps; the
parameters after the steps match, and the tied embedding is identical on the first and the last stage. One gloo
world of 8 processes runs every case.
"""

from __future__ import annotations

import pytest

from cases import Case, run_cases
from harness import run_world

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

MODELS = ("hf:tiny-llama", "hf:tiny-gpt2")
LAYOUTS = ((2, 1), (2, 2), (4, 1), (4, 2))
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("bpipe", 1))
CASES = [Case(family=f, pp=pp, microbatches=2 * pp, dp=dp, chunks=v, model=m)
         for m in MODELS for f, v in SCHEDULES for pp, dp in LAYOUTS]


def _world_fn(rank: int, world: int) -> list[str]:
    return run_cases(CASES)


@pytest.fixture(scope="module")
def world_failures() -> list[str]:
    results = run_world(8, _world_fn, timeout_s=600, pg_timeout_s=120)
    return [f for fs in results.values() for f in fs]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hf_model_matches_unpipelined_hf(world_failures: list[str], case: Case) -> None:
    mine = [f for f in world_failures if " raised " in f or "reported nothing" in f or f.startswith(f"{case} rank")]
    assert not mine, "\n".join(mine)
