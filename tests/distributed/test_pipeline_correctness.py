"""Every schedule against a single-process run of the same model on the same global batch (issues 3 and 4).

One gloo world of 4 processes runs every case (sub-groups for P and DP; ranks outside a case's layout sit it
out); the world starts once per module, and each case below looks up its own failures.
"""

from __future__ import annotations

import pytest

from cases import (Case, case_problems, check_problems, free_outputs_check, measured_trace_check, offload_check,
                   offload_schedule, run_cases)
from harness import run_world
from norm_cases import NORM_CASES, grad_norm_checks, norm_label

pytestmark = pytest.mark.distributed

MODELS = ("gpt-tiny", "llama-tiny")
LAYOUTS = ((2, 1), (2, 2), (4, 1))  # (P, DP) with P * DP <= 4


def _schedule_cases() -> list[Case]:
    out = []
    for family, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("looped-bfs", 2)):
        for pp, dp in LAYOUTS:
            # interleaved needs M % P == 0 (Megatron's rule), so it takes 2P where the others take 2P+1
            for m in (pp, 2 * pp if family == "interleaved" else 2 * pp + 1):
                for model in MODELS:
                    out.append(Case(family=family, pp=pp, microbatches=m, dp=dp, chunks=chunks, model=model))
    # recomputation on each family once, and outputs kept instead of freed
    for family, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("looped-bfs", 2)):
        out.append(Case(family=family, pp=2, microbatches=4, chunks=chunks, recompute=True))
        out.append(Case(family=family, pp=2, microbatches=4, chunks=chunks, free_outputs=False, model="llama-tiny"))
    # selective recomputation (the attention core) with the full and the split backward, and a mode per stage
    out += [Case(family="1f1b", pp=2, microbatches=4, recompute="selective"),
            Case(family="zb-h1", pp=2, microbatches=4, recompute="selective", model="llama-tiny"),
            Case(family="1f1b", pp=2, microbatches=4, recompute="full,selective", model="llama-tiny"),
            Case(family="zb-v", pp=4, microbatches=8, chunks=2, recompute="selective")]
    # the zero-bubble and V-shaped families (V placement: the last stage, and so the loss, on rank 0)
    for family in ("zb-h2", "zb-v", "v-half", "v-min", "dualpipev"):
        for pp, dp in LAYOUTS:
            out.append(Case(family=family, pp=pp, microbatches=2 * pp, dp=dp, chunks=1 if family == "zb-h2" else 2,
                            model="llama-tiny" if dp == 2 else "gpt-tiny"))
    # full and selective recomputation with every split-backward family at P=4 (issue 33.4; zb-v selective above)
    for family, chunks in (("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("v-half", 2), ("v-min", 2), ("dualpipev", 2)):
        for recompute in (True, "selective")[:1 if family == "zb-v" else 2]:
            out.append(Case(family=family, pp=4, microbatches=8 if family == "dualpipev" else 4, chunks=chunks,
                            recompute=recompute, model="llama-tiny" if recompute is True else "gpt-tiny"))
    # host offload (OFFLOAD/RELOAD) of every micro-batch on every rank, full and split backward
    for family, dp in (("1f1b", 2), ("zb-h1", 1)):
        out.append(Case(family=f"{family}+offload", pp=2, microbatches=4, dp=dp,
                        text=offload_schedule(family, 2, 4).to_text()))
    # train --offload (issue 31.4): build_schedule's offload_ranks with reloads prefetched, at P=4 on the full
    # backward, interleaved chunks, the split backward, BPipe's evictions, recomputation and the V placement's
    # local hand-off (a stage output offloaded before the next stage on its rank read it)
    out += [Case(family="1f1b", pp=4, microbatches=8, offload="all"),
            Case(family="interleaved", pp=4, microbatches=8, chunks=2, offload="0-1", model="llama-tiny"),
            Case(family="zb-h1", pp=4, microbatches=8, offload="all"),
            Case(family="bpipe", pp=4, microbatches=8, offload="all"),
            Case(family="1f1b", pp=2, microbatches=4, recompute=True, offload="0"),
            Case(family="zb-v", pp=2, microbatches=4, chunks=2, offload="all")]
    # latency-aware (issue 35.4), ordered for slow links and run with every link emulated slow (messages land
    # late, their senders go on), one stage per rank and the V; and its default order over free links
    out += [Case(family="latency-aware", pp=4, microbatches=8, link_delay_ms=3.0,
                 text=_latency_aware(4, 8, 1, latency=1.0)),
            Case(family="latency-aware", pp=2, microbatches=4, chunks=2, link_delay_ms=3.0, model="llama-tiny",
                 text=_latency_aware(2, 4, 2, latency=0.5)),
            Case(family="latency-aware", pp=4, microbatches=4, dp=1)]
    return out


def _latency_aware(pp: int, microbatches: int, chunks: int, *, latency: float) -> str:
    """The latency-aware order for every link taking ``latency`` forwards, as schedule text."""
    from evenpipe.schedule import LinkPlan, build_schedule
    return build_schedule("latency-aware", num_ranks=pp, num_microbatches=microbatches, num_chunks=chunks,
                          link_plan=LinkPlan.uniform(num_ranks=pp, latency=latency)).to_text()


def _bpipe_cases() -> list[Case]:
    out = []
    for pp, dp in ((2, 1), (2, 2), (3, 1), (4, 1)):
        for m in (pp, 2 * pp + 1):
            for model in MODELS:
                for recompute in (False, True):
                    out.append(Case(family="bpipe", pp=pp, microbatches=m, dp=dp, model=model, recompute=recompute))
    out.append(Case(family="bpipe", pp=4, microbatches=9, free_outputs=False))  # kept outputs travel too
    # BPipe as a transform of other schedules (pairs and budget from each schedule's own memory profile)
    for family, chunks in (("interleaved", 2), ("1f1b", 1), ("zb-h1", 1), ("gpipe", 1)):
        for pp, dp in ((2, 1), (2, 2), (4, 1)):
            out.append(Case(family=family, pp=pp, microbatches=2 * pp, dp=dp, chunks=chunks, bpipe=True,
                            model="llama-tiny" if dp == 2 else "gpt-tiny"))
    out.append(Case(family="interleaved", pp=4, microbatches=8, chunks=2, bpipe=True, recompute=True))
    out.append(Case(family="bpipe", pp=4, microbatches=9, recompute="selective,none,selective,full"))
    return out


def _trajectory_cases() -> list[Case]:
    """Five AdamW steps: the loss trajectory of every schedule (and one stage) equals the reference's."""
    fams = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("looped-bfs", 2), ("bpipe", 1))
    return [Case(family="1f1b", pp=1, microbatches=4, steps=5, adam=True)] + [
        Case(family=f, pp=4, microbatches=8, chunks=v, steps=5, adam=True) for f, v in fams]


def _document_cases() -> list[Case]:
    """Documents (issue 34): the boundaries ride in the activations through every kind of schedule, and
    micro-batches of mixed lengths (grouped pad, pack or balance; each as long as its longest row) equal the
    un-pipelined model on the same documents padded to full rows."""
    policies = ("pad", "pack", "balance")
    out = []
    for i, (family, chunks, pp, dp) in enumerate((f, v, pp, dp) for f, v in (
            ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("bpipe", 1)) for pp, dp in LAYOUTS):
        out.append(Case(family=family, pp=pp, microbatches=2 * pp, dp=dp, chunks=chunks, model=MODELS[i % 2],
                        varlen=policies[i % 3], steps=3 if family == "bpipe" else 2))
    out.append(Case(family="1f1b", pp=2, microbatches=4, recompute=True, model="llama-tiny", varlen="pad"))
    out.append(Case(family="zb-h1", pp=4, microbatches=4, recompute="selective", varlen="pack"))
    out.append(Case(family="interleaved", pp=2, microbatches=4, chunks=2, bpipe=True, varlen="balance", steps=3))
    out.append(Case(family="1f1b", pp=2, microbatches=5, dp=2, documents=True))  # one shape, one tensor
    return out


SCHEDULE_CASES = _schedule_cases() + _document_cases()
BPIPE_CASES = _bpipe_cases()
TRAJECTORY_CASES = _trajectory_cases()


def _world_fn(rank: int, world: int) -> list[str]:
    return (run_cases(SCHEDULE_CASES + BPIPE_CASES + TRAJECTORY_CASES) + free_outputs_check()
            + measured_trace_check() + grad_norm_checks() + offload_check())


@pytest.fixture(scope="module")
def world_failures() -> list[str]:
    results = run_world(4, _world_fn, timeout_s=900, pg_timeout_s=60)  # a hang shows as a 60 s peer timeout
    return [f for fs in results.values() for f in fs]


def _mine(failures: list[str], case: Case) -> list[str]:
    return case_problems(failures, case)


@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=str)
def test_schedule_matches_single_process(world_failures: list[str], case: Case) -> None:
    assert not _mine(world_failures, case), "\n".join(_mine(world_failures, case))


