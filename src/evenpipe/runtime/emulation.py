"""Emulated slow ranks and slow links, for tests and benchmarks on one machine (``train --emulate-slow-rank``,
``--emulate-link-delay``).

A *slow rank* runs every compute action (``F``, ``R``, ``B``, ``I``, ``W``) at ``factor`` times its own duration,
from a given training step on: the compute handler measures the action's own seconds (its wait for a received
input excluded; on CUDA after a device synchronize) and then **sleeps** ``(factor - 1)`` times that. Sleeping, not
busy-waiting: a slow GPU leaves its host's cores to the other processes, and on a host with fewer cores than ranks a
busy-wait would steal the peers' core and slow them too, so the slowdown would no longer belong to one rank.

A *slow link* between pipeline ranks A and B delays every pipeline message A sends to B and B sends to A by a fixed
number of milliseconds, as a link's latency does: the sender posts at once and goes on to its next action, and
the message may be read only that long after it was sent. The sender stamps each message with that time (this
host's monotonic clock plus the delay, a second tagged part of the message) and the consuming compute on the
other side waits until then (``Mailbox.take``), so the delay overlaps whatever both ranks do meanwhile, which is
what a latency-aware schedule is built to use. (Until 2026-12-05 the sender slept for the delay before posting,
so an emulated link cost the sender's time like a slow rendezvous; clocks of one host only.)

Ranks are pipeline ranks; every replica (and tensor-parallel rank) of a pipeline rank is slowed alike. Nothing
here runs unless one of the options is given: the handlers test one attribute for None.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from evenpipe.errors import ConfigError

__all__ = ["SlowRank", "LinkDelay", "Emulation", "RankEmulation", "parse_slow_rank", "parse_link_delay"]

_SLOW = re.compile(r"^\s*(\d+)\s*:\s*([0-9.eE+-]+)\s*(?:@\s*(\d+))?\s*$")
_LINK = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*:\s*([0-9.eE+-]+)\s*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowRank:
    """One pipeline rank's computes take ``factor`` times as long from training step ``from_step`` (0-based)."""

    rank: int
    factor: float
    """How many times its own duration each compute takes (> 1)."""
    from_step: int = 0
    """First 0-based training step that runs slowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkDelay:
    """Messages between pipeline ranks ``a`` and ``b`` (both ways) wait ``delay_s`` before they are posted."""

    a: int
    b: int
    delay_s: float


@dataclass(frozen=True, slots=True)
class RankEmulation:
    """What one rank emulates during one step: its compute factor and the delay of its sends, by peer."""

    compute_factor: float = 1.0
    send_delay_s: dict[int, float] = field(default_factory=dict)
    """Seconds to wait before posting a message to pipeline rank ``peer``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """Every emulated slowdown of a job."""

    slow: SlowRank | None = None
    links: tuple[LinkDelay, ...] = ()

    def check(self, num_ranks: int) -> None:
        """Refuse ranks outside the pipeline's ``0..num_ranks-1`` (ConfigError, one line)."""
        if self.slow is not None and not 0 <= self.slow.rank < num_ranks:
            raise ConfigError(f"--emulate-slow-rank names rank {self.slow.rank}; the pipeline has ranks "
                              f"0..{num_ranks - 1}")
        for link in self.links:
            if not (0 <= link.a < num_ranks and 0 <= link.b < num_ranks):
                raise ConfigError(f"--emulate-link-delay names link {link.a}-{link.b}; the pipeline has ranks "
                                  f"0..{num_ranks - 1}")

    def for_step(self, pp_rank: int, step: int) -> RankEmulation | None:
        """What ``pp_rank`` emulates in 0-based training step ``step`` (None: nothing)."""
        factor = 1.0
        if self.slow is not None and self.slow.rank == pp_rank and step >= self.slow.from_step:
            factor = self.slow.factor
        delays = {}
        for link in self.links:
            if pp_rank in (link.a, link.b):
                delays[link.b if pp_rank == link.a else link.a] = link.delay_s
        if factor == 1.0 and not delays:
            return None
        return RankEmulation(factor, delays)


def parse_slow_rank(text: str | None) -> SlowRank | None:
    """``RANK:FACTOR[@STEP]``, e.g. ``2:1.5@10`` (rank 2 is 1.5x slower from step 10); None for None."""
    if text is None:
        return None
    m = _SLOW.match(text)
    factor = _number(m.group(2)) if m else math.nan
    if m is None or not (math.isfinite(factor) and factor >= 1.0):
        raise ConfigError(f"--emulate-slow-rank {text!r} must be RANK:FACTOR[@STEP] with FACTOR >= 1, e.g. 2:1.5@10")
    return SlowRank(rank=int(m.group(1)), factor=factor, from_step=int(m.group(3) or 0))


def parse_link_delay(text: str | None) -> LinkDelay | None:
    """``A-B:MS``, e.g. ``1-2:5`` (messages between ranks 1 and 2 wait 5 ms); None for None."""
    if text is None:
        return None
    m = _LINK.match(text)
    ms = _number(m.group(3)) if m else math.nan
    if m is None or not (math.isfinite(ms) and ms >= 0) or m.group(1) == m.group(2):
        raise ConfigError(f"--emulate-link-delay {text!r} must be A-B:MS for two different pipeline ranks and "
                          "MS >= 0, e.g. 1-2:5")
    return LinkDelay(a=int(m.group(1)), b=int(m.group(2)), delay_s=ms / 1e3)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan
