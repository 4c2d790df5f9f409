"""BPipe with tensor parallelism (issue 13), measured inside the 8-process world of ``test_tensor_parallel``: at
tp 2 x pp 4 each tensor-parallel rank evicts its own shard of activations to its partner with the same
tensor-parallel coordinate, and memory balances as without tensor parallelism.

Every rank runs the same tiny GPT (one block per stage, heads split two ways) with 1F1B and then BPipe (one
warm-up step, then the measured step); "peak" is the executor's measured peak of own plus hosted activation bytes
(the stash counts DTensor activations by their local shards). Rank 0 reports every rank's numbers in one line.
"""

from __future__ import annotations

import json
from typing import Any

import torch

P, TP = 4, 2
M = 2 * P
SEQ = 16
MICROBATCH = 2
_DATA = "DATA:"


def measure_balance(rank: int, world: int) -> list[str]:
    """Run 1F1B and BPipe at tp 2 x pp 4 on ranks 0-7; rank 0 returns one data line with every rank's peaks."""
    import torch.distributed as dist

    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.runtime.tensor_parallel import parallelize_stage
    from evenpipe.schedule import build_schedule

    groups = build_groups(P, 1, tp=TP, timeout_s=60.0)
    assert groups is not None
    cfg = model_config("gpt-tiny", num_layers=P, seq_len=SEQ)  # hidden 64, 4 heads
    data = torch.randint(0, cfg.vocab, (MICROBATCH * M, SEQ + 1), generator=torch.Generator().manual_seed(11))
    tokens, targets = data[:, :-1], data[:, 1:]
    mine: dict[str, Any] = {"pp": groups.pp_rank, "tp": groups.tp_rank}
    for family in ("1f1b", "bpipe"):
        schedule = build_schedule(family, num_ranks=P, num_microbatches=M)
        model = build_model(cfg, seed=3)
        stages = build_stage_modules(model.pipeline_parts(), num_stages=P, stages=schedule.stages_of(groups.pp_rank))
        for stage in stages.values():
            parallelize_stage(stage, groups.mesh["tp"])
        stash = ActivationStash()
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss, stash=stash)
        ex.step(tokens, targets)  # warm-up: shape handshake, BPipe sizes
        result = ex.step(tokens, targets)
        mine[family] = {"peak": result.peak_activation_bytes, "hosted": result.peak_hosted_bytes,
                        "evicted": result.evicted_bytes, "empty": stash.is_empty()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return [_DATA + json.dumps(everyone)] if rank == 0 else []


_BYTES = "BYTES:"
SP_LAYOUTS = (("tp1", 1, False), ("tp2", 2, False), ("tp2-sp", 2, True))
"""Name, tensor-parallel degree and sequence parallelism of each BPipe run of :func:`measure_sequence_bytes`."""


def _sent(result: Any, kind: str) -> list[int]:
    """Bytes of each message of ``kind`` (SEND_F, SEND_B, EVICT) the step sent, in order."""
    return [s.num_bytes for s in result.records.sends if s.action.kind.name == kind]


def measure_sequence_bytes(rank: int, world: int) -> list[str]:
    """BPipe at pp 4 with tp 1, tp 2 and tp 2 with sequence parallelism (ranks outside a layout sit it out): per
    (pp, tp) rank the bytes of each activation and gradient message across a stage boundary and the bytes BPipe
    evicted in the measured step. Rank 0 returns one data line with every rank's numbers."""
    import torch.distributed as dist

    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.runtime.stash import ActivationStash
    from evenpipe.runtime.tensor_parallel import parallelize_stage
    from evenpipe.schedule import build_schedule

    cfg = model_config("gpt-tiny", num_layers=P, seq_len=SEQ)
    data = torch.randint(0, cfg.vocab, (MICROBATCH * M, SEQ + 1), generator=torch.Generator().manual_seed(11))
    mine: list[dict[str, Any]] = []
    for name, tp, sequence_parallel in SP_LAYOUTS:
        groups = build_groups(P, 1, tp=tp, timeout_s=60.0)
        if groups is None:
            continue
        schedule = build_schedule("bpipe", num_ranks=P, num_microbatches=M)
        stages = build_stage_modules(build_model(cfg, seed=3).pipeline_parts(), num_stages=P,
                                     stages=schedule.stages_of(groups.pp_rank))
        for stage in stages.values():
            parallelize_stage(stage, groups.mesh["tp"], sequence_parallel=sequence_parallel)
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss,
                              stash=ActivationStash(), trace=True)
        ex.step(data[:, :-1], data[:, 1:])  # warm-up: shape handshake, BPipe sizes
        result = ex.step(data[:, :-1], data[:, 1:])
        mine.append({"layout": name, "pp": groups.pp_rank, "tp": groups.tp_rank, "evicted": result.evicted_bytes,
                     "send_f": _sent(result, "SEND_F"), "send_b": _sent(result, "SEND_B"),
                     "evict": _sent(result, "EVICT")})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return [_BYTES + json.dumps([r for rs in everyone for r in rs])] if rank == 0 else []


def sequence_bytes(lines: list[str]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """:func:`measure_sequence_bytes`'s records by (layout, pp, tp); {} when none arrived."""
    data = [json.loads(f[len(_BYTES):]) for f in lines if f.startswith(_BYTES)]
    return {(r["layout"], r["pp"], r["tp"]): r for r in data[0]} if data else {}


def balance_reports(lines: list[str]) -> list[dict[str, Any]]:
    """Every rank's measurement from the world's output, sorted by (tp, pp); [] when none arrived."""
    data = [json.loads(f[len(_DATA):]) for f in lines if f.startswith(_DATA)]
    return sorted(data[0], key=lambda d: (d["tp"], d["pp"])) if data else []


def is_data(line: str) -> bool:
    return line.startswith((_DATA, _BYTES))


__all__ = ["P", "TP", "SP_LAYOUTS", "measure_balance", "balance_reports", "is_data", "measure_sequence_bytes",
           "sequence_bytes"]
