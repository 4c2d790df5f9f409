"""BPipe with tensor parallelism (issue 13): at tp 2 x pp 4 (8 processes) each tensor-parallel rank evicts its own
shard of activations to its partner with the same tensor-parallel coordinate, and memory balances as without
tensor parallelism.

Every rank runs the same tiny GPT (one block per stage, heads split two ways) with 1F1B and then BPipe (one
warm-up step, then the measured step); "peak" is the executor's measured peak of own plus hosted activation bytes
(the stash counts DTensor activations by their local shards). Checked:

- every tensor-parallel rank of the evictors really evicted, and no stash is left after a step;
- balance: every rank's BPipe peak is within 15% of the mean over all ranks;
- on every tensor-parallel rank, pipeline rank 0's BPipe peak <= (ceil((p+1)/2)/p + 0.1) x its 1F1B peak.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from harness import run_world

pytestmark = pytest.mark.distributed

P, TP = 4, 2
M = 2 * P
SEQ = 16
MICROBATCH = 2
BALANCE_TOLERANCE = 0.15
RANK0_SLACK = 0.10
_DATA = "DATA:"


def _measure(rank: int, world: int) -> list[str]:
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


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    results = run_world(P * TP, _measure, timeout_s=300.0, pg_timeout_s=60.0)
    lines = [f for r in sorted(results) for f in results[r]]
    failures = [f for f in lines if not f.startswith(_DATA)]
    data = [json.loads(f[len(_DATA):]) for f in lines if f.startswith(_DATA)]
    if failures or not data:
        pytest.fail("the tp2 x pp4 runs failed:\n" + "\n".join(failures or ["no report"]))
    return sorted(data[0], key=lambda d: (d["tp"], d["pp"]))


def _table(reports: list[dict[str, Any]]) -> str:
    return "\n".join(f"  pp {r['pp']} tp {r['tp']}: 1f1b peak {r['1f1b']['peak']:8d}  bpipe peak "
                     f"{r['bpipe']['peak']:8d} (hosted {r['bpipe']['hosted']}, evicted {r['bpipe']['evicted']})"
                     for r in reports)


def test_every_tp_rank_evicts_its_own_shard(reports: list[dict[str, Any]]) -> None:
    left = [(r["pp"], r["tp"]) for r in reports if not (r["1f1b"]["empty"] and r["bpipe"]["empty"])]
    assert not left, f"stash not empty after a step on (pp, tp) {left}\n{_table(reports)}"
    idle = [(r["pp"], r["tp"]) for r in reports if r["pp"] < P // 2 and r["bpipe"]["evicted"] <= 0]
    assert not idle, f"evictors that moved nothing: {idle}\n{_table(reports)}"


def test_bpipe_balances_ranks_with_tp(reports: list[dict[str, Any]]) -> None:
    print("\n" + _table(reports))  # shown with pytest -s
    peaks = [r["bpipe"]["peak"] for r in reports]
    mean = sum(peaks) / len(peaks)
    bad = [f"pp {r['pp']} tp {r['tp']}: {p} B is {p / mean - 1:+.1%} from the mean {mean:.0f} B"
           for r, p in zip(reports, peaks) if abs(p - mean) > BALANCE_TOLERANCE * mean]
    assert not bad, "BPipe peaks more than 15% from the mean:\n" + "\n".join(bad) + "\n" + _table(reports)
    plain = [r["1f1b"]["peak"] for r in reports]  # control: the same measure shows 1F1B's imbalance
    assert max(plain) > (1 + BALANCE_TOLERANCE) * sum(plain) / len(plain), f"1F1B looks balanced\n{_table(reports)}"


def test_rank0_peak_shrinks_on_every_tp_rank(reports: list[dict[str, Any]]) -> None:
    bound = math.ceil((P + 1) / 2) / P + RANK0_SLACK
    bad = [f"tp {r['tp']}: rank 0 BPipe peak {r['bpipe']['peak']} B > {bound:.3f} x 1F1B peak {r['1f1b']['peak']} B"
           for r in reports if r["pp"] == 0 and r["bpipe"]["peak"] > bound * r["1f1b"]["peak"]]
    assert not bad, "\n".join(bad) + "\n" + _table(reports)
