"""The cluster description (issue 35 point 1): parsing, one-line errors for bad files, and its simulator costs."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest

from evenpipe.cli import main
from evenpipe.commands.simulate import link_plan_for
from evenpipe.cost.cluster import LinkClass, cluster_sim_costs, load_cluster, parse_cluster
from evenpipe.errors import ConfigError
from evenpipe.sim import SimCosts

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "cluster.json"
LINKS = {"intra_node": {"latency_s": 1e-5, "bandwidth_gb_per_s": 100}, "inter_node": {"latency_s": 1e-4}}


def _doc(nodes: list[dict[str, Any]] | None = None, links: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"links": LINKS if links is None else links,
            "nodes": nodes if nodes is not None else [{"name": "a", "device": "a100-80gb", "ranks": [0, 1]},
                                                       {"name": "b", "device": "h100-80gb", "ranks": [2, 3]}]}


def test_example_file_loads() -> None:
    c = load_cluster(EXAMPLE)
    assert c.num_ranks == 8
    assert c.link_class(0, 1) is LinkClass.INTRA_NODE
    assert c.link_class(1, 2) is LinkClass.INTER_NODE
    assert c.link_class(3, 4) is LinkClass.INTER_DATACENTER
    assert c.link(3, 4).latency_s == 0.004 and c.link(3, 4).bandwidth_bytes_per_s == 10e9
    assert c.speed(0) == 1.0 and c.speed(3) == pytest.approx(0.67)
    assert c.speed(4) == pytest.approx(312 / 989)  # an A100 among H100s, by dense peak
    assert c.ranks[4].memory_gib == 80


def test_rank_objects_override_their_node() -> None:
    nodes = [{"device": "a100-80gb", "speed": 2, "memory_gib": 70,
              "ranks": [0, {"rank": 1, "speed": 0.5, "memory_gib": 40}]}]
    c = parse_cluster(_doc(nodes))
    assert [r.speed for r in c.ranks] == [2.0, 0.5] and [r.memory_gib for r in c.ranks] == [70, 40]
    assert c.link(0, 1).bandwidth_bytes_per_s == 100e9


def test_sim_costs_scale_each_rank_and_set_every_pair() -> None:
    nodes = [{"device": "a100-80gb", "ranks": [0, {"rank": 1, "speed": 0.5}]},
             {"device": "a100-80gb", "ranks": [2]}]
    c = parse_cluster(_doc(nodes))
    costs = cluster_sim_costs(SimCosts.uniform(num_stages=3, forward=1, backward=2, weight=1), c, (0, 1, 2))
    assert [s.forward for s in costs.stages] == [1, 2, 1]
    assert [s.backward_input + s.backward_weight for s in costs.stages] == [3, 6, 3]
    assert costs.link(0, 1).latency_s == 1e-5 and costs.link(1, 2).latency_s == 1e-4
    plan = link_plan_for(costs, (0, 1, 2))  # what latency-aware plans with on this cluster
    assert plan.slowdown == (1.0, 2.0, 1.0) and (plan.forward, plan.backward_input) == (1, 2)
    assert plan.message_time(0, 1) == 1e-5 and plan.message_time(2, 1) == 1e-4
    with pytest.raises(ConfigError, match="the cluster has 3 ranks, the schedule 2"):
        cluster_sim_costs(SimCosts.uniform(num_stages=2), c, (0, 1))


BAD: list[tuple[str, Any, str]] = [
    ("not json", "{", "is not JSON"),
    ("not an object", [1, 2], "expected a JSON object, got list"),
    ("unknown top key", {**_doc(), "extra": 1}, "unknown key(s) extra"),
    ("unknown device", _doc([{"device": "tpu-v9", "ranks": [0]}]), "unknown device 'tpu-v9'; allowed: a100-40gb"),
    ("zero speed", _doc([{"device": "a100-80gb", "speed": 0, "ranks": [0]}]), "speed must be a finite number > 0"),
    ("negative speed", _doc([{"device": "a100-80gb", "ranks": [{"rank": 0, "speed": -1}]}]), "got -1"),
    ("rank missing", _doc([{"device": "a100-80gb", "ranks": [0, 1, 3]}]), "ranks 2 missing"),
    ("rank twice", _doc([{"device": "a100-80gb", "ranks": [0, 1]}, {"device": "a100-80gb", "ranks": [1]}]),
     "rank 1 is listed twice"),
    ("latency NaN", _doc(links={"intra_node": {"latency_s": math.nan}}), "latency_s must be a finite number >= 0"),
    ("latency negative", _doc(links={"intra_node": {"latency_s": -1}}), "got -1"),
    ("unknown link class", _doc(links={"intra_node": {"latency_s": 0}, "rack": {"latency_s": 0}}),
     "unknown link class 'rack'; allowed: intra_node, inter_node, inter_datacenter"),
    ("link class needed", _doc(links={"intra_node": {"latency_s": 0}}), "need link class 'inter_node'"),
    ("zero bandwidth", _doc(links={**LINKS, "inter_node": {"latency_s": 0, "bandwidth_gb_per_s": 0}}),
     "bandwidth_gb_per_s must be a finite number > 0"),
    ("zero memory", _doc([{"device": "a100-80gb", "memory_gib": 0, "ranks": [0]}]), "memory_gib must be"),
    ("rank not a number", _doc([{"device": "a100-80gb", "ranks": ["zero"]}]), "rank 'zero' is not a rank number"),
    ("no ranks", _doc([{"device": "a100-80gb", "ranks": []}]), "ranks must be a non-empty list"),
    ("missing device", _doc([{"ranks": [0]}]), "missing device"),
    ("missing hardware file", _doc([{"device": "nope.json", "ranks": [0]}]), "unknown device 'nope.json'"),
]


@pytest.mark.parametrize("text,needle", [(b[1] if isinstance(b[1], str) else json.dumps(b[1]), b[2]) for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_cluster_file_is_one_line(tmp_path: pathlib.Path, text: str, needle: str) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    message = str(err.value)
    assert needle in message and "\n" not in message and str(path) in message


def test_cli_bad_cluster_exits_2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_doc([{"device": "a100-80gb", "speed": -2, "ranks": [0, 1]}])))
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--cluster",
                 str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "speed must be a finite number > 0, got -2" in err


def test_cli_cluster_slows_its_slow_rank(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    def step(speed: float) -> float:
        path = tmp_path / "c.json"
        path.write_text(json.dumps(_doc([{"device": "a100-80gb", "ranks": [0, {"rank": 1, "speed": speed}]}],
                                        links={"intra_node": {"latency_s": 0}})))
        assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--cluster",
                     str(path), "--json"]) == 0
        return float(json.loads(capsys.readouterr().out)["step_time"])
    # F=1, B=2: the slow rank's 4 micro-batches take 4 * 3 / speed; the fast rank adds its first F and last B
    assert step(1.0) == 15
    assert step(0.5) == 4 * 6 + 1 + 2