@pytest.mark.parametrize("case", BPIPE_CASES, ids=str)
def test_bpipe_matches_single_process_and_leaves_no_stash(world_failures: list[str], case: Case) -> None:
    assert not _mine(world_failures, case), "\n".join(_mine(world_failures, case))


@pytest.mark.parametrize("case", TRAJECTORY_CASES, ids=str)
def test_loss_trajectory_matches_single_process(world_failures: list[str], case: Case) -> None:
    assert not _mine(world_failures, case), "\n".join(_mine(world_failures, case))


def test_freeing_outputs_lowers_peak_and_keeps_gradients(world_failures: list[str]) -> None:
    mine = check_problems(world_failures, "free-outputs", 2)
    assert not mine, "\n".join(mine)


def test_offload_moves_activations_to_host_and_back(world_failures: list[str]) -> None:
    mine = check_problems(world_failures, "offload", 2)
    assert not mine, "\n".join(mine)


def test_measured_trace_shows_bpipe_transfers(world_failures: list[str]) -> None:
    mine = check_problems(world_failures, "measured trace", 4)
    assert not mine, "\n".join(mine)


@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_global_grad_norm_equals_unpipelined(world_failures: list[str], case: Case) -> None:
    fatal = [f for f in world_failures if " raised " in f or "reported nothing" in f]
    mine = fatal + [f for f in world_failures if f.startswith(f"{norm_label(case)} rank")]
    assert not mine, "\n".join(mine)
