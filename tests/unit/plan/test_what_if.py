"""What-ifs on a cluster (plan/what_if.py): parsing, and answers whose numbers are the one estimate of the
printed plans on the changed cluster."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest

from evenpipe.cli import main
from evenpipe.cost import model_preset
from evenpipe.cost.cluster import Cluster, parse_cluster
from evenpipe.cost.estimate import estimate_with
from evenpipe.errors import ConfigError
from evenpipe.plan.hetero import PlacedCandidate, placed_source, search_cluster
from evenpipe.plan.replicas import peers_of
from evenpipe.plan.what_if import answer_what_if, parse_what_if

DOC = {"links": {"intra_node": {"latency_s": 5e-6, "bandwidth_gb_per_s": 300},
                 "inter_node": {"latency_s": 1e-5, "bandwidth_gb_per_s": 25}},
       "nodes": [{"device": "a100-80gb", "ranks": [0, 1, 2, 3]}, {"device": "h100-80gb", "ranks": [4, 5, 6, 7]}]}
MODEL = "gpt3-1.3b"


@pytest.mark.parametrize("text, rank, factor, link, delay", [
    ("rank 5 x1.5", 5, 1.5, None, 0.0), ("  RANK 0 x 2 ", 0, 2.0, None, 0.0),
    ("link 3-4 +5ms", None, 1.0, (3, 4), 5e-3), ("link 4 - 3 +250us", None, 1.0, (3, 4), 250e-6),
    ("link 0-7 +0.01s", None, 1.0, (0, 7), 0.01)])
def test_parse(text: str, rank: int | None, factor: float, link: tuple[int, int] | None, delay: float) -> None:
    w = parse_what_if(text, 8)
    assert (w.rank, w.factor, w.link) == (rank, factor, link) and w.delay_s == pytest.approx(delay)


@pytest.mark.parametrize("text, says", [
    ("rank 8 x1.5", "allowed: 0..7"), ("rank 1 x0", "> 0"), ("rank 1 x1e999", "finite"), ("link 2-2 +1ms", "twice"),
    ("link 1-2 +-1ms", ">= 0"), ("link 1-2 +5 minutes", "not a what-if"), ("slow rank 3", "not a what-if"),
    ("rank 1 x1..5", "not a number")])
def test_bad_what_ifs_are_one_line(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        parse_what_if(text, 8)
    assert "\n" not in str(e.value) and repr(text) in str(e.value)


def _check_consistent(model_name: str, cluster: Cluster, answer_dict: dict, before: PlacedCandidate,
                      changed: Cluster) -> None:
    """Every step the answer gives is the one estimate of its plan on its cluster."""
    model = model_preset(model_name)

    def step(plan: dict, on: Cluster) -> float:
        cfg = dataclasses.replace(before.config, tp=plan["tp"], pp=plan["pp"], dp=plan["dp"],
                                  chunks=plan["chunks"], microbatch_size=plan["microbatch_size"],
                                  layout=tuple(plan["layout"]), distributed_optimizer=plan["distributed_optimizer"],
                                  schedule=type(before.config.schedule)(plan["schedule"]),
                                  recompute=type(before.config.recompute)(plan["recompute"]),
                                  sequence_parallel=plan["sequence_parallel"], bpipe=False,
                                  offload_ranks=plan["offload_ranks"])
        return estimate_with(placed_source(model, on, plan["groups"], tp=plan["tp"]), cfg).step_time_s

    assert step(answer_dict["before"], cluster) == pytest.approx(answer_dict["before"]["step_time_s"], rel=1e-12)
    assert step(answer_dict["after"], changed) == pytest.approx(answer_dict["after"]["step_time_s"], rel=1e-12)
    for r in answer_dict["responses"]:
        if r["plan"] is None:
            continue
        on = changed.without(int(r["name"].split()[2])) if r["name"].startswith("leave") else changed
        assert step(r["plan"], on) == pytest.approx(r["step_time_s"], rel=1e-12), r["name"]


def test_a_slower_rank_costs_time_and_re_partitioning_wins_most_of_it_back() -> None:
    cluster = parse_cluster(DOC)
    model = model_preset(MODEL)
    best = search_cluster(model, cluster, global_batch=32, top_k=1).best
    slow = next(g for group in best.groups for g in group if cluster.ranks[g].device == "h100-80gb")
    answer = answer_what_if(model, cluster, best, parse_what_if(f"rank {slow} x1.5", 8), global_batch=32)
    assert answer.after.step_time_s > answer.before.step_time_s  # the slowdown costs time
    names = [r.name for r in answer.responses]
    assert names == ["re-partition", "another schedule", *(["re-split the batch"] if best.config.dp > 1 else []),
                     f"leave rank {slow} out"]
    repart = answer.responses[0]
    assert repart.plan is not None and repart.step_time_s < answer.after.step_time_s
    assert answer.best.step_time_s == min(r.step_time_s for r in answer.responses)
    assert 0 < answer.recovered(repart) <= 1
    changed = cluster.slowed(slow, 1.5)
    _check_consistent(MODEL, cluster, answer.to_dict(), best, changed)
    for r in answer.responses:
        for share in r.split.replicas if r.split is not None else ():
            cfg = dataclasses.replace(r.split.config, layout=share.estimate.layout,
                                      global_batch=share.num_microbatches * best.config.dp * best.config.microbatch_size)
            peers = peers_of([x.groups for x in r.split.replicas])
            again = estimate_with(placed_source(model, changed, share.groups, tp=best.config.tp, peers=peers), cfg)
            assert again.step_time_s == pytest.approx(share.estimate.step_time_s, rel=1e-12)


def test_a_slower_replica_takes_fewer_micro_batches_on_alike_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --gpu --what-if``: the plan on alike devices is the plain plan's, and with data parallelism the
    slowed rank's replica takes a smaller share of the batch."""
    where = ["plan", "--model", MODEL, "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "64", "--top", "1",
             "--json", "--schedules", "1f1b,zb-h1", "--max-microbatch-size", "2"]
    assert main(where) == 0
    plain = json.loads(capsys.readouterr().out)["candidates"][0]
    assert main([*where, "--what-if", "rank 1 x2"]) == 0
    answer = json.loads(capsys.readouterr().out)["what_if"][0]
    assert answer["before"]["step_time_s"] == pytest.approx(plain["step_time_s"], rel=1e-9)
    assert answer["after"]["step_time_s"] > answer["before"]["step_time_s"]
    split = next((r for r in answer["responses"] if r["name"] == "re-split the batch"), None)
    assert plain["dp"] > 1  # data parallelism wins on alike devices for this small model
    assert split is not None and split["split"] is not None
    replicas = split["split"]["replicas"]
    slowed = next(r for r in replicas if any(1 in g for g in r["groups"]))
    assert slowed["num_microbatches"] < max(r["num_microbatches"] for r in replicas)
    assert split["step_time_s"] < answer["after"]["step_time_s"]


