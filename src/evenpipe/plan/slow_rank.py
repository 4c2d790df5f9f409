"""Noticing a slow rank while training, and the layer layout that re-balances around it (pure, no torch).

Each step the training loop hands :meth:`SlowRankDetector.observe` every pipeline rank's measured compute seconds
and the step's *work* (tokens). Each rank's seconds are divided by what its work should cost: with ``train
--predict PROFILE`` the simulator's predicted compute seconds of the step for that rank (see
:func:`evenpipe.plan.predict.predicted_compute_s`; a step of other work scales it), else the work itself -- so a long
micro-batch is not taken for a slow rank. That value is divided by the rank's own median over the ``warmup`` steps
after the first (the first also learns shapes): this calibration takes out each rank's steady error of the model
(on this 2-core host the last rank's measured compute was 1.4-1.5x its prediction relative to the others, from its
head and the host, not from a slow device), and :attr:`SlowRankDetector.calibration` keeps it for the report. The
ratio is then divided by the median ratio of the *other* ranks: a load that slows the whole host (this host jitters
10-15% step to step, far more under other jobs) moves every rank alike and cancels, and what remains is how much
slower the rank is than its peers. A rank whose factor is at least ``threshold`` for ``patience`` consecutive steps
is named once (:class:`SlowRankAlarm`). Thresholds: 1.3x for 4 steps by default -- a factor of two ranks'
independent ±15% noise reaches 1.3 only at both extremes; under other jobs' load (load 12 on 2 cores, gpt-tiny at
P=4) single steps read 0.3-4x, and in 100 steps one rank stayed above 1.3 for 3 steps in a row but none for 4
(``benchmarks/bench_uneven.py`` counts false alarms). Four steps still name a rank within the 5 steps asked.
At P=2 the peers' median is the one other rank: a host slowdown still cancels, but another job's process sharing
one rank's core makes that rank slow, for as long as it runs -- at load 4 (gpt-mini, 64 tokens, P=2, 2 cores) one
rank read 1.3-1.7x for 4 steps once in 200, a false alarm; :attr:`SlowRankDetector.longest_streak` gives a run's
margin to ``patience``.

A rank that is slow from the first step is its own reference and is not named; with a profile its calibration
shows it (the report's ``calibration``).

:func:`replan_layout` gives each rank a number of blocks so that every rank's predicted compute is equal: a rank's
seconds per block is its measured compute over the blocks it holds now (so its measured slowdown, and the fixed
cost of an embedding or head it carries, are folded in), and blocks go one at a time to the rank whose compute
grows least (which minimises the largest rank's compute), each stage keeping at least one block.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from evenpipe.cost.parallel import layers_per_rank
from evenpipe.errors import ConfigError

__all__ = ["DetectorConfig", "SlowRankAlarm", "SlowRankDetector", "replan_layout", "rank_blocks", "balanced_blocks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectorConfig:
    """When a rank counts as slow."""

    threshold: float = 1.3
    """A rank is slow in a step when its compute, relative to its reference, is this many times its peers'."""
    patience: int = 4
    """Consecutive slow steps before the rank is named."""
    warmup: int = 5
    """Steps after the first whose median is a rank's reference when there is no prediction."""

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ConfigError(f"--slow-rank-threshold must be > 1, got {self.threshold!r}")
        if self.patience < 1 or self.warmup < 1:
            raise ConfigError(f"--slow-rank-steps (and the warm-up) must be >= 1, got {self.patience}, "
                              f"{self.warmup}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowRankAlarm:
    """A rank named as slow."""

    rank: int
    factor: float
    """Median over the slow steps of its compute relative to its reference, over its peers'."""
    step: int
    """Steps done (1-based step number) when it was named."""
    first_slow_step: int
    """1-based number of the first of the consecutive slow steps."""
    steps: int
    """Consecutive slow steps."""
    rank_compute_s: tuple[float, ...]
    """Every rank's median compute seconds over those steps (what :func:`replan_layout` balances)."""
    against: str
    """``"predicted"`` (a profile's prediction) or ``"its first steps"`` (the warm-up reference)."""

    def message(self) -> str:
        """The one line that names it."""
        return (f"rank {self.rank} is {self.factor:.2f}x slower than {self.against} for {self.steps} steps "
                f"(relative to the other ranks)")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "factor": self.factor, "step": self.step, "first_slow_step": self.first_slow_step,
                "steps": self.steps, "rank_compute_s": list(self.rank_compute_s), "against": self.against}


