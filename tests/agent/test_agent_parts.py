"""The agent's small parts on their own: the ack ledger, keyed locks, run-to-completion."""

from __future__ import annotations

import asyncio

import pytest

from timeslice_agent.ledger import AckLedger
from timeslice_agent.tasks import KeyedLocks, LockWaitExpired, run_to_completion
from timeslice_proto.timeslice.v1 import AckStatus, DirectiveAck


def ack(did: str, status: AckStatus = AckStatus.OK) -> DirectiveAck:
    return DirectiveAck(directive_id=did, status=status)


async def test_ledger_answers_resends_and_forgets_the_oldest() -> None:
    ledger = AckLedger(limit=2)
    ledger.load([ack("a"), ack("b")])
    assert ledger.answered("a") == ack("a")  # a hit makes "a" recent: "b" goes first
    ledger.remember(ack("c"))
    assert ledger.answered("b") is None
    assert [a.directive_id for a in ledger.acks()] == ["a", "c"]


async def test_ledger_resends_wait_until_release() -> None:
    ledger = AckLedger()
    ledger.start("d")
    waiting = ledger.running("d")
    assert waiting is not None
    ledger.remember(ack("d", AckStatus.FAILED))
    assert not waiting.done()  # remembered, not durable yet
    ledger.release(ack("d", AckStatus.FAILED))
    assert (await waiting).status == AckStatus.FAILED
    assert ledger.running("d") is None


async def test_keyed_locks_serialise_per_key_and_are_dropped_when_unused() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def use(key: str, name: str, hold: float) -> None:
        async with locks.holding(key, None):
            order.append(f"{name}+")
            await asyncio.sleep(hold)
            order.append(f"{name}-")

    await asyncio.gather(use("k", "a", 0.05), use("k", "b", 0.0), use("other", "c", 0.0))
    assert order.index("a-") < order.index("b+")  # same key: one at a time, in order
    assert order.index("c+") < order.index("a-")  # another key does not wait
    assert not locks.busy("k") and not locks.busy("other")


async def test_keyed_lock_wait_expires_at_its_deadline() -> None:
    locks = KeyedLocks()
    loop = asyncio.get_running_loop()
    async with locks.holding("k", None):
        with pytest.raises(LockWaitExpired):
            async with locks.holding("k", loop.time() + 0.05):
                raise AssertionError("must not get the lock")
        assert locks.busy("k")
    assert not locks.busy("k")


async def test_run_to_completion_finishes_the_work_before_the_cancellation() -> None:
    finished = asyncio.Event()

    async def work() -> None:
        await asyncio.sleep(0.2)
        finished.set()

    task = asyncio.ensure_future(run_to_completion(work()))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
    assert await run_to_completion(asyncio.sleep(0, result=7)) == 7
