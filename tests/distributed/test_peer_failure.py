"""A step that raises on one rank makes its peers fail with a clear message instead of waiting forever."""

from __future__ import annotations

import pytest
import torch

from harness import run_world

pytestmark = pytest.mark.distributed

PEER_TIMEOUT_S = 5.0


class _Boom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in stage 1")


def _rank_fn(rank: int, world: int) -> list[str]:
    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import PeerFailure, build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.schedule import build_schedule

    groups = build_groups(2, 1, timeout_s=PEER_TIMEOUT_S)
    assert groups is not None
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    cfg = model_config("gpt-tiny", num_layers=2, hidden=32, num_heads=2, seq_len=16)
    model = build_model(cfg, seed=0)
    stages = build_stage_modules(model.pipeline_parts(), num_stages=2, stages=schedule.stages_of(rank))
    ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss)
    tokens = torch.randint(0, cfg.vocab, (8, 17))
    ex.step(tokens[:, :-1], tokens[:, 1:])  # healthy step: shapes learned, both ranks in step
    if rank == 1:
        stages[1].blocks.append(_Boom())
    try:
        ex.step(tokens[:, :-1], tokens[:, 1:])
    except PeerFailure as e:
        if rank == 0 and "rank 1" in str(e) and "RECV_B" in str(e):
            return []
        return [f"rank {rank}: unclear PeerFailure: {e}"]
    except RuntimeError as e:
        return [] if rank == 1 and "injected" in str(e) else [f"rank {rank}: unexpected {type(e).__name__}: {e}"]
    return [f"rank {rank}: the step finished although rank 1 raised"]


def test_raising_step_makes_peer_fail_not_hang() -> None:
    results = run_world(2, _rank_fn, timeout_s=90, pg_timeout_s=PEER_TIMEOUT_S)
    failures = [f for fs in results.values() for f in fs]
    assert not failures, "\n".join(failures)
