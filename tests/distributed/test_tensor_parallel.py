"""Tensor parallelism and sharded data parallelism composed with the schedules (issue 13).

- tp 2 x pp 2 (4 processes) and tp 2 x pp 2 x dp 2 (8 processes) against the un-pipelined, un-sharded model:
  loss and every parameter's full gradient on every rank, for a tiny GPT and a tiny LLaMA (grouped-query
  attention), every schedule at tp 2 x pp 2.
- sharding (distributed optimizer, FSDP2) at pp 2 x dp 2 and tp 2 x pp 2 x dp 2: three AdamW steps give the
  losses and parameters of un-sharded AdamW on the un-pipelined model.

Two worlds, each started once per module and running all its cases; each test looks up its own failures.
"""

from __future__ import annotations

import pytest

from cases import Case
from harness import failures_only, missing_runs, run_world
from shard_cases import ShardCase, run_shard_cases
from tp_cases import TpCase, run_tp_cases

pytestmark = pytest.mark.distributed

MODELS = ("gpt-tiny", "llama-tiny")
FAMILIES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("looped-bfs", 2), ("bpipe", 1))

TP_PP_CASES = [TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v, model=m)) for f, v in FAMILIES
               for m in MODELS]
TP_PP_DP_CASES = [TpCase(case=Case(family=f, pp=2, microbatches=2, dp=2, chunks=v, model=m))
                  for f, v in (("1f1b", 1), ("interleaved", 2), ("bpipe", 1)) for m in MODELS]

_SHARD_4 = (("1f1b", 1, 2, "gpt-tiny", "optimizer"), ("1f1b", 1, 2, "gpt-tiny", "full"),
            ("interleaved", 2, 2, "llama-tiny", "full"), ("bpipe", 1, 3, "gpt-tiny", "full"),
            ("bpipe", 1, 3, "llama-tiny", "optimizer"), ("zb-h1", 1, 3, "gpt-tiny", "optimizer"))
_SHARD_8 = (("1f1b", 1, 2, "llama-tiny", "full"), ("interleaved", 2, 2, "gpt-tiny", "optimizer"),
            ("bpipe", 1, 2, "gpt-tiny", "full"))
SHARD_CASES_4 = [ShardCase(case=Case(family=f, pp=2, microbatches=m, dp=2, chunks=v, model=model), sharding=mode)
                 for f, v, m, model, mode in _SHARD_4]
SHARD_CASES_8 = [ShardCase(case=Case(family=f, pp=2, microbatches=m, dp=2, chunks=v, model=model), sharding=mode,
                           tp=2) for f, v, m, model, mode in _SHARD_8]

def _four(rank: int, world: int) -> list[str]:
    return run_tp_cases(TP_PP_CASES) + run_shard_cases(SHARD_CASES_4)


def _eight(rank: int, world: int) -> list[str]:
    return run_tp_cases(TP_PP_DP_CASES) + run_shard_cases(SHARD_CASES_8)


def _flatten(results: dict[int, list[str]]) -> list[str]:
    return [f for fs in results.values() for f in fs]


@pytest.fixture(scope="module")
def four_failures() -> list[str]:
    return _flatten(run_world(4, _four, timeout_s=420, pg_timeout_s=60))


@pytest.fixture(scope="module")
def eight_failures() -> list[str]:
    return _flatten(run_world(8, _eight, timeout_s=480, pg_timeout_s=90))


def _mine(failures: list[str], case: TpCase | ShardCase) -> list[str]:
    """The case's failures, or a failure when not every rank of its layout proved that it ran."""
    fatal = [f for f in failures if " raised " in f or "reported nothing" in f]
    return (fatal + [f for f in failures_only(failures) if f.startswith(f"{case} rank")]
            + missing_runs(failures, str(case), case.case.pp * case.case.dp * case.tp))


@pytest.mark.parametrize("case", TP_PP_CASES, ids=str)
def test_tp2_pp2_matches_unsharded_model(four_failures: list[str], case: TpCase) -> None:
    assert not _mine(four_failures, case), "\n".join(_mine(four_failures, case))


@pytest.mark.parametrize("case", TP_PP_DP_CASES, ids=str)
def test_tp2_pp2_dp2_matches_unsharded_model(eight_failures: list[str], case: TpCase) -> None:
    assert not _mine(eight_failures, case), "\n".join(_mine(eight_failures, case))


@pytest.mark.parametrize("case", SHARD_CASES_4 + SHARD_CASES_8, ids=str)
def test_sharding_matches_unsharded_adamw(four_failures: list[str], eight_failures: list[str],
                                          case: ShardCase) -> None:
    failures = eight_failures if case.tp > 1 else four_failures
    assert not _mine(failures, case), "\n".join(_mine(failures, case))
