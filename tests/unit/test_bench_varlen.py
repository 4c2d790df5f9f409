"""``benchmarks/bench_varlen.py``'s arithmetic (mechanics only: no world is started): each policy's real tokens per
second over rounds, the ratios taken round by round, padding, and the written documents file."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_varlen  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "unit" / "cost"))
from test_profile_fit import make_profile  # noqa: E402


def _row(seconds: float, real: int, computed: int) -> dict:
    return {"seconds": seconds, "real_tokens": real, "computed_tokens": computed,
            "steps": [{"real": real, "shapes": ()}]}


def test_ratios_are_taken_round_by_round() -> None:
    rounds = [{"pad": _row(1.0, 50, 100), "balance": _row(1.0, 100, 100)},
              {"pad": _row(2.0, 50, 100), "balance": _row(1.0, 150, 200)}]
    opts = {"policies": ["pad", "balance"], "profile": None}
    out = bench_varlen.summarize(rounds, opts)
    assert out["policies"]["pad"]["real_tokens_per_s"] == {"median": 37.5, "min": 25.0, "max": 50.0}
    assert out["policies"]["balance"]["padding"] == 1 - 250 / 300
    assert out["policies"]["balance"]["predicted_tokens_per_s"] is None  # no profile
    assert out["ratios"] == {"balance/pad": {"median": 4.0, "min": 2.0, "max": 6.0}}  # medians: 125 / 37.5
    rounds[1]["pad"] = _row(1.0, 100, 100)
    assert bench_varlen.summarize(rounds, opts)["ratios"]["balance/pad"]["median"] == 1.75


def test_documents_file_holds_the_lengths(tmp_path: pathlib.Path) -> None:
    path = bench_varlen.write_documents([3, 1, 5], tmp_path, vocab=7, seed=0)
    tokens = np.fromfile(path, dtype=np.uint16)
    assert len(tokens) == 9 and tokens.max() < 7
    assert np.fromfile(tmp_path / "docs.idx", dtype="<i8").tolist() == [0, 3, 4, 9]


def test_ratio_of_the_simulated_order_to_the_planned_one() -> None:
    rounds = [{"balance": _row(1.0, 100, 100), "balance+simulated": _row(0.8, 100, 100)}]
    out = bench_varlen.summarize(rounds, {"policies": ["balance", "balance+simulated"], "profile": None})
    assert out["ratios"] == {"balance+simulated/balance": {"median": 1.25, "min": 1.25, "max": 1.25}}


def test_prediction_prices_the_shapes_the_runtime_ran(tmp_path: pathlib.Path) -> None:
    # two steps of the same real tokens: the one whose micro-batches compute more tokens is predicted slower,
    # and the figure is all real tokens over the two simulated steps
    import dataclasses

    from evenpipe.cost import ParallelConfig, ScheduleFamily
    from evenpipe.cost.estimate import estimate_with
    from evenpipe.cost.profile_fit import ProfileModel
    from evenpipe.cost.profiled_source import ProfiledSource
    from evenpipe.cost.shape import MicrobatchShape
    path = tmp_path / "profile.json"
    path.write_text(make_profile().to_json())
    opts = {"profile": str(path), "model": "gpt-tiny", "stages": 2, "chunks": None, "microbatch_size": 1,
            "microbatches": 2, "schedule": "1f1b", "seq_len": 1024}
    short = (MicrobatchShape(size=1, seq_len=16, tokens=4, squared_lengths=16),) * 2
    long = (MicrobatchShape(size=1, seq_len=16, tokens=16, squared_lengths=16 * 16),) * 2
    cfg = ParallelConfig(pp=2, microbatch_size=1, global_batch=2, schedule=ScheduleFamily.ONE_F_ONE_B,
                         layout=(1, 3))  # the runtime's split of gpt-tiny at 1024 positions (see below)
    source = ProfiledSource(ProfileModel(make_profile()))
    step = {sh: estimate_with(source, dataclasses.replace(cfg, microbatch_shapes=sh)).step_time_s
            for sh in (short, long)}
    assert step[long] > step[short]
    got = bench_varlen.predicted_tokens_per_s([{"real": 16, "shapes": short}, {"real": 16, "shapes": long}], opts)
    assert got == 32 / (step[short] + step[long])


def test_the_prediction_prices_the_stages_the_runtime_built() -> None:
    # gpt-tiny at 1024 positions: its position table outweighs a block, so the runtime's split by parameters puts
    # 1 and 3 blocks on two stages (not the even 2 and 2), and the prediction must price those stages
    from evenpipe.models import model_config
    from evenpipe.runtime.stages import stage_block_counts
    opts = {"model": "gpt-tiny", "stages": 2, "chunks": None, "microbatches": 2, "schedule": "1f1b", "seq_len": 1024}
    assert bench_varlen.runtime_layout(opts) == stage_block_counts(model_config("gpt-tiny", seq_len=1024), 2, None)
    assert bench_varlen.runtime_layout(opts) == (1, 3)
    assert bench_varlen.runtime_layout({**opts, "stages": 4}) == (1, 1, 1, 1)


def test_a_step_that_ran_as_predicted_decomposes_to_ones(tmp_path: pathlib.Path, monkeypatch) -> None:
    # a "measured" trace that is the simulated one: its replay is itself and its computes are the predicted ones;
    # a second, slower policy (its computes twice the profile's) shows in the compute ratio
    from evenpipe.cost.profile_fit import ProfileModel
    from evenpipe.cost.shape import MicrobatchShape
    from evenpipe.runtime import trace as trace_module
    from evenpipe.sim.dispatch import simulate
    path = tmp_path / "profile.json"
    path.write_text(make_profile().to_json())
    opts = {"profile": str(path), "model": "gpt-tiny", "stages": 2, "chunks": None, "microbatch_size": 1,
            "microbatches": 2, "schedule": "1f1b", "seq_len": 1024}
    shapes = (MicrobatchShape(size=1, seq_len=16, tokens=4, squared_lengths=16),
              MicrobatchShape(size=1, seq_len=16, tokens=16, squared_lengths=256))
    model = ProfileModel(make_profile())
    layout = bench_varlen.runtime_layout(opts)
    monkeypatch.setattr(trace_module, "measured_trace", lambda sched, records: simulate(
        sched, model.sim_costs(sched, microbatch_size=1, shapes=shapes, layout=layout)))
    out = bench_varlen.decompose([{"shapes": shapes, "records": None}], opts)
    assert out is not None
    assert out["replay/measured"] == 1.0 and out["compute predicted/measured"] == 1.0
    assert out["predicted_pipeline_s"] == out["measured_pipeline_s"] > 0
    slow = make_profile(fixed=3.0)  # every compute slower than the profile the prediction reads
    monkeypatch.setattr(trace_module, "measured_trace", lambda sched, records: simulate(
        sched, ProfileModel(slow).sim_costs(sched, microbatch_size=1, shapes=shapes, layout=layout)))
    out = bench_varlen.decompose([{"shapes": shapes, "records": None}], opts)
    assert out is not None and out["compute predicted/measured"] < 1.0
    assert bench_varlen.decompose([], opts) is None


def test_concurrency_is_the_time_weighted_overlap_of_computes() -> None:
    from types import SimpleNamespace

    def rec(start: float, end: float, transfer: bool = False) -> SimpleNamespace:
        return SimpleNamespace(start=start, end=end, action=SimpleNamespace(kind=SimpleNamespace(is_transfer=transfer)))
    apart = SimpleNamespace(actions=[[rec(0.0, 1.0)], [rec(1.0, 2.0), rec(0.0, 5.0, transfer=True)]])
    assert bench_varlen.concurrency(apart) == 1.0  # a transfer is no compute
    half = SimpleNamespace(actions=[[rec(0.0, 1.0)], [rec(0.5, 1.5)]])
    assert bench_varlen.concurrency(half) == 1.5  # each overlaps the other for half its time
    assert bench_varlen.concurrency(SimpleNamespace(actions=[[], []])) == 1.0
