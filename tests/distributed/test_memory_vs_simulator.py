"""Measured per-rank activation peaks match the simulator's within 5% (issue 9): the zero-bubble and V-shaped
families, and BPipe as a transform of 1f1b, interleaved, gpipe and zb-h1.

One gloo world of P=4 processes, M=8 micro-batches, a tiny GPT with one block per stage. Every rank runs each
case for two steps (the first learns shapes and BPipe sizes) with the measured trace on, and reports from the
second step: its executor's peak (own plus hosted activation bytes), and, per stage, what the runtime measured
about one micro-batch: the bytes a backward frees (``B``, or ``I`` plus ``W``: the stage's activation unit), the
bytes ``W`` frees (what ``I`` keeps for it), and the bytes its ``SEND_F`` ships (its output).

The simulator then runs the same schedule with those per-stage bytes (unit durations, free links), and the
runtime's one extra stage output held at the end of a forward (:func:`evenpipe.cost.profile_fit.held_output_bytes`).
Its per-rank peak must be within 5% of the measured one on every rank. The per-stage bytes are inputs; what is
checked is the schedule-level memory model: when each unit is alive, what ``I`` keeps until ``W``, evictions
and hosting.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest
import torch
from harness import ran, run_world

pytestmark = pytest.mark.distributed

P, M, SEQ, MICROBATCH = 4, 8, 16, 2
TOLERANCE = 0.05
PEER_TIMEOUT_S = 30.0
_DATA = "DATA:"

CASES: tuple[tuple[str, int, bool], ...] = (
    ("zb-h2", 1, False), ("zb-v", 2, False), ("v-half", 2, False), ("v-min", 2, False), ("dualpipev", 2, False),
    ("1f1b", 1, True), ("interleaved", 2, True), ("gpipe", 1, True), ("zb-h1", 1, True))
"""``(family, chunks, --bpipe)``."""


def _label(case: tuple[str, int, bool]) -> str:
    family, chunks, bpipe = case
    return f"{family}{' V=2' if chunks > 1 else ''}{' --bpipe' if bpipe else ''}"


def _schedule(case: tuple[str, int, bool]) -> Any:
    from evenpipe.schedule import build_schedule
    family, chunks, bpipe = case
    return build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=chunks, bpipe=bpipe)


def _per_stage(records: Any) -> dict[str, dict[int, int]]:
    """Median over micro-batches of what each stage's backward frees, what its W frees, and its output's bytes."""
    from evenpipe.schedule.ir import ActionKind as K
    freed: dict[tuple[K, int], list[int]] = {}
    before = 0
    for (_, action, _, _), (_, after) in zip(records.actions, records.memory):
        if action.kind in (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
            freed.setdefault((action.kind, action.stage), []).append(before - after)
        before = after
    mid = {key: int(statistics.median(v)) for key, v in freed.items()}
    stages = {s for _, s in mid}
    unit = {s: mid.get((K.BACKWARD, s), mid.get((K.BACKWARD_INPUT, s), 0) + mid.get((K.BACKWARD_WEIGHT, s), 0))
            for s in stages}
    kept = {s: mid.get((K.BACKWARD_WEIGHT, s), 0) for s in stages}
    out = {rec.action.stage: rec.num_bytes for rec in records.sends if rec.action.kind is K.SEND_F}
    return {"unit": unit, "kept": kept, "output": out}


def _measure(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash

    groups = build_groups(P, 1, timeout_s=PEER_TIMEOUT_S)
    assert groups is not None
    mine: dict[str, Any] = {}
    for case in CASES:
        schedule = _schedule(case)
        cfg = model_config("gpt-tiny", num_layers=schedule.num_stages, hidden=32, num_heads=2, seq_len=SEQ)
        data = torch.randint(0, cfg.vocab, (MICROBATCH * M, SEQ + 1), generator=torch.Generator().manual_seed(11))
        stages = build_stage_modules(build_model(cfg, seed=3).pipeline_parts(), num_stages=schedule.num_stages,
                                     stages=schedule.stages_of(rank))
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss,
                              stash=ActivationStash(), trace=True)
        ex.step(data[:, :-1], data[:, 1:])
        result = ex.step(data[:, :-1], data[:, 1:])
        mine[_label(case)] = {"peak": result.peak_activation_bytes, "evicted": result.evicted_bytes,
                              **_per_stage(result.records)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return [_DATA + json.dumps(everyone), ran("memory")] if rank == 0 else [ran("memory")]


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    """Per rank: ``{case label: measurements}``."""
    results = run_world(P, _measure, timeout_s=300.0, pg_timeout_s=PEER_TIMEOUT_S)
    lines = [f for r in sorted(results) for f in results[r]]
    data = [json.loads(f[len(_DATA):]) for f in lines if f.startswith(_DATA)]
    problems = [f for f in lines if not f.startswith(_DATA) and f != ran("memory")]
    if problems or not data or lines.count(ran("memory")) != P:
        pytest.fail("the measured runs failed:\n" + "\n".join(problems or ["not every rank reported"]))
    return data[0]


def _simulated_peaks(case: tuple[str, int, bool], measured: list[dict[str, Any]]) -> tuple[float, ...]:
    from evenpipe.cost.profile_fit import held_output_bytes
    from evenpipe.sim import SimCosts, StageCosts, simulate
    schedule = _schedule(case)
    per_stage = {key: {int(s): b for rep in measured for s, b in rep[key].items()}
                 for key in ("unit", "kept", "output")}
    assert sorted(per_stage["unit"]) == list(range(schedule.num_stages)), f"stages measured: {per_stage}"
    costs = SimCosts.from_stages([
        StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, activation_bytes=float(per_stage["unit"][s]),
                   weight_grad_bytes=float(per_stage["kept"][s]), output_bytes=float(per_stage["output"].get(s, 0)))
        for s in range(schedule.num_stages)])
    trace = simulate(schedule, costs)
    return tuple(p + o for p, o in zip(trace.peak_activation_bytes, held_output_bytes(schedule, costs)))


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_measured_peak_matches_simulator(reports: list[dict[str, Any]], case: tuple[str, int, bool]) -> None:
    measured = [rep[_label(case)] for rep in reports]
    predicted = _simulated_peaks(case, measured)
    rows = [f"  rank {r}: measured {m['peak']:8d} B, simulated {p:10.0f} B ({p / m['peak'] - 1:+.2%})"
            for r, (m, p) in enumerate(zip(measured, predicted))]
    bad = [row for row, m, p in zip(rows, measured, predicted) if abs(p - m["peak"]) > TOLERANCE * m["peak"]]
    assert not bad, f"{_label(case)}: simulated peak off by more than 5%:\n" + "\n".join(rows)
    if case[2] and case[0] in ("1f1b", "interleaved"):  # their profiles are uneven: BPipe must move something
        assert sum(m["evicted"] for m in measured) > 0, f"{_label(case)}: nothing evicted\n" + "\n".join(rows)
