"""BPipe at P=8, M=8 (8 gloo processes, a tiny GPT): loss and every gradient equal the single-process run's,
and no stash is left on any rank after a step."""

from __future__ import annotations

import pytest

from cases import Case, case_problems, run_cases
from harness import run_world

pytestmark = pytest.mark.distributed

CASES = [Case(family="bpipe", pp=8, microbatches=8), Case(family="bpipe", pp=8, microbatches=8, recompute=True)]


def _rank_fn(rank: int, world: int) -> list[str]:
    return run_cases(CASES)


def test_bpipe_p8_matches_single_process() -> None:
    results = run_world(8, _rank_fn, timeout_s=240, pg_timeout_s=60)
    lines = [f for fs in results.values() for f in fs]
    failures = [f for case in CASES for f in case_problems(lines, case)]
    assert not failures, "\n".join(failures)
