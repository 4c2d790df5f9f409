"""Emulated slow ranks and links (issue 35 point 6): the option forms, and the handler hooks on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from evenpipe.errors import ConfigError
from evenpipe.runtime import step_compute, step_messages
from evenpipe.runtime.emulation import (Emulation, LinkDelay, RankEmulation, SlowRank, parse_link_delay,
                                        parse_slow_rank)
from evenpipe.schedule.ir import Action, ActionKind


def test_option_forms() -> None:
    assert parse_slow_rank("2:1.5@10") == SlowRank(rank=2, factor=1.5, from_step=10)
    assert parse_slow_rank("0:3") == SlowRank(rank=0, factor=3.0, from_step=0)
    assert parse_link_delay("1-2:5") == LinkDelay(a=1, b=2, delay_s=0.005)
    assert parse_slow_rank(None) is None and parse_link_delay(None) is None
    for bad in ("2", "2:0.5", "x:2", "2:nan", "2:2@-1", "-1:2"):
        with pytest.raises(ConfigError, match="RANK:FACTOR"):
            parse_slow_rank(bad)
    for bad in ("1-1:5", "1-2:-3", "1:5", "1-2:inf"):
        with pytest.raises(ConfigError, match="A-B:MS"):
            parse_link_delay(bad)
    with pytest.raises(ConfigError, match="rank 4; the pipeline has ranks 0..3"):
        Emulation(slow=SlowRank(rank=4, factor=2.0)).check(4)
    with pytest.raises(ConfigError, match="link 3-7"):
        Emulation(links=(LinkDelay(a=3, b=7, delay_s=0.0),)).check(4)


def test_what_each_rank_emulates_per_step() -> None:
    emu = Emulation(slow=SlowRank(rank=1, factor=2.0, from_step=3), links=(LinkDelay(a=1, b=2, delay_s=0.004),))
    assert emu.for_step(0, 5) is None
    assert emu.for_step(1, 2) == RankEmulation(1.0, {2: 0.004})
    assert emu.for_step(1, 3) == RankEmulation(2.0, {2: 0.004})
    assert emu.for_step(2, 0) == RankEmulation(1.0, {1: 0.004})
    assert Emulation().for_step(0, 0) is None


class _Clock:
    """perf_counter and sleep on a fake clock; sleep records its argument."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _ctx(emulation: RankEmulation | None) -> Any:
    return SimpleNamespace(emulation=emulation, mail=SimpleNamespace(waited_s=0.0), device=torch.device("cpu"))


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_a_slow_rank_sleeps_factor_minus_one_times_the_compute_without_its_wait(monkeypatch: pytest.MonkeyPatch,
                                                                                 factor: float) -> None:
    clock = _Clock()
    monkeypatch.setattr(step_compute, "time", clock)
    ctx = _ctx(RankEmulation(factor, {}))

    def run(a: Action, c: Any) -> None:  # waits 0.03 s for its input, then computes 0.07 s
        clock.now += 0.1
        c.mail.waited_s += 0.03
    step_compute._emulated(run)(Action(ActionKind.FORWARD, 0, 0), ctx)
    assert clock.slept == [pytest.approx(0.07 * (factor - 1))]


def test_without_emulation_the_compute_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(step_compute, "time", SimpleNamespace(perf_counter=None, sleep=None))  # any use fails
    ran = []
    for emulation in (None, RankEmulation(1.0, {3: 0.01})):
        step_compute._emulated(lambda a, c: ran.append(a))(Action(ActionKind.BACKWARD, 0, 1), _ctx(emulation))
    assert len(ran) == 2 and clock.slept == []


def test_a_slow_link_stamps_its_messages_and_the_sender_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send to the slow link's peer goes out at once with a second part, the time it may be read (monotonic
    clock plus the delay); a send to another peer is one part; nobody sleeps."""
    clock = _Clock()
    clock.now = 100.0
    monkeypatch.setattr(step_messages, "time", clock)
    ctx = SimpleNamespace(emulation=RankEmulation(1.0, {2: 0.005}), groups=SimpleNamespace(
        global_rank=lambda r: r, pp_group=None), tag=lambda a, part=0, num_parts=1: (part, num_parts))
    x = torch.zeros(2)
    slow = step_messages._send(Action(ActionKind.SEND_F, 1, 0, peer=2), ctx, x, None)
    fast = step_messages._send(Action(ActionKind.SEND_B, 1, 0, peer=0), ctx, x, None)
    assert [t.tag for t, _ in slow] == [(0, 2), (1, 2)] and slow[0][0].tensor is x
    assert slow[1][0].tensor.item() == pytest.approx(100.005)
    assert [t.tag for t, _ in fast] == [(0, 1)]
    assert clock.slept == []


def test_the_consumer_waits_until_the_stamped_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mailbox.take reads a stamped message only once its time has come, and counts that wait."""
    from evenpipe.runtime import mailbox as mailbox_module
    clock = _Clock()
    clock.now = 50.0
    monkeypatch.setattr(mailbox_module, "time", clock)
    box = mailbox_module.Mailbox(timeout_s=1.0, recorder=None)
    waited = []
    batch = SimpleNamespace(wait_for=lambda buf: waited.append(buf))
    buf, due = torch.zeros(3), torch.tensor([50.004], dtype=torch.float64)
    box.expect(ActionKind.RECV_F, 1, 0, batch, buf, due=due)  # type: ignore[arg-type]
    late = torch.tensor([49.0], dtype=torch.float64)
    box.expect(ActionKind.RECV_F, 1, 1, batch, buf, due=late)  # type: ignore[arg-type]
    assert box.take(ActionKind.RECV_F, 1, 0) is buf
    assert box.take(ActionKind.RECV_F, 1, 1) is buf
    assert waited == [buf, due, buf, late]
    assert clock.slept == [pytest.approx(0.004), 0.0]
    assert box.waited_s == pytest.approx(0.004)
