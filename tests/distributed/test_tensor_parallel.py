"""Tensor parallelism and sharded data parallelism composed with the schedules (issue 13).

- tp 2 x pp 2 (4 processes) and tp 2 x pp 2 x dp 2 (8 processes) against the un-pipelined, un-sharded model:
  loss, every parameter's full gradient and the whole model's gradient norm on every rank, for a tiny GPT, a
  tiny LLaMA (grouped-query attention) and a tiny Hugging Face Llama: 1f1b, interleaved and bpipe on all three
  and both layouts; at tp 2 x pp 2 also every other schedule family (the newer V-shaped and memory-capped ones
  on the GPT) and BPipe as a transform of interleaved.
- sharding (distributed optimizer, FSDP2) at pp 2 x dp 2 and tp 2 x pp 2 x dp 2 (the Hugging Face Llama too):
  three AdamW steps give the losses, gradients and parameters of un-sharded AdamW on the un-pipelined model;
  FSDP2 also with every split-backward family at pp 4 x dp 2, zb-v at tp 2, and two with recomputation.

- BPipe at tp 2 x pp 4 (in the 8-process world, :mod:`tp_balance`): every tensor-parallel rank of an evictor
  evicts its own shard, measured per-rank peaks within 15% of their mean, and pipeline rank 0 at most
  ceil((p+1)/2)/p + 0.1 of its 1F1B peak on every tensor-parallel rank.
- sequence parallelism (issue 33): its cases among the worlds' cases (loss and every gradient equal to the
  un-sharded model, with FSDP and the distributed optimizer too), and at tp 2 x pp 4 every stage-boundary
  message half its tp 1 size and what BPipe evicts halved (measured, :func:`tp_balance.measure_sequence_bytes`).

Two worlds (4 and 8 processes), each started once per module and running all its cases; each test looks up its
own failures.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest

from cases import Case
from harness import failures_only, missing_runs, run_world
from shard_cases import ShardCase, run_shard_cases
from tp_balance import (MICROBATCH, P, SEQ, balance_reports, is_data, measure_balance, measure_sequence_bytes,
                        sequence_bytes)
from tp_cases import TpCase, run_tp_cases

pytestmark = pytest.mark.distributed

MODELS = ("gpt-tiny", "llama-tiny")
FAMILIES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("looped-bfs", 2), ("bpipe", 1))
NEWER_FAMILIES = (("zb-h2", 1), ("zb-v", 2), ("v-half", 2), ("v-min", 2), ("dualpipev", 2))
"""The V-shaped and memory-capped families, on the tiny GPT only (the blocks they run are the same)."""
HF_FAMILIES = (("1f1b", 1), ("interleaved", 2), ("bpipe", 1))
HF_LLAMA = "hf:tiny-llama"
HF_MODELS = (HF_LLAMA,) if importlib.util.find_spec("transformers") else ()
"""The Hugging Face Llama runs where the optional ``transformers`` is installed (``make setup`` installs it)."""

TP_PP_CASES = ([TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v, model=m)) for f, v in FAMILIES
                for m in MODELS]
               + [TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v)) for f, v in NEWER_FAMILIES]
               + [TpCase(case=Case(family="interleaved", pp=2, microbatches=4, chunks=2, bpipe=True))]
               + [TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v, model=m, varlen=p))
                  for f, v, m, p in (("1f1b", 1, "gpt-tiny", "pad"), ("zb-h1", 1, "llama-tiny", "balance"))]
               + [TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v, model=m))
                  for f, v in HF_FAMILIES for m in HF_MODELS]
               + [TpCase(case=Case(family=f, pp=2, microbatches=4, model=m, recompute="selective"))  # attention core
                  for f, m in (("zb-h1", "gpt-tiny"), *(("1f1b", m) for m in HF_MODELS))])
SP_CASES = [TpCase(case=Case(family=f, pp=2, microbatches=4, chunks=v, model=m, bpipe=b, varlen=d,
                             steps=3 if d else 2), sequence_parallel=True)
            for f, v, m, b, d in (("1f1b", 1, "gpt-tiny", False, None), ("bpipe", 1, "llama-tiny", False, None),
                                  ("zb-h1", 1, "gpt-tiny", False, None), ("interleaved", 2, "llama-tiny", True, None),
                                  ("1f1b", 1, "gpt-tiny", False, "pack"), ("bpipe", 1, "gpt-tiny", False, "pad"))]
SP_CASES += [TpCase(case=Case(family=f, pp=2, microbatches=4, model=m, recompute=r), sequence_parallel=True)
             for f, m, r in (("zb-h1", "gpt-tiny", "selective"), ("1f1b", "llama-tiny", "full"))]
"""Sequence parallelism (issue 33): GPT and LLaMA, a split backward, BPipe (plain and as a transform), documents
of mixed lengths (each micro-batch's length a multiple of tp), selective and full recomputation."""
TP_PP_CASES += SP_CASES
TP_PP_DP_CASES = [TpCase(case=Case(family=f, pp=2, microbatches=2, dp=2, chunks=v, model=m))
                  for f, v in HF_FAMILIES for m in (*MODELS, *HF_MODELS)]
TP_PP_DP_CASES += [TpCase(case=Case(family=f, pp=2, microbatches=2, dp=2, chunks=v, model=m), sequence_parallel=True)
                   for f, v, m in (("1f1b", 1, "gpt-tiny"), ("interleaved", 2, "llama-tiny"))]
TP_PP_DP_CASES.append(TpCase(case=Case(family="zb-h1", pp=2, microbatches=2, dp=2, varlen="balance"),
                             sequence_parallel=True))  # documents of mixed lengths, every replica its own

_SHARD_4 = (("1f1b", 1, 2, "gpt-tiny", "optimizer"), ("1f1b", 1, 2, "gpt-tiny", "full"),
            ("interleaved", 2, 2, "llama-tiny", "full"), ("bpipe", 1, 3, "gpt-tiny", "full"),
            ("bpipe", 1, 3, "llama-tiny", "optimizer"), ("zb-h1", 1, 3, "gpt-tiny", "optimizer"))
_SHARD_8 = (("1f1b", 1, 2, "llama-tiny", "full"), ("interleaved", 2, 2, "gpt-tiny", "optimizer"),
            ("bpipe", 1, 2, "gpt-tiny", "full"),
            *(c for m in HF_MODELS for c in (("1f1b", 1, 2, m, "full"), ("interleaved", 2, 2, m, "optimizer"))))
SHARD_CASES_4 = [ShardCase(case=Case(family=f, pp=2, microbatches=m, dp=2, chunks=v, model=model), sharding=mode)
                 for f, v, m, model, mode in _SHARD_4]
SHARD_CASES_4 += [ShardCase(case=Case(family=f, pp=2, microbatches=4, dp=2, varlen=p), sharding=mode)
                  for f, p, mode in (("zb-h1", "pad", "full"), ("1f1b", "balance", "optimizer"))]
"""Documents of mixed lengths under FSDP2 and the distributed optimizer (a new length mid-run runs a shape
handshake through the sharded stages)."""
SHARD_CASES_8 = [ShardCase(case=Case(family=f, pp=2, microbatches=m, dp=2, chunks=v, model=model), sharding=mode,
                           tp=2) for f, v, m, model, mode in _SHARD_8]
SHARD_CASES_8 += [ShardCase(case=Case(family="1f1b", pp=2, microbatches=2, dp=2, model="gpt-tiny"), sharding=mode,
                            tp=2, sequence_parallel=True) for mode in ("full", "optimizer")]
ZB_FAMILIES = (("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("v-half", 2), ("v-min", 2), ("dualpipev", 2))
"""Every split-backward family: weight passes run after FSDP's backward hooks (issue 33.4)."""
ZB_FSDP_CASES = ([ShardCase(case=Case(family=f, pp=4, microbatches=8 if f == "dualpipev" else 4, dp=2, chunks=v),
                            sharding="full") for f, v in ZB_FAMILIES]
                 + [ShardCase(case=Case(family="zb-v", pp=2, microbatches=4, dp=2, chunks=2), sharding="full", tp=2)])
"""At P=4 x DP=2 (and zb-v with tensor parallelism): the V-shaped ones put both ends of the tied GPT embedding on
rank 0."""
ZB_FSDP_RECOMPUTE_CASES = [ShardCase(case=Case(family=f, pp=2, microbatches=4, dp=2, chunks=v, recompute=r),
                                     sharding="full")
                           for f, v, r in (("zb-h1", 1, True), ("dualpipev", 2, True), ("zb-v", 2, "selective"),
                                           ("v-half", 2, "selective"))]
ZB_FSDP_RECOMPUTE_CASES.append(ShardCase(case=Case(family="zb-h1", pp=2, microbatches=4, dp=2, bpipe=True),
                                         sharding="full"))
"""FSDP2 with full and selective recomputation (each family with recomputation alone at P=4:
test_pipeline_correctness), and with BPipe's evictions."""


def _four(rank: int, world: int) -> list[str]:
    return run_tp_cases(TP_PP_CASES) + run_shard_cases(SHARD_CASES_4 + ZB_FSDP_RECOMPUTE_CASES)


def _eight(rank: int, world: int) -> list[str]:
    return (run_tp_cases(TP_PP_DP_CASES) + run_shard_cases(SHARD_CASES_8 + ZB_FSDP_CASES)
            + measure_balance(rank, world) + measure_sequence_bytes(rank, world))


def _flatten(results: dict[int, list[str]]) -> list[str]:
    return [f for fs in results.values() for f in fs]


@pytest.fixture(scope="module")
def four_failures() -> list[str]:
    return _flatten(run_world(4, _four, timeout_s=420, pg_timeout_s=60))


@pytest.fixture(scope="module")
def eight_failures() -> list[str]:
    return _flatten(run_world(8, _eight, timeout_s=600, pg_timeout_s=90))


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


@pytest.mark.parametrize("case", SHARD_CASES_4 + ZB_FSDP_RECOMPUTE_CASES + SHARD_CASES_8 + ZB_FSDP_CASES,
                         ids=str)
def test_sharding_matches_unsharded_adamw(four_failures: list[str], eight_failures: list[str],
                                          case: ShardCase) -> None:
    failures = eight_failures if case.tp * case.case.pp * case.case.dp > 4 else four_failures
    assert not _mine(failures, case), "\n".join(_mine(failures, case))


# --- BPipe at tp 2 x pp 4 (measured in the 8-process world; see tp_balance.py) ---------------------------------
BALANCE_TOLERANCE = 0.15
RANK0_SLACK = 0.10


@pytest.fixture(scope="module")
def reports(eight_failures: list[str]) -> list[dict[str, Any]]:
    data = balance_reports(eight_failures)
    if not data:
        fatal = [f for f in eight_failures if not is_data(f) and (" raised " in f or "reported nothing" in f)]
        pytest.fail("the tp2 x pp4 BPipe measurement failed:\n" + "\n".join(fatal or ["no report"]))
    return data


def _table(reports: list[dict[str, Any]]) -> str:
    return "\n".join(f"  pp {r['pp']} tp {r['tp']}: 1f1b peak {r['1f1b']['peak']:8d}  bpipe peak "
                     f"{r['bpipe']['peak']:8d} (hosted {r['bpipe']['hosted']}, evicted {r['bpipe']['evicted']})"
                     for r in reports)


def test_every_tp_rank_evicts_its_own_shard(reports: list[dict[str, Any]]) -> None:
    left = [(r["pp"], r["tp"]) for r in reports if not (r["1f1b"]["empty"] and r["bpipe"]["empty"])]
    assert not left, f"stash not empty after a step on (pp, tp) {left}\n{_table(reports)}"
    idle = [(r["pp"], r["tp"]) for r in reports if r["pp"] < P // 2 and r["bpipe"]["evicted"] <= 0]
    assert not idle, f"evictors that moved nothing: {idle}\n{_table(reports)}"


def test_bpipe_balances_ranks_with_tp(reports: list[dict[str, Any]]) -> None:
    print("\n" + _table(reports))  # shown with pytest -s
    peaks = [r["bpipe"]["peak"] for r in reports]
    mean = sum(peaks) / len(peaks)
    bad = [f"pp {r['pp']} tp {r['tp']}: {p} B is {p / mean - 1:+.1%} from the mean {mean:.0f} B"
           for r, p in zip(reports, peaks) if abs(p - mean) > BALANCE_TOLERANCE * mean]
    assert not bad, "BPipe peaks more than 15% from the mean:\n" + "\n".join(bad) + "\n" + _table(reports)
    plain = [r["1f1b"]["peak"] for r in reports]  # control: the same measure shows 1F1B's imbalance
    assert max(plain) > (1 + BALANCE_TOLERANCE) * sum(plain) / len(plain), f"1F1B looks balanced\n{_table(reports)}"


def test_rank0_peak_shrinks_on_every_tp_rank(reports: list[dict[str, Any]]) -> None:
    bound = math.ceil((P + 1) / 2) / P + RANK0_SLACK
    bad = [f"tp {r['tp']}: rank 0 BPipe peak {r['bpipe']['peak']} B > {bound:.3f} x 1F1B peak {r['1f1b']['peak']} B"
           for r in reports if r["pp"] == 0 and r["bpipe"]["peak"] > bound * r["1f1b"]["peak"]]
    assert not bad, "\n".join(bad) + "\n" + _table(reports)


# --- sequence parallelism's bytes at tp 2 x pp 4 (measured in the 8-process world; see tp_balance.py) ----------
@pytest.fixture(scope="module")
def sp_bytes(eight_failures: list[str]) -> dict[tuple[str, int, int], dict[str, Any]]:
    data = sequence_bytes(eight_failures)
    if not data:
        fatal = [f for f in eight_failures if not is_data(f) and (" raised " in f or "reported nothing" in f)]
        pytest.fail("the sequence-parallel bytes measurement failed:\n" + "\n".join(fatal or ["no report"]))
    return data


@pytest.mark.parametrize("kind", ["send_f", "send_b"])
def test_sequence_parallel_halves_boundary_messages(sp_bytes: dict, kind: str) -> None:
    """Every activation (gradient) message across a stage boundary is half its tp 1 and plain tp 2 size."""
    for pp in range(P):
        whole = sp_bytes[("tp1", pp, 0)][kind]
        for tp in range(2):
            assert sp_bytes[("tp2", pp, tp)][kind] == whole, (pp, tp)
            assert [2 * b for b in sp_bytes[("tp2-sp", pp, tp)][kind]] == whole, (pp, tp, whole)


def test_sequence_parallel_halves_bpipe_bytes(sp_bytes: dict) -> None:
    """What BPipe evicts halves exactly on a rank of blocks only (pipeline rank 1); on rank 0 all but the
    embedding's inputs (token ids [b, T] and positions [T], int64, whole on every tensor-parallel rank) halve."""
    for tp in range(2):
        assert 2 * sp_bytes[("tp2-sp", 1, tp)]["evicted"] == sp_bytes[("tp1", 1, 0)]["evicted"] > 0
        units = len(sp_bytes[("tp1", 0, 0)]["evict"])
        replicated = units * (MICROBATCH * SEQ + SEQ) * 8
        assert 2 * sp_bytes[("tp2-sp", 0, tp)]["evicted"] - sp_bytes[("tp1", 0, 0)]["evicted"] == replicated
        assert sp_bytes[("tp2", 1, tp)]["evicted"] > sp_bytes[("tp2-sp", 1, tp)]["evicted"]  # control: plain tp
