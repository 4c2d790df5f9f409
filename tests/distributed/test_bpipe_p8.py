"""The 8-process world: BPipe at P=8, M=8, and P=4 with DP=2 for the zero-bubble and V-shaped families and for
BPipe as a transform of 1f1b, interleaved, gpipe and zb-h1 (gloo processes, a tiny model): loss and every
gradient equal the single-process run's on every rank, and no stash is left on any rank after a step."""

from __future__ import annotations

import pytest

from cases import Case, case_problems, run_cases
from harness import run_world

pytestmark = pytest.mark.distributed

CASES = [Case(family="bpipe", pp=8, microbatches=8), Case(family="bpipe", pp=8, microbatches=8, recompute=True)]
P4_DP2 = [Case(family=f, pp=4, microbatches=8, dp=2, chunks=v, bpipe=bp, model=model, steps=1)
          for f, v, bp, model in (("zb-h2", 1, False, "gpt-tiny"), ("zb-v", 2, False, "llama-tiny"),
                                  ("v-half", 2, False, "gpt-tiny"), ("v-min", 2, False, "llama-tiny"),
                                  ("dualpipev", 2, False, "gpt-tiny"), ("1f1b", 1, True, "llama-tiny"),
                                  ("interleaved", 2, True, "gpt-tiny"), ("gpipe", 1, True, "llama-tiny"),
                                  ("zb-h1", 1, True, "gpt-tiny"))]


def _rank_fn(rank: int, world: int) -> list[str]:
    return run_cases(CASES + P4_DP2)


@pytest.fixture(scope="module")
def lines() -> list[str]:
    results = run_world(8, _rank_fn, timeout_s=420, pg_timeout_s=60)
    return [f for fs in results.values() for f in fs]


def test_bpipe_p8_matches_single_process(lines: list[str]) -> None:
    failures = [f for case in CASES for f in case_problems(lines, case)]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", P4_DP2, ids=str)
def test_p4_dp2_matches_single_process(lines: list[str], case: Case) -> None:
    failures = case_problems(lines, case)
    assert not failures, "\n".join(failures)
