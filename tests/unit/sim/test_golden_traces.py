"""Golden traces: the simulator's answers on a broad matrix, compared with traces stored from an earlier version.

Every schedule family (BPipe, zero-bubble, interleaved, V-shaped included) at several sizes, with recomputation,
the BPipe transform, host offload and compute-only schedules (implicit messages), validated and unvalidated
copies (which take different evaluators), under free links, latency and bandwidth, per-pair links, late-receive
costs and CPU-charging links; plus replays of measured durations. Each case stores its schedule, its costs, the
evaluator that answered and the trace (per-action times, transfers, memory), floats exactly (JSON keeps a float's
repr). The test simulates each stored schedule again and requires the identical trace from :func:`simulate`, from
the reference event engine, and from every evaluator that answers.

Regenerate (only when a change of the simulator's meaning is intended, and say so in the commit):
``PYTHONPATH=src python tests/unit/sim/test_golden_traces.py --regenerate``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import sys
from typing import Any, Callable, Iterator

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import ScheduleFamily, build_schedule
from evenpipe.schedule.build import add_offload, compute_order
from evenpipe.schedule.comm import derive_communication
from evenpipe.schedule.ir import Schedule
from evenpipe.schedule.validate import passed_validation, validate
from evenpipe.sim import Link, SimCosts, StageCosts, simulate
from evenpipe.sim.dispatch import EVALUATORS
from evenpipe.sim.engine import simulate_events
from evenpipe.sim.kernel import attempt
from evenpipe.sim.replay import replay
from evenpipe.sim.trace import Trace

GOLDEN = pathlib.Path(__file__).parent / "golden"
SIZES = {(2, 4): ("free", "latency"), (3, 5): ("pairs", "late"),
         (4, 6): ("latency", "pairs", "late", "cpu")}
"""(ranks, micro-batches) -> link settings ("late" and "cpu" are the event engine's alone); interleaved rounds the
micro-batches to a multiple of the ranks."""


# -- the matrix ----------------------------------------------------------------------------------------------------
def _costs(rng: random.Random, num_stages: int, num_ranks: int, link: str) -> SimCosts:
    """Stage costs with distinct non-integer times and bytes (three decimals: not exact in binary, so sums depend
    on their order), under one link setting."""
    def u(lo: float, hi: float) -> float:
        return round(rng.uniform(lo, hi), 3)

    stages = []
    for _ in range(num_stages):
        act = u(1.0, 4.0)
        stages.append(StageCosts(forward=u(0.5, 2.0), backward_input=u(0.5, 3.0),
                                 backward_weight=rng.choice([0.0, u(0.2, 1.5)]), recompute=u(0.3, 1.5),
                                 activation_bytes=act, checkpoint_bytes=u(0.0, act), weight_grad_bytes=u(0.0, act),
                                 output_bytes=u(0.5, 3.0)))
    default = {"free": Link(), "latency": Link(latency_s=0.05, bandwidth_bytes_per_s=4.0),
               "pairs": Link(latency_s=0.01), "late": Link(latency_s=0.02, late_receive_s=0.3),
               "cpu": Link(latency_s=0.02, bandwidth_bytes_per_s=8.0, cpu_s_per_byte=0.05)}[link]
    links: dict[tuple[int, int], Link] = {}
    if link == "pairs":  # some directed pairs (and host links) slow, the rest fast
        for a in range(num_ranks):
            links[(a, (a + 1) % num_ranks)] = Link(latency_s=0.1, bandwidth_bytes_per_s=u(1.0, 6.0))
            links[(a, a)] = Link(latency_s=0.03, bandwidth_bytes_per_s=u(2.0, 8.0))
    return SimCosts.from_stages(stages, default_link=default, links=links)


def _schedules(fam: ScheduleFamily, p: int, m: int) -> Iterator[tuple[str, Schedule]]:
    """The variants of one family and size: plain, recomputed, BPipe-transformed, host offload, compute only."""
    v = None
    if fam is ScheduleFamily.INTERLEAVED:
        m = max(p, m - m % p)
    variants: list[tuple[str, Callable[[], Schedule]]] = [
        ("plain", lambda: build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v)),
        ("recompute", lambda: build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v, recompute=True)),
        ("compute-only", lambda: build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v).compute_only()),
    ]
    if fam is not ScheduleFamily.BPIPE and any(t.value == "bpipe" for t in fam.traits.transforms):
        variants.append(("bpipe", lambda: build_schedule(fam, num_ranks=p, num_microbatches=m, num_chunks=v,
                                                         bpipe=True)))
    if not fam.has_chunks:
        variants.append(("offload", lambda: derive_communication(add_offload(
            compute_order(fam, num_ranks=p, num_microbatches=m), ranks={0}))))
    for name, make in variants:
        try:
            yield f"{fam.value}-P{p}-M{m}-{name}", make()
        except ConfigError:
            continue


def _cases() -> Iterator[tuple[str, Schedule, SimCosts]]:
    for fam in ScheduleFamily:
        for (p, m), links in SIZES.items():
            for name, sched in _schedules(fam, p, m):
                for link in links:
                    rng = random.Random(f"{name}-{link}")
                    costs = _costs(rng, sched.num_stages, sched.num_ranks, link)
                    yield f"{name}-{link}", sched, costs
                    if link in ("free", "latency", "pairs") and p != 4 and passed_validation(sched):
                        # an unvalidated copy: the one-pass paths that trust the validator do not take it
                        yield f"{name}-{link}-unvalidated", Schedule.from_json(sched.to_json()), costs


# -- stored form -----------------------------------------------------------------------------------------------------
def _trace_doc(trace: Trace) -> dict[str, Any]:
    """What a case compares: every action's start and end, every transfer, memory, step time, unit bytes."""
    doc = json.loads(trace.to_json())
    return {"step_time": doc["step_time"], "unit_bytes": doc["unit_bytes"], "source": doc["source"],
            "times": [[x for rec in acts for x in rec[2:]] for acts in doc["actions"]],
            "transfers": doc["transfers"], "memory": doc["memory"]}


def _costs_doc(costs: SimCosts) -> dict[str, Any]:
    return {"stages": [dataclasses.asdict(st) for st in costs.stages],
            "default_link": dataclasses.asdict(costs.default_link),
            "links": [[a, b, dataclasses.asdict(lk)] for (a, b), lk in sorted(costs.links.items())]}


def _costs_from(doc: dict[str, Any]) -> SimCosts:
    return SimCosts.from_stages([StageCosts(**st) for st in doc["stages"]], default_link=Link(**doc["default_link"]),
                                links={(a, b): Link(**lk) for a, b, lk in doc["links"]})


def _schedule_from(doc: dict[str, Any]) -> Schedule:
    sched = Schedule.from_json(json.dumps(doc["schedule"]))
    if doc["validated"]:
        validate(sched)
    return sched


def _generate() -> dict[str, list[dict[str, Any]]]:
    files: dict[str, list[dict[str, Any]]] = {}
    for name, sched, costs in _cases():
        trace = simulate(sched, costs)
        case = {"name": name, "validated": passed_validation(sched), "schedule": json.loads(sched.to_json()),
                "costs": _costs_doc(costs), "evaluator": trace.evaluator, "trace": _trace_doc(trace)}
        if name.endswith("-plain-latency") or name.endswith("-bpipe-pairs"):
            slower = dataclasses.replace(costs, stages=tuple(dataclasses.replace(st, forward=st.forward * 1.3)
                                                             for st in costs.stages))
            case["replay"] = _trace_doc(replay(simulate(sched, slower), costs))
            case["replay_costs"] = _costs_doc(slower)
        files.setdefault(name.split("-P")[0], []).append(case)
    return files


def _load() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(GOLDEN.glob("*.json")):
        out.extend(json.loads(path.read_text()))
    return out


CASES = _load()


# -- the tests -------------------------------------------------------------------------------------------------------
def test_matrix_covers_every_family_and_path() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)) and len(names) > 250
    for fam in ScheduleFamily:
        assert any(n.startswith(f"{fam.value}-P") for n in names), fam
    assert {c["evaluator"] for c in CASES} == {e.name for e in EVALUATORS}
    assert sum("replay" in c for c in CASES) > 20
    for variant in ("recompute", "bpipe", "offload", "compute-only", "unvalidated", "late", "cpu", "pairs"):
        assert any(f"-{variant}" in n for n in names), variant


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_trace_is_unchanged(case: dict[str, Any]) -> None:
    sched, costs = _schedule_from(case), _costs_from(case["costs"])
    expected = case["trace"]
    trace = simulate(sched, costs)
    assert _trace_doc(trace) == expected
    assert trace.evaluator == case["evaluator"]
    reference = simulate_events(sched, costs)
    assert _trace_doc(reference) == expected and reference.evaluator == "events"
    answered = []
    for evaluator in EVALUATORS:  # every evaluator that applies and answers answers the same
        if evaluator.applies(sched, costs):
            other = attempt(lambda: evaluator.run(sched, costs))
            if other is not None:
                assert _trace_doc(other) == expected and other.evaluator == evaluator.name
                answered.append(evaluator.name)
    assert answered[0] == case["evaluator"]
    if "replay" in case:
        measured = simulate(sched, _costs_from(case["replay_costs"]))
        assert _trace_doc(replay(measured, costs)) == case["replay"]


def main() -> None:
    if "--regenerate" not in sys.argv:
        sys.exit("usage: test_golden_traces.py --regenerate  (rewrites tests/unit/sim/golden/*.json)")
    GOLDEN.mkdir(exist_ok=True)
    for old in GOLDEN.glob("*.json"):
        old.unlink()
    for family, cases in _generate().items():
        (GOLDEN / f"{family}.json").write_text(json.dumps(cases, separators=(",", ":")) + "\n")
        print(f"{family}: {len(cases)} cases")


if __name__ == "__main__":
    main()
