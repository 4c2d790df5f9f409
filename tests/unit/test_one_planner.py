"""One planner: ``estimate``, ``plan`` and ``plan --explain bpipe`` with ``--gpu`` and with ``--profile`` reach the
same estimate and search functions (issue 31), run in-process; the profiled duplicates are gone."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
from typing import Any

import pytest

import evenpipe.commands.estimate as estimate_command
import evenpipe.plan.search as plan_search
from evenpipe.cli import main
from evenpipe.plan.search import Searcher

sys.path.insert(0, str(pathlib.Path(__file__).parent / "cost"))
from test_profile_fit import make_profile  # noqa: E402

cost_estimate = importlib.import_module("evenpipe.cost.estimate")  # the package exports a function of this name
GPU = ["--model", "gpt-1.7b", "--gpu", "a100-80gb"]


@pytest.fixture()
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Record which kind of source every call of the one estimate and the one search is made over."""
    seen: dict[str, list[str]] = {"estimate": [], "search": []}
    real_estimate, real_search = cost_estimate.estimate_with, Searcher.search
    assert estimate_command.estimate_with is real_estimate and plan_search.estimate_with is real_estimate

    def estimate_spy(source: Any, cfg: Any) -> Any:
        seen["estimate"].append(type(source).__name__)
        return real_estimate(source, cfg)

    def search_spy(self: Searcher, **kwargs: Any) -> Any:
        seen["search"].append(type(self.source).__name__)
        return real_search(self, **kwargs)
    monkeypatch.setattr(estimate_command, "estimate_with", estimate_spy)
    monkeypatch.setattr(plan_search, "estimate_with", estimate_spy)
    monkeypatch.setattr(Searcher, "search", search_spy)
    return seen


def test_estimate_and_plan_reach_one_estimate_and_one_search(tmp_path: pathlib.Path, spies: dict[str, list[str]],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(make_profile(layers=8).to_json())
    prof = ["--profile", str(profile), "--memory-gib", "1"]
    one = ["--pp", "2", "--microbatch-size", "2", "--global-batch", "16", "--json"]
    assert main(["estimate", *GPU, "--gpus", "2", *one]) == 0
    assert main(["estimate", *prof, *one]) == 0
    assert spies["estimate"] == ["AnalyticSource", "ProfiledSource"]
    both = [json.loads(part) for part in capsys.readouterr().out.replace("}\n{", "}\n\x00{").split("\x00")]
    assert {e["gpu"] for e in both} == {"a100-80gb", "test cpu (cpu, float32, profiled)"}
    assert all(e["num_microbatches"] == 8 and len(e["peak_bytes"]) == 2 for e in both)

    plan = ["--gpus", "4", "--global-batch", "16", "--max-microbatch-size", "4", "--top", "2"]
    for source in (GPU, prof):
        spies["estimate"].clear()
        spies["search"].clear()
        assert main(["plan", *source, *plan]) == 0
        assert main(["plan", *source, *plan, "--explain", "bpipe", "--json"]) == 0
        kind = "AnalyticSource" if source is GPU else "ProfiledSource"
        assert spies["search"] and set(spies["search"]) == {kind}
        assert spies["estimate"] and set(spies["estimate"]) == {kind}
        capsys.readouterr()


@pytest.mark.parametrize("source", ["gpu", "profile"])
def test_plan_explain_bpipe_answers_for_both_sources(source: str, tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(make_profile(layers=8).to_json())
    where = GPU if source == "gpu" else ["--profile", str(profile), "--memory-gib", "1"]
    assert main(["plan", *where, "--gpus", "4", "--global-batch", "16", "--max-microbatch-size", "4",
                 "--explain", "bpipe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    e = out["explain_bpipe"]
    assert e["verdict"] in ("pays", "marginal", "does not pay") and e["with_bpipe"]["bpipe"]
    assert out["without"] == e["without"] and not out["without"]["bpipe"] and "verdict: BPipe" in out["text"]


@pytest.mark.parametrize("gone", ["evenpipe.plan.profiled", "evenpipe.commands.profiled_plan",
                                  "evenpipe.runtime.predict", "evenpipe.commands.profile_args"])
def test_the_duplicates_are_gone(gone: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(gone)


def test_one_source_at_a_time(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(make_profile(layers=8).to_json())
    code = main(["plan", *GPU, "--profile", str(profile), "--gpus", "4", "--global-batch", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "one of --gpu or --profile" in err and len(err.strip().splitlines()) == 1


def test_a_profiled_plan_names_the_train_command_of_the_profiled_model(tmp_path: pathlib.Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(make_profile(layers=8).to_json())
    assert main(["plan", "--profile", str(profile), "--gpus", "2", "--global-batch", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "-m evenpipe train --model gpt-tiny " in out and "--stages 2" in out and "note:" not in out


def test_estimate_and_plan_with_a_cluster_reach_the_same_estimate_and_search(
        tmp_path: pathlib.Path, spies: dict[str, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    """``--cluster`` (issue 35) is one more source, per pipeline rank, under the one estimate and the one search."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"links": {"intra_node": {"latency_s": 5e-6}, "inter_node": {"latency_s": 1e-5}},
                                   "nodes": [{"device": "a100-80gb", "ranks": [0, 1]},
                                             {"device": "h100-80gb", "ranks": [2, 3]}]}))
    where = ["--model", "gpt-1.7b", "--cluster", str(cluster)]
    assert main(["estimate", *where, "--pp", "2", "--microbatch-size", "2", "--global-batch", "16", "--json",
                 "--placement", "fast-first"]) == 0
    assert spies["estimate"] == ["RankSources"]
    est = json.loads(capsys.readouterr().out)
    assert est["num_microbatches"] == 4 and len(est["peak_bytes"]) == 2  # dp 2 from the cluster's 4 ranks
    spies["estimate"].clear()
    assert main(["plan", *where, "--global-batch", "16", "--max-microbatch-size", "4", "--top", "2",
                 "--what-if", "rank 1 x2"]) == 0
    assert spies["search"] and set(spies["search"]) == {"RankSources"}
    assert spies["estimate"] and set(spies["estimate"]) == {"RankSources"}
    assert "what if 'rank 1 x2'" in capsys.readouterr().out