@dataclass(slots=True)
class SlowRankDetector:
    """Per-step comparison of each rank's compute with its reference (see the module docstring)."""

    num_ranks: int
    config: DetectorConfig = field(default_factory=DetectorConfig)
    predicted_s: Sequence[float] | None = None
    """Per rank, the predicted compute seconds of one step of ``predicted_work`` (None: the work alone)."""
    predicted_work: float = 1.0
    alarms: list[SlowRankAlarm] = field(default_factory=list)
    longest_streak: list[int] = field(default_factory=list)
    """Per rank, its most consecutive slow steps so far (against ``patience``: the margin of a run with no alarm)."""
    _warm: list[list[float]] = field(default_factory=list)
    _reference: list[float] | None = None
    _streak: list[list[tuple[float, Sequence[float]]]] = field(default_factory=list)
    _steps: int = 0

    def __post_init__(self) -> None:
        if self.predicted_s is not None and (len(self.predicted_s) != self.num_ranks
                                             or not all(p > 0 for p in self.predicted_s)):
            raise ConfigError(f"predicted compute seconds must be {self.num_ranks} values > 0, "
                              f"got {list(self.predicted_s)}")
        self._streak = [[] for _ in range(self.num_ranks)]
        self.longest_streak = [0] * self.num_ranks

    @property
    def calibration(self) -> list[float] | None:
        """Per rank, its warm-up median of measured over predicted compute (seconds per token without a
        prediction); None until the warm-up is over."""
        return self._reference

    def observe(self, compute_s: Sequence[float], work: float = 1.0) -> SlowRankAlarm | None:
        """Take one step's per-rank compute seconds; the alarm when this step names a rank (once per rank)."""
        self._steps += 1
        base = ([p / self.predicted_work for p in self.predicted_s] if self.predicted_s is not None
                else [1.0] * self.num_ranks)
        values = [c / (work * b) for c, b in zip(compute_s, base)]
        if self._reference is None:
            if self._steps > 1:  # the first step learns shapes: not a reference
                self._warm.append(values)
            if len(self._warm) == self.config.warmup:
                self._reference = [max(statistics.median(w[r] for w in self._warm), 1e-12)
                                   for r in range(self.num_ranks)]
            return None
        if self.num_ranks < 2:
            return None
        ratios = [v / ref for v, ref in zip(values, self._reference)]
        named = None
        for r in range(self.num_ranks):
            peers = statistics.median(ratios[:r] + ratios[r + 1:])
            factor = ratios[r] / peers if peers > 0 else 1.0
            if factor < self.config.threshold:
                self._streak[r] = []
                continue
            self._streak[r].append((factor, compute_s))
            self.longest_streak[r] = max(self.longest_streak[r], len(self._streak[r]))
            if len(self._streak[r]) == self.config.patience and not any(a.rank == r for a in self.alarms):
                named = named or self._alarm(r)
        return named

    def _alarm(self, r: int) -> SlowRankAlarm:
        streak = self._streak[r]
        alarm = SlowRankAlarm(rank=r, factor=statistics.median(f for f, _ in streak), step=self._steps,
                              first_slow_step=self._steps - len(streak) + 1, steps=len(streak),
                              rank_compute_s=tuple(statistics.median(c[k] for _, c in streak)
                                                   for k in range(self.num_ranks)),
                              against="predicted" if self.predicted_s is not None else "its first steps")
        self.alarms.append(alarm)
        return alarm


def rank_blocks(layout: Sequence[int], rank_of_stage: Sequence[int], num_ranks: int) -> list[int]:
    """Blocks each rank holds under ``layout`` (blocks per stage)."""
    return layers_per_rank(layout, rank_of_stage, num_ranks)


def replan_layout(layout: Sequence[int], rank_of_stage: Sequence[int], rank_compute_s: Sequence[float]) -> tuple[int, ...]:
    """Blocks per stage that equalise every rank's predicted compute (see the module docstring).

    ``layout``: blocks per stage now; ``rank_of_stage[s]``: the rank running stage ``s``; ``rank_compute_s``: each
    rank's measured compute seconds under ``layout``. A rank's blocks are split over its stages as evenly as
    possible, earlier stages first."""
    num_ranks = len(rank_compute_s)
    held = rank_blocks(layout, rank_of_stage, num_ranks)
    per_block = [rank_compute_s[r] / held[r] if held[r] else 0.0 for r in range(num_ranks)]
    out = balanced_blocks(sum(layout), rank_of_stage, per_block)
    assert out is not None  # no caps
    return out


def balanced_blocks(num_blocks: int, rank_of_stage: Sequence[int], per_block: Sequence[float],
                    fixed: Sequence[float] | None = None, caps: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Blocks per stage minimising the largest rank's ``fixed[r] + blocks·per_block[r]`` seconds: every stage
    keeps one block, then blocks go one at a time to the rank whose time grows least among those below their
    ``caps`` (most blocks a rank may hold; None when the caps cannot hold them all); a rank's blocks are split
    over its stages as evenly as possible, earlier stages first."""
    num_ranks = len(per_block)
    base = list(fixed) if fixed is not None else [0.0] * num_ranks
    room = list(caps) if caps is not None else [num_blocks] * num_ranks
    stages_of = [[s for s in range(len(rank_of_stage)) if rank_of_stage[s] == r] for r in range(num_ranks)]
    counts = [len(stages_of[r]) for r in range(num_ranks)]
    for _ in range(num_blocks - sum(counts)):
        open_ranks = [k for k in range(num_ranks) if counts[k] < room[k]]
        if not open_ranks:
            return None
        r = min(open_ranks, key=lambda k: (base[k] + (counts[k] + 1) * per_block[k], k))
        counts[r] += 1
    out = [0] * len(rank_of_stage)
    for r, stages in enumerate(stages_of):
        q, extra = divmod(counts[r], len(stages)) if stages else (0, 0)
        for i, s in enumerate(stages):
            out[s] = q + (1 if i < extra else 0)
    return tuple(out)
