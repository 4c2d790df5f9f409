"""BPipe frees real memory where the simulator says (issue 4): an evicted unit's exported buffer and a returned
unit's hosted buffer are really gone (no Python reference left) before the rank allocates again.

One gloo world of P=4 processes, BPipe with M=8 on a tiny GPT, two steps (the first learns the unit sizes, the
second posts in place). A stash subclass keeps weak references to the buffers BPipe ships:

- evictors: at the start of every ``F``/``R`` capture (new activations are about to be allocated) no buffer
  ``export`` produced earlier may still be alive;
- acceptors: whenever a partner's buffer is hosted (an ``ACCEPT`` allocated it) no buffer ``unhost`` gave back
  earlier (for a ``RETURN``) may still be alive;
- the measured trace stamps an ``EVICT``'s end no later than the start of the rank's next ``F``/``R``;
- accounting follows allocation: the rank's measured memory (own plus hosted) rises by exactly the unit's bytes
  at the ``LOAD``/``ACCEPT`` that allocates its buffer (where the simulator charges it), not later.

Before the fix, gloo send batches were only waited at the end of the step, so every check here failed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import run_world

pytestmark = pytest.mark.distributed

P, M, SEQ, MICROBATCH = 4, 8, 16, 2


def _watching_stash() -> Any:
    from evenpipe.runtime.stash import ActivationStash

    class WatchingStash(ActivationStash):
        """Weak references to every exported and every given-back buffer; notes the ones still alive."""

        def __init__(self) -> None:
            super().__init__()
            self.exported: list[tuple[tuple[int, int], Any]] = []
            self.returned: list[tuple[tuple[int, int], Any]] = []
            self.problems: list[str] = []
            self.checks = 0
            self.unit_bytes: dict[tuple[int, int], int] = {}
            """Bytes of each shipped unit: exported here, or hosted here."""

        def export(self, key: tuple[int, int]) -> Any:
            meta, flat = super().export(key)
            self.exported.append((key, weakref.ref(flat)))
            self.unit_bytes[key] = flat.numel()
            return meta, flat

        def unhost(self, key: tuple[int, int]) -> Any:
            meta, flat = super().unhost(key)
            self.returned.append((key, weakref.ref(flat)))
            return meta, flat

        def _alive(self, refs: list[tuple[tuple[int, int], Any]], where: str, what: str) -> None:
            self.checks += 1
            alive = [k for k, ref in refs if ref() is not None]
            if alive:
                self.problems.append(f"{where}: {what} buffers of {alive} still referenced")

        @contextlib.contextmanager
        def capture(self, key: tuple[int, int]) -> Iterator[None]:
            self._alive(self.exported, f"F/R capture of {key}", "evicted")
            with super().capture(key):
                yield

        def host(self, key: tuple[int, int], meta: Any, flat: torch.Tensor) -> None:
            self._alive(self.returned, f"accept of {key}", "returned")
            self.unit_bytes[key] = flat.numel()
            super().host(key, meta, flat)

    return WatchingStash()


def _evict_ends_before_next_forward(actions: tuple[Any, ...], records: Any) -> list[str]:
    from evenpipe.schedule.ir import ActionKind

    starts = {i: start for i, _, start, _ in records.actions}
    bad = []
    for rec in records.sends:
        if rec.action.kind is not ActionKind.EVICT:
            continue
        at = actions.index(rec.action)
        nxt = next((i for i in range(at + 1, len(actions))
                    if actions[i].kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE)), None)
        if nxt is not None and not rec.end <= starts[nxt]:
            bad.append(f"{rec.action} ends {rec.end - starts[nxt]:+.4f} s after {actions[nxt]} starts")
    return bad


def _charged_where_allocated(records: Any, unit_bytes: dict[tuple[int, int], int]) -> tuple[list[str], int]:
    """Memory after a LOAD/ACCEPT minus memory after the last compute before it equals the unit's bytes (only
    where nothing else between them changes the stash's count); ``(problems, number checked)``."""
    from evenpipe.schedule.ir import ActionKind

    bad, checked = [], 0
    changes = {ActionKind.EVICT, ActionKind.RETURN, ActionKind.SEND_F, ActionKind.LOAD, ActionKind.ACCEPT}
    last_compute_mem: int | None = None
    between: set[Any] = set()
    for (_, action, _, _), (_, mem) in zip(records.actions, records.memory):
        if not action.kind.is_transfer:
            last_compute_mem, between = mem, set()
            continue
        if action.kind in (ActionKind.LOAD, ActionKind.ACCEPT) and last_compute_mem is not None \
                and not between & changes:
            checked += 1
            want = unit_bytes.get(action.key, -1)
            if mem - last_compute_mem != want:
                bad.append(f"{action}: memory rose by {mem - last_compute_mem} B where its buffer of {want} B "
                           "was allocated")
        between.add(action.kind)
    return bad, checked


def _rank_fn(rank: int, world: int) -> list[str]:
    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.runtime.comm import build_groups
    from evenpipe.runtime.executor import PipelineExecutor
    from evenpipe.runtime.stages import build_stage_modules
    from evenpipe.schedule import build_schedule
    from evenpipe.schedule.ir import ActionKind

    groups = build_groups(P, 1, timeout_s=30.0)
    assert groups is not None
    cfg = model_config("gpt-tiny", num_layers=P, hidden=32, num_heads=2, seq_len=SEQ)
    data = torch.randint(0, cfg.vocab, (MICROBATCH * M, SEQ + 1), generator=torch.Generator().manual_seed(5))
    failures: list[str] = []
    charges_checked = 0
    for recompute in (False, True):
        schedule = build_schedule("bpipe", num_ranks=P, num_microbatches=M, recompute=recompute)
        mine = schedule.actions[rank]
        kinds = {a.kind for a in mine}
        stages = build_stage_modules(build_model(cfg, seed=3).pipeline_parts(), num_stages=P,
                                     stages=schedule.stages_of(rank))
        stash = _watching_stash()
        ex = PipelineExecutor(schedule=schedule, stages=stages, groups=groups, loss_fn=lm_loss, stash=stash,
                              trace=True)
        tag = f"rank {rank}{' recompute' if recompute else ''}"
        for step in range(2):
            result = ex.step(data[:, :-1], data[:, 1:])
            failures += [f"{tag} step {step}: {p}" for p in stash.problems]
            failures += [f"{tag} step {step}: {p}" for p in _evict_ends_before_next_forward(mine, result.records)]
            stash.problems.clear()
            bad, checked = _charged_where_allocated(result.records, stash.unit_bytes)
            failures += [f"{tag} step {step}: {p}" for p in bad]
            charges_checked += checked
            if not stash.is_empty():
                failures.append(f"{tag} step {step}: stash not empty after the step")
        if ActionKind.EVICT in kinds and not stash.exported:
            failures.append(f"{tag}: has EVICT actions but exported nothing")
        if ActionKind.RETURN in kinds and not stash.returned:
            failures.append(f"{tag}: has RETURN actions but gave nothing back")
        if stash.checks == 0:
            failures.append(f"{tag}: no check ran")
    if P - 1 - rank != rank and charges_checked == 0:  # every rank here evicts or accepts
        failures.append(f"rank {rank}: no LOAD/ACCEPT could be checked for its memory charge")
    return failures


def test_bpipe_buffers_are_freed_before_the_next_allocation() -> None:
    results = run_world(P, _rank_fn, timeout_s=120, pg_timeout_s=30)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)
