"""The memory model reproduces Korthikanti et al. 2022's first-stage figures exactly (all rows, all columns)."""

from __future__ import annotations

import pytest

from evenpipe.cost import (Arch, Attention, ModelSpec, ParallelConfig, Recompute, ScheduleFamily, hardware_preset,
                           memory_per_stage)

from cost_reference import LOCAL, SHARED, read_rows

ROWS = read_rows("korthikanti2022_memory.csv")


def _model(row: dict[str, str]) -> ModelSpec:
    h = int(row["hidden"])
    return ModelSpec(name=row["model"], arch=Arch.GPT, num_layers=int(row["layers"]), hidden=h,
                     num_heads=int(row["heads"]), num_kv_heads=int(row["heads"]), ffn_hidden=4 * h, vocab=51200,
                     seq_len=int(row["seq_len"]), tied_embeddings=True, count_norm_and_bias=False)


def _config(row: dict[str, str], *, recompute: Recompute, sp: bool) -> ParallelConfig:
    pp, v, b = int(row["pp"]), int(row["chunks"]), int(row["microbatch_size"])
    return ParallelConfig(tp=int(row["tp"]), pp=pp, dp=1, chunks=v, microbatch_size=b, global_batch=4 * pp * b,
                          recompute=recompute, sequence_parallel=sp, attention=Attention.EAGER,
                          schedule=ScheduleFamily.INTERLEAVED if v > 1 else ScheduleFamily.ONE_F_ONE_B)


def test_local_copy_matches_shared_reference() -> None:
    if not SHARED.exists():
        pytest.skip("no ../shared/reference next to the repository")
    for name in ("korthikanti2022_memory.csv", "megatron2021_weak_scaling.csv"):
        assert (LOCAL / name).read_text() == (SHARED / name).read_text()


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_params_and_optimizer_column(row: dict[str, str]) -> None:
    first = memory_per_stage(_model(row), hardware_preset("a100-80gb"),
                             _config(row, recompute=Recompute.NONE, sp=False))[0]
    assert first.model_states == float(row["params_optimizer_gib"])


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_activations_tensor_parallel_only(row: dict[str, str]) -> None:
    first = memory_per_stage(_model(row), hardware_preset("a100-80gb"),
                             _config(row, recompute=Recompute.NONE, sp=False))[0]
    assert first.activations == float(row["activations_tp_only_gib"])
    assert first.hosted == 0.0


@pytest.mark.parametrize("row", ROWS, ids=[r["model"] for r in ROWS])
def test_activations_sequence_parallel_selective(row: dict[str, str]) -> None:
    first = memory_per_stage(_model(row), hardware_preset("a100-80gb"),
                             _config(row, recompute=Recompute.SELECTIVE, sp=True))[0]
    assert first.activations == float(row["activations_sp_selective_gib"])
