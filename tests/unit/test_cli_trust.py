"""Plans a person can trust (issue 31 point 5): tensor parallelism divides a node (``--gpus-per-node``), a profiled
plan says when its micro-batch size was not profiled, and the plan table explains its columns."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from evenpipe.cli import main
from evenpipe.commands.plan import TABLE_LEGEND, microbatch_fit

sys.path.insert(0, str(pathlib.Path(__file__).parent / "cost"))
from test_profile_fit import make_profile  # noqa: E402

GPT = ["--model", "gpt3-175b", "--gpu", "a100-80gb"]


def _plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("per_node,allowed", [(None, {1, 2, 4, 8}), ("6", {1, 2, 3, 6})])
def test_plan_tries_only_tp_that_divides_a_node(per_node: str | None, allowed: set[int],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # 96 heads and 48 GPUs admit tp 3 and 6; only divisors of the node are proposed.
    extra = [] if per_node is None else ["--gpus-per-node", per_node]
    out = _plan_json([*GPT, "--gpus", "48", "--global-batch", "96", "--top", "30", *extra], capsys)
    tps = {c["tp"] for c in out["candidates"]}
    assert tps <= allowed and tps & (allowed - {1, 2})
    if per_node is not None:
        assert all(c["launch"]["procs_per_node"] == min(6, c["tp"] * c["pp"] * c["dp"]) for c in out["candidates"])


def test_estimate_refuses_tp_that_does_not_divide_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", *GPT, "--tp", "3", "--pp", "4", "--global-batch", "64"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "tp 3 does not divide the 8 GPUs of one a100-80gb node" in err and "allowed: 1, 2, 4, 8" in err
    assert main(["estimate", *GPT, "--tp", "3", "--pp", "4", "--global-batch", "64", "--gpus-per-node", "6"]) == 0
    assert main(["estimate", *GPT, "--tp", "1", "--global-batch", "64", "--gpus-per-node", "0"]) == 2
    assert "--gpus-per-node must be a positive integer, got 0" in capsys.readouterr().err


def test_microbatch_fit_words() -> None:
    assert [microbatch_fit(b, (1, 2, 4)) for b in (1, 3, 8)] == ["measured", "interpolated", "extrapolated"]


def test_profiled_plan_says_when_it_extrapolates(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(make_profile(sizes=(1, 2), layers=8).to_json())
    argv = ["--profile", str(profile), "--gpus", "2", "--global-batch", "16", "--max-microbatch-size", "8"]
    out = _plan_json(argv, capsys)
    assert out["profiled_microbatch_sizes"] == [1, 2]
    words = {c["microbatch_size"]: c["microbatch_costs"] for c in out["candidates"]}
    assert {b for b, w in words.items() if w == "extrapolated"} == {b for b in words if b > 2}
    assert any(b > 2 for b in words), words  # the plan did recommend an unprofiled size
    assert main(["plan", *argv]) == 0
    printed = capsys.readouterr().out
    for b in sorted(b for b in words if b > 2):
        assert f"note: b={b} was not profiled (measured: b=1, 2); its layer costs are extrapolated" in printed


def test_plan_table_has_a_legend_naming_every_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *GPT, "--gpus", "64", "--global-batch", "64", "--top", "2"]) == 0
    printed = capsys.readouterr().out
    assert "\n".join(TABLE_LEGEND) in printed
    legend = " ".join(TABLE_LEGEND)
    for column in ("v =", "tp, pp, dp =", "mbs =", "m =", "recompute =", "MFU =", "peak GiB =", "bubble =",
                   "distopt =", "layers =", "12,14x4,12", "limited by ="):
        assert column in legend
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "commands" / "plan.md").read_text()
    assert "12,14x4,12" in docs and "limited by" in docs and "distopt" in docs
