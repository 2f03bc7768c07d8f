"""A yield that hands the group over answers a waiter on the same replica at once.

In-process LockService over a real etcd and a real mirror. The mirror is stopped after the
waiter queues, so the only way the waiter can learn of its grant is the hand-over itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tests.integration.groupstore import holder
from timeslice import AcquireStage
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.cache import Mirror
from timeslice_orchestrator.store.groups import GroupStore


async def _until(stages: AsyncIterator[Progress], stage: AcquireStage) -> Progress:
    async with asyncio.timeout(10):
        async for progress in stages:
            if progress.stage is stage:
                return progress
    raise AssertionError(f"the acquire ended before {stage}")


async def test_a_hand_over_reaches_a_waiter_here_without_the_watch(store: GroupStore) -> None:
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        locks = LockService(store, mirror, Metrics(), 30)
        a, a_secret, _ = await locks.open_session("a", 30, "host", 1)
        b, b_secret, _ = await locks.open_session("b", 30, "host", 2)
        first = await _until(locks.acquire(a, "a", "g", 0, secret=a_secret), AcquireStage.GRANTED)
        waiting = locks.acquire(b, "b", "g", 0, secret=b_secret)
        await _until(waiting, AcquireStage.QUEUED)

        watching.cancel()  # from here on the mirror sees nothing new
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await locks.release(a, "a", "g", first.epoch, secret=a_secret)

        granted = await _until(waiting, AcquireStage.GRANTED)
        hold = await holder(store)
        assert hold is not None and hold.record.job == "b"
        assert granted.epoch == hold.create_revision > first.epoch
        assert granted.ticket == hold.record.ticket
        seen = mirror.holder("g")  # the mirror still shows a's hold
        assert seen is not None and seen.record.job == "a"
        await waiting.aclose()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
