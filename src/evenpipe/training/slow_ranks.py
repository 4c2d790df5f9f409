"""The training loop's slow-rank watch: emulated slowdowns in, per-rank compute out, a slow rank named and a
re-planned layout written (issue 35 points 5 and 6).

Before each step it tells the executor what this rank emulates (``--emulate-slow-rank``, ``--emulate-link-delay``:
:mod:`evenpipe.runtime.emulation`). After each step every rank's compute seconds (the executor's
``StepResult.compute_s``) reach rank 0 in one all-gather of one float per process; rank 0 takes the slowest replica
of each pipeline rank and feeds :class:`evenpipe.plan.slow_rank.SlowRankDetector`. When a rank is named, rank 0 logs
one line and writes ``replan.json`` next to ``--json-out``: the ``--layout`` that equalises the ranks' predicted
compute (:func:`evenpipe.plan.slow_rank.replan_layout`), to resume the job from its last checkpoint with.

A step's work is its tokens (global batch x sequence length): fixed shapes and a dense mask make every step the
same work today, so the warm-up reference needs no correction; a varying-length batch would pass its real work.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from evenpipe.plan.slow_rank import DetectorConfig, SlowRankAlarm, SlowRankDetector, replan_layout
from evenpipe.runtime.comm import collective

__all__ = ["SlowRankWatch"]

log = logging.getLogger("evenpipe.train")


class SlowRankWatch:
    """One rank's part of the watch (the detector runs on global rank 0)."""

    def __init__(self, *, config: Any, schedule: Any, pp_rank: int, device: torch.device) -> None:
        self.config, self.schedule, self.pp_rank, self.device = config, schedule, pp_rank, device
        self.emulation = config.runtime.emulation()
        self.num_ranks = schedule.num_ranks
        self.layout = _layout(config, schedule)
        self.detector: SlowRankDetector | None = None
        self.steps_compute_s: list[list[float]] = []
        self.replan: dict[str, Any] | None = None
        if dist.get_rank() == 0 and self.num_ranks > 1:
            rt = config.runtime
            self.detector = SlowRankDetector(
                num_ranks=self.num_ranks,
                config=DetectorConfig(threshold=rt.slow_rank_threshold, patience=rt.slow_rank_steps),
                predicted_s=_predicted(config, schedule, self.layout), predicted_work=self._work())

    def before_step(self, executor: Any, step: int) -> None:
        """Set what this rank emulates in 0-based step ``step``."""
        executor.emulation = self.emulation.for_step(self.pp_rank, step)

    def after_step(self, compute_s: float) -> None:
        """Gather this step's compute seconds on rank 0 and let the detector judge them."""
        if self.num_ranks < 2:
            return
        world = dist.get_world_size()
        mine = torch.tensor([float(self.pp_rank), compute_s], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(world)]
        with collective("the step-time all-gather"):
            dist.all_gather(every, mine)
        if self.detector is None:
            return
        per_rank = [0.0] * self.num_ranks
        for t in every:
            k, c = int(t[0].item()), float(t[1].item())
            per_rank[k] = max(per_rank[k], c)
        self.steps_compute_s.append(per_rank)
        alarm = self.detector.observe(per_rank, work=self._work())
        if alarm is not None:
            self._named(alarm)

    def _work(self) -> float:
        return float(self.config.data.global_batch * self.config.seq_len)

    def _named(self, alarm: SlowRankAlarm) -> None:
        rank_of_stage = [self.schedule.rank_of(s) for s in range(self.schedule.num_stages)]
        layout = replan_layout(self.layout, rank_of_stage, alarm.rank_compute_s)
        arg = ",".join(str(n) for n in layout)
        self.replan = {**alarm.to_dict(), "layout": list(layout), "previous_layout": list(self.layout),
                       "layout_arg": arg}
        where = ""
        out = self.config.output.json_out
        if out:
            path = os.path.join(os.path.dirname(out), "replan.json")
            with open(path, "w") as f:
                json.dump(self.replan, f, indent=2)
            self.replan["path"] = path
            where = f" (written to {path})"
        log.warning(f"{alarm.message()}; re-planned layout --layout {arg} (was "
                    f"{','.join(str(n) for n in self.layout)}){where}: resume from the last checkpoint with it")

    def report(self) -> dict[str, Any] | None:
        """The ``slow_ranks`` section of the JSON summary (rank 0; None elsewhere or with one pipeline rank)."""
        if self.detector is None:
            return None
        cfg = self.detector.config
        return {"threshold": cfg.threshold, "patience": cfg.patience,
                "against": "predicted" if self.detector.predicted_s is not None else "its first steps",
                "predicted_compute_s": list(self.detector.predicted_s or []),
                "calibration": self.detector.calibration, "longest_streak": list(self.detector.longest_streak),
                "rank_compute_s": self.steps_compute_s, "alarms": [a.to_dict() for a in self.detector.alarms],
                "replan": self.replan}


def _layout(config: Any, schedule: Any) -> tuple[int, ...]:
    from evenpipe.runtime.stages import stage_block_counts
    return stage_block_counts(config.model.resolve(), schedule.num_stages, config.schedule.layout)


def _predicted(config: Any, schedule: Any, layout: tuple[int, ...]) -> tuple[float, ...] | None:
    """With ``--predict``: each rank's simulated compute seconds of one step (the detector's reference)."""
    if not config.output.predict:
        return None
    from evenpipe.plan.predict import predicted_compute_s
    mbs = config.data.global_batch // (config.schedule.num_microbatches * config.runtime.dp)
    return predicted_compute_s(config.output.predict, model_name=config.model.name,
                               model_config=config.model.resolve(), schedule=schedule, microbatch_size=mbs,
                               layout=layout, dtype=config.model.dtype.value)
