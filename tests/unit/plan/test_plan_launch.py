"""The launch command of a planned configuration (evenpipe.plan.launch)."""

from __future__ import annotations

import dataclasses

from evenpipe.cost import model_preset
from evenpipe.cost.parallel import ParallelConfig, Recompute
from evenpipe.plan.launch import launch_command
from evenpipe.schedule import ScheduleFamily


def _cmd(**kw):
    cfg = ParallelConfig(**{"tp": 2, "pp": 4, "dp": 2, "microbatch_size": 1, "global_batch": 16, **kw})
    model = dataclasses.replace(model_preset("gpt-tiny"), num_layers=8)
    return launch_command(cfg, model=model, model_args=("--model", "gpt-tiny"), gpus_per_node=8)


def test_one_node_is_standalone_and_names_every_option() -> None:
    cmd = _cmd(dp=1, schedule=ScheduleFamily.BPIPE, distributed_optimizer=True, recompute=Recompute.FULL)
    assert (cmd.num_nodes, cmd.procs_per_node) == (1, 8)
    text = cmd.text()
    assert text.startswith("torchrun --nproc-per-node=8 --standalone -m evenpipe train --model gpt-tiny ")
    for part in ("--tp 2", "--stages 4", "--dp 1", "--sharding optimizer", "--schedule bpipe", "--chunks 1",
                 "--microbatches 16", "--microbatch-size 1", "--global-batch 16", "--recompute full", "--layout 2,2,2,2"):
        assert part in text, part
    assert cmd.notes == ()


def test_many_nodes_use_a_rendezvous_selective_runs_and_unsupported_choices_are_noted() -> None:
    cmd = _cmd(dp=4, recompute=Recompute.SELECTIVE, sequence_parallel=True, chunks=2,
               schedule=ScheduleFamily.INTERLEAVED, global_batch=32)
    assert (cmd.num_nodes, cmd.procs_per_node) == (4, 8)
    assert "--nnodes=4 --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500" in cmd.text()
    assert "--layout 1,1,1,1,1,1,1,1" in cmd.text() and "--sharding none" in cmd.text()
    assert " --recompute selective" in cmd.text() and not cmd.notes
    assert " --sequence-parallel" in cmd.text()  # the runtime runs what the plan chose (issue 33)


def test_sequence_parallelism_the_runtime_cannot_run_is_noted() -> None:
    model = dataclasses.replace(model_preset("gpt-tiny"), num_layers=8, seq_len=15)
    cfg = ParallelConfig(tp=2, pp=4, microbatch_size=1, global_batch=16, sequence_parallel=True)
    odd = launch_command(cfg, model=model, model_args=("--model", "gpt-tiny"), gpus_per_node=8)
    hf = launch_command(cfg, model=model_preset("gpt-tiny"), model_args=("--hf-config", "x.json"), gpus_per_node=8)
    for cmd in (odd, hf):
        assert "--sequence-parallel" not in cmd.text() and any("sequence" in n for n in cmd.notes)


def test_plan_prints_the_best_command_and_json_has_one_per_candidate(capsys) -> None:
    import json

    from evenpipe.cli import main
    args = ["plan", "--model", "gpt-tiny", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "16", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("run the best"))
    assert out[at + 1].strip().startswith("torchrun --nproc-per-node=8 --standalone -m evenpipe train --model gpt-tiny")
    assert main([*args, "--json"]) == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    assert len(cands) == 3 and all(c["launch"]["command"].startswith("torchrun ") for c in cands)
    assert all(f"--stages {c['pp']} " in c["launch"]["command"] and f"--tp {c['tp']} " in c["launch"]["command"]
               for c in cands)


def test_bpipe_on_interleaved_is_launched_with_the_flag() -> None:
    text = _cmd(dp=1, chunks=2, schedule=ScheduleFamily.INTERLEAVED, bpipe=True).text()
    assert "--schedule interleaved" in text and " --bpipe" in text
    assert " --bpipe" not in _cmd(dp=1, chunks=2, schedule=ScheduleFamily.INTERLEAVED).text()


def test_offload_is_launched_with_train_s_option_and_parses_to_the_planned_ranks() -> None:
    import argparse

    from evenpipe.commands import train
    model = model_preset("gpt-tiny")
    for k, text in ((1, "0"), (2, "0-1"), (4, "all")):
        cfg = ParallelConfig(tp=1, pp=4, dp=1, microbatch_size=1, global_batch=8, offload_ranks=k)
        cmd = launch_command(cfg, model=model, model_args=("--model", "gpt-tiny"), gpus_per_node=8)
        assert f" --offload {text}" in cmd.text() and not cmd.notes
        parser = argparse.ArgumentParser()
        train.add_arguments(parser)
        config = train.build_config(parser.parse_args([*cmd.train, "--random-tokens"]))
        assert config.schedule.offload == tuple(range(k))
    assert "--offload" not in _cmd().text()