def test_a_slower_link_between_pipeline_neighbours_costs_time_and_one_that_no_message_crosses_nothing() -> None:
    cluster = parse_cluster(DOC)
    model = model_preset(MODEL)
    best = search_cluster(model, cluster, global_batch=32, top_k=1).best
    assert best.config.pp > 1
    a, b = best.groups[0][0], best.groups[1][0]  # pipeline ranks 0 and 1 talk over this link
    answer = answer_what_if(model, cluster, best, parse_what_if(f"link {a}-{b} +5ms", 8), global_batch=32)
    assert answer.after.step_time_s > answer.before.step_time_s + 5e-3
    _check_consistent(MODEL, cluster, answer.to_dict(), best, cluster.delayed(a, b, 5e-3))
    inside = best.groups[0][:2]  # two devices of one pipeline rank: no pipeline message between them
    if len(inside) == 2:
        quiet = answer_what_if(model, cluster, best, parse_what_if(f"link {inside[0]}-{inside[1]} +5ms", 8),
                               global_batch=32)
        assert quiet.after.step_time_s == quiet.before.step_time_s and math.isnan(quiet.recovered(quiet.best))


def test_plan_cli_prints_the_what_if_and_its_json_matches_the_one_estimate(tmp_path: pathlib.Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(DOC))
    cluster = parse_cluster(DOC)
    args = ["plan", "--model", MODEL, "--cluster", str(path), "--global-batch", "32", "--top", "2",
            "--what-if", "rank 6 x1.5", "--what-if", "link 3-4 +5ms"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "treating all devices alike" in text and "what if 'rank 6 x1.5'" in text and "best response:" in text
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speedup"] == pytest.approx(out["alike"]["step_time_s"] / out["candidates"][0]["step_time_s"])
    assert out["speedup"] >= 1.0 and len(out["what_if"]) == 2
    model = model_preset(MODEL)
    best = search_cluster(model, cluster, global_batch=32, top_k=1).best
    slowed = out["what_if"][0]
    assert slowed["before"]["step_time_s"] == pytest.approx(best.step_time_s, rel=1e-12)
    _check_consistent(MODEL, cluster, slowed, best, cluster.slowed(6, 1.5))
    _check_consistent(MODEL, cluster, out["what_if"][1], best, cluster.delayed(3, 4, 5e-3))
