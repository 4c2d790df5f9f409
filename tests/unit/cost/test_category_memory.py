"""Memory by category, predicted: the runtimes' bytes per parameter, the message-buffer walk, and estimate's key."""

from __future__ import annotations

import json

import pytest

from evenpipe.cli import main
from evenpipe.cost.category_memory import message_buffer_peak
from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions, StateSharding, TrainPrecision
from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule


def _bytes(runtime: str, dtype: str, sharding: str, dp: int) -> tuple[float, float, float, float]:
    b = RuntimeConventions(runtime=Runtime(runtime), dtype=TrainPrecision(dtype),
                           sharding=StateSharding(sharding)).state_bytes(dp)
    return b.parameters, b.gradients, b.master, b.optimizer


@pytest.mark.parametrize(("runtime", "dtype", "sharding", "expected"), [
    ("evenpipe", "float32", "none", (4, 4, 0, 8)),
    ("evenpipe", "float32", "optimizer", (4, 4, 0, 2)),
    ("evenpipe", "float32", "full", (1, 1, 0, 2)),
    ("evenpipe", "bfloat16", "none", (2, 6, 4, 8)),
    ("evenpipe", "bfloat16", "optimizer", (2, 3, 1, 2)),
    ("evenpipe", "bfloat16", "full", (0.5, 1.5, 1, 2)),
    ("megatron", "bfloat16", "none", (2, 4, 4, 8)),
    ("megatron", "bfloat16", "optimizer", (2, 4, 1, 2)),
])
def test_bytes_per_parameter_at_dp_4(runtime: str, dtype: str, sharding: str,
                                     expected: tuple[float, ...]) -> None:
    assert _bytes(runtime, dtype, sharding, 4) == expected


def test_megatron_has_no_full_sharding() -> None:
    with pytest.raises(ConfigError, match="--sharding full.*--runtime evenpipe"):
        RuntimeConventions(runtime=Runtime.MEGATRON, sharding=StateSharding.FULL)


def test_message_buffers_of_1f1b_on_two_ranks() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    # rank 0 posts a SEND_F and, in steady state, the RECV_B of the next backward with the SEND_F of the forward
    # before it still unwaited; rank 1 holds at most a RECV_F and a SEND_B
    peaks = [message_buffer_peak(s, r, 10.0) for r in range(2)]
    assert peaks == [30.0, 20.0]
    assert message_buffer_peak(build_schedule("1f1b", num_ranks=1, num_microbatches=4), 0, 10.0) == 0.0


