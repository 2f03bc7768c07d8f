"""The ack ledger: a directive runs at most once and every re-send gets its ack."""

from __future__ import annotations

import asyncio

import pytest

from timeslice_agent.ledger import AckLedger
from timeslice_proto.timeslice.v1 import DirectiveAck


def ack(directive_id: str) -> DirectiveAck:
    return DirectiveAck(directive_id=directive_id)


def test_the_oldest_acks_are_forgotten_past_the_limit() -> None:
    ledger = AckLedger(limit=3)
    ledger.load([ack("a"), ack("b"), ack("c")])
    assert ledger.answered("a") is not None  # a hit: now the most recent
    ledger.remember(ack("d"))
    assert ledger.answered("b") is None
    assert [a.directive_id for a in ledger.acks()] == ["c", "a", "d"]


async def test_a_resend_while_running_waits_for_the_first_copys_ack() -> None:
    ledger = AckLedger()
    ledger.start("d1")
    waiting = ledger.running("d1")
    assert waiting is not None and not waiting.done()
    first = ack("d1")
    ledger.remember(first)
    assert not waiting.done()  # remembered but not durable yet: re-sends still wait
    ledger.release(first)
    assert await asyncio.wait_for(waiting, 1) is first
    assert ledger.running("d1") is None
    assert ledger.answered("d1") is first


async def test_abandon_cancels_the_waiting_resends() -> None:
    ledger = AckLedger()
    ledger.start("d2")
    waiting = ledger.running("d2")
    assert waiting is not None
    ledger.abandon("d2")
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ledger.running("d2") is None
    ledger.release(ack("d2"))  # nothing waits any more: no error


def test_acks_survive_a_restart_through_load() -> None:
    before = AckLedger()
    for name in ("x", "y"):
        before.remember(ack(name))
    after = AckLedger()
    after.load(before.acks())
    assert after.answered("x") == ack("x") and after.answered("y") == ack("y")
