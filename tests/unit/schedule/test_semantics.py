"""The action-kind table: every consumer handles or refuses every kind; nobody else switches on kind tokens."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from evenpipe.schedule.ir import ActionKind
from evenpipe.schedule.semantics import COVERAGE, SEMANTICS, TABLES, MemoryEffect, Role

CONSUMERS = {
    "validator": "evenpipe.schedule.validate",
    "witness": "evenpipe.schedule.witness",
    "communication": "evenpipe.schedule.comm",
    "simulator": "evenpipe.sim.engine",
    "memory walk": "evenpipe.cost.memory",
}
SRC = pathlib.Path(__file__).resolve().parents[3] / "src" / "evenpipe"


def test_every_kind_has_one_record() -> None:
    assert set(SEMANTICS) == set(ActionKind)
    assert all(rec.kind is k for k, rec in SEMANTICS.items())
    assert TABLES.kinds == tuple(ActionKind)


def test_peer_kinds_pair_up_and_messages_balance_units() -> None:
    for k, rec in SEMANTICS.items():
        if rec.peer_kind is None:
            assert rec.role is Role.COMPUTE
            continue
        peer = SEMANTICS[rec.peer_kind]
        assert peer.peer_kind is k and peer.sends != rec.sends and peer.channel == rec.channel
        assert peer.host_side == rec.host_side
        if rec.sends and not rec.host_side:  # a memory move frees on one side what it takes on the other
            assert rec.units + peer.units == 0
    # F adds a unit, and a full backward (or I + W) gives it back
    u = {k: SEMANTICS[k].units for k in ActionKind}
    assert u[ActionKind.FORWARD] + u[ActionKind.BACKWARD] == 0
    assert u[ActionKind.FORWARD] + u[ActionKind.BACKWARD_INPUT] + u[ActionKind.BACKWARD_WEIGHT] == 0
    assert SEMANTICS[ActionKind.EVICT].memory is SEMANTICS[ActionKind.OFFLOAD].memory is MemoryEffect.SEND_AWAY


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_consumer_handles_or_refuses_every_kind(consumer: str) -> None:
    importlib.import_module(CONSUMERS[consumer])
    handled, refused = COVERAGE[consumer]
    assert handled | refused == set(ActionKind) and not handled & refused


def test_executor_handles_or_refuses_every_kind() -> None:
    pytest.importorskip("torch")
    from evenpipe.runtime.executor import _dispatch
    table = _dispatch()
    handled, refused = COVERAGE["executor"]
    assert handled | refused == set(ActionKind) and not handled & refused
    assert all(table[k.code] is not None for k in handled)
    assert {ActionKind.OFFLOAD, ActionKind.RELOAD} <= handled  # host moves run for real


def test_no_file_outside_the_table_switches_on_a_kind_token() -> None:
    """Kind tokens (``"F"``, ``"SEND_F"``, ...) are compared only in ir.py (parsing) and semantics.py."""
    tokens = "|".join(re.escape(k.value) for k in ActionKind)
    switch = re.compile(rf"""kind\._value_|kind\.(value|token)\s*(==|!=|in\b)|(==|!=)\s*["']({tokens})["']"""
                        rf"""|[{{,]\s*["']({tokens})["']\s*:""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name in ("ir.py", "semantics.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if switch.search(code):
                offenders.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