def _estimate(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main(["estimate", "--model", "gpt-tiny", "--gpu", "h100-80gb", "--pp", "2", "--dp", "2",
                 "--global-batch", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_gives_categories_per_rank_by_the_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    fp32 = _estimate(capsys)
    bf16 = _estimate(capsys, "--dtype", "bfloat16", "--sharding", "optimizer")
    mega = _estimate(capsys, "--runtime", "megatron")
    assert fp32["runtime"] == {"runtime": "evenpipe", "dtype": "float32", "sharding": "none"}
    assert mega["runtime"]["dtype"] == "bfloat16"
    for a, b, m in zip(fp32["peak_bytes_by_category"], bf16["peak_bytes_by_category"],
                       mega["peak_bytes_by_category"]):
        n = a["parameters"] / 4  # the rank's parameters
        assert n == int(n) > 0 and a["master_weights"] == 0 and a["optimizer_state"] == 8 * n
        assert (b["parameters"], b["gradients"], b["master_weights"], b["optimizer_state"]) == \
            (2 * n, 4 * n, 2 * n, 4 * n)
        assert b["communication_buffers"] * 2 == a["communication_buffers"] > 0
        assert m["gradients"] == 4 * n and m["master_weights"] == 4 * n


@pytest.mark.parametrize(("args", "message"), [
    (["--runtime", "deepspeed"], "runtime"), (["--dtype", "float16"], "dtype"), (["--sharding", "zero3"], "sharding"),
    (["--runtime", "megatron", "--dtype", "float32"], "--dtype float32"),
    (["--sharding", "none", "--distributed-optimizer"], "--distributed-optimizer"),
])
def test_bad_runtime_options_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "gpt-tiny", "--gpu", "h100-80gb", "--pp", "2", "--dp", "2",
                 "--global-batch", "8", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_category_table_marks_exact_counts_and_errors() -> None:
    from evenpipe.plan.predict import category_table
    measured = [dict.fromkeys(("parameters", "own_activations"), 1024)]
    table = category_table([{"parameters": 1024, "own_activations": 1075}], measured)
    rows = {line.split()[1]: line for line in table.splitlines()[2:]}
    assert rows["parameters"].endswith("exact") and rows["own_activations"].endswith("+5.0%")
    assert "not predicted" in category_table(None, measured)


def test_plan_takes_the_runtime_options(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "gpt-tiny", "--gpu", "h100-80gb", "--gpus", "2", "--global-batch", "8", "--top", "1",
            "--json"]

    def plans(*extra: str) -> list:
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["candidates"]
    assert plans() == plans("--runtime", "evenpipe", "--dtype", "bfloat16")  # plan's default: what train keeps, bf16
    assert plans("--runtime", "megatron") and plans("--runtime", "evenpipe", "--dtype", "float32", "--sharding",
                                                    "optimizer")


@pytest.mark.parametrize("sharding", ["none", "full"])
def test_a_tied_table_on_one_rank_counts_once_and_stays_whole_under_fsdp(capsys: pytest.CaptureFixture[str],
                                                                        sharding: str) -> None:
    """zb-v puts stages 0 and 3 (of gpt-tiny's 4 one-layer stages) on rank 0: the tied token table is one tensor
    there, and under --sharding full the runtime leaves it out of FSDP (measured by a train run of the same
    configuration: 482304 and 273920 bytes)."""
    from evenpipe.cost.specs import MODEL_PRESETS
    from evenpipe.cost.states import layer_params_per_rank
    spec = MODEL_PRESETS["gpt-tiny"]
    table = spec.vocab * spec.hidden
    rest = 2 * layer_params_per_rank(spec, 1) + spec.position_params + spec.final_norm_params
    got = _estimate(capsys, "--schedule", "zb-v", "--sharding", sharding)["peak_bytes_by_category"][0]
    want = 4 * (rest + table) if sharding == "none" else 4 * (rest / 2 + table)
    assert got["parameters"] == got["gradients"] == want
    assert got["optimizer_state"] == 2 * want
    # FSDP gathers the rest whole (weights and gradients), the table not at all
    assert got["gathered_states"] == (0 if sharding == "none" else 2 * 4 * rest)


def test_fsdp_gathers_whole_weights_and_gradients_in_the_training_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    """Under --sharding full a rank also holds, during a step, its stages' whole weights and their unsharded
    gradients, twice the unsharded weights' bytes (train measures gpt-tiny float32 at pp 2 x dp 2: 963584 and
    931840 bytes); the fit check (stage_memory) counts them too."""
    from evenpipe.cost.analytic_source import AnalyticSource
    from evenpipe.cost.category_memory import with_conventions
    from evenpipe.cost.hardware import hardware_preset
    from evenpipe.cost.memory import GIB, stage_memory
    from evenpipe.cost.parallel import ParallelConfig
    from evenpipe.cost.specs import MODEL_PRESETS
    for dtype in ("float32", "bfloat16"):
        full = _estimate(capsys, "--sharding", "full", "--dtype", dtype)["peak_bytes_by_category"]
        plain = _estimate(capsys, "--dtype", dtype)["peak_bytes_by_category"]
        assert [c["gathered_states"] for c in full] == [2 * c["parameters"] for c in plain]
        assert all(c["gathered_states"] == 0 for c in plain)
        conventions = RuntimeConventions(dtype=TrainPrecision(dtype), sharding=StateSharding.FULL)
        source = with_conventions(AnalyticSource(MODEL_PRESETS["gpt-tiny"], hardware_preset("h100-80gb")),
                                  conventions)
        ranks = stage_memory(source, ParallelConfig(pp=2, dp=2, global_batch=8))
        assert [round(m.gathered * GIB) for m in ranks] == [c["gathered_states"] for c in full]
    assert [c["gathered_states"] for c in _estimate(capsys, "--sharding", "full")["peak_bytes_by_category"]] == \
        [963584, 931840]


@pytest.mark.parametrize("family", ["1f1b", "zb-h1"])
def test_message_buffers_of_unequal_microbatches(family: str) -> None:
    """Each micro-batch's messages at its own size (documents): equal sizes are the scalar walk; one micro-batch
    twice as large raises a rank's peak by at most what its own messages add, never above every one that large."""
    s = build_schedule(family, num_ranks=4, num_microbatches=8)
    for r in range(4):
        scalar = message_buffer_peak(s, r, 10.0)
        assert message_buffer_peak(s, r, [10.0] * 8) == scalar
        one_big = message_buffer_peak(s, r, [10.0] * 3 + [20.0] + [10.0] * 4)
        assert scalar <= one_big <= min(2 * scalar, scalar + 10.0 * 2)
    assert message_buffer_peak(s, 1, [10.0] * 3 + [20.0] + [10.0] * 4) > message_buffer_peak(s, 1, 10.0)
