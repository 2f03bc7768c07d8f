"""A yield that hands the group over answers a waiter on the same replica at once.

In-process LockService over a real etcd and a real mirror. The mirror is stopped after the
waiter queues, so the only way the waiter can learn of its grant is the hand-over itself.
Each test runs with the hand-over in one transaction (a deployment whose features record
allows it) and as a release then a grant (one upgraded from an older version).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.integration.groupstore import holder
from timeslice import AcquireStage
from timeslice_orchestrator import locks as locks_module
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.handover import CURRENT_FEATURES
from timeslice_orchestrator.store.records import FeaturesRecord, hold_epoch

ONE_TRANSACTION = pytest.mark.parametrize("one_transaction", [True, False], ids=["one", "two"])


async def _until(stages: AsyncIterator[Progress], stage: AcquireStage) -> Progress:
    async with asyncio.timeout(10):
        async for progress in stages:
            if progress.stage is stage:
                return progress
    raise AssertionError(f"the acquire ended before {stage}")


@ONE_TRANSACTION
async def test_a_hand_over_reaches_a_waiter_here_without_the_watch(
    store: GroupStore, one_transaction: bool
) -> None:
    if one_transaction:
        await store.set_features(CURRENT_FEATURES)
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
        assert granted.epoch == hold_epoch(hold) == hold.mod_revision > first.epoch
        # One transaction overwrites a's hold (the key stays); two delete it and create b's.
        assert hold.record.handed_over is one_transaction
        assert (hold.create_revision == first.epoch) is one_transaction
        assert granted.ticket == hold.record.ticket
        seen = mirror.holder("g")  # the mirror still shows a's hold
        assert seen is not None and seen.record.job == "a"
        await waiting.aclose()
        # b's hold is b's to yield, by the epoch it was given.
        await locks.release(b, "b", "g", granted.epoch, secret=b_secret)
        assert await holder(store) is None
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


@ONE_TRANSACTION
async def test_the_waiter_gets_its_grant_before_the_yield_returns(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch, one_transaction: bool
) -> None:
    """The hand-over is for the waiter: its stream takes the grant before the yielding call
    answers (both answers leave this replica's one loop, and the waiter's is the handoff)."""
    # The yield's wait for the waiter is bounded (0.1 s); a loaded machine that stalls this
    # loop longer would answer the yield first, which is not what this test is about.
    monkeypatch.setattr(locks_module, "_WAITER_FIRST_SECONDS", 30.0)
    if one_transaction:
        await store.set_features(CURRENT_FEATURES)
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        locks = LockService(store, mirror, Metrics(), 30)
        sessions = {job: await locks.open_session(job, 30, "host", 1) for job in ("a", "b")}

        async def acquire(job: str, order: list[str], queued: asyncio.Event) -> int:
            sid, secret, _ = sessions[job]
            epoch = 0
            # As the API's stream consumes it: take each step, then ask for the next.
            async for progress in locks.acquire(sid, job, "g", 0, secret=secret):
                if progress.stage is AcquireStage.QUEUED:
                    queued.set()
                elif progress.stage is AcquireStage.GRANTED:
                    order.append("granted")
                    epoch = progress.epoch
            return epoch

        holder_job, waiter_job = "a", "b"
        epoch = await acquire(holder_job, [], asyncio.Event())
        for turn in range(5):
            order: list[str] = []
            queued = asyncio.Event()
            waiting = asyncio.create_task(acquire(waiter_job, order, queued))
            async with asyncio.timeout(10):
                await queued.wait()
                sid, secret, _ = sessions[holder_job]
                await locks.release(sid, holder_job, "g", epoch, secret=secret)
                order.append("yield returned")
                epoch = await waiting
            assert order == ["granted", "yield returned"], f"turn {turn}: {order}"
            holder_job, waiter_job = waiter_job, holder_job
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


async def test_a_one_transaction_hand_over_whose_reads_moved_goes_in_two(store: GroupStore) -> None:
    """An operator disabled the feature after this replica's mirror last looked: the
    one-transaction try fails its compare on the features record, changes nothing, and the
    yield releases and grants in two transactions instead."""
    await store.set_features(CURRENT_FEATURES)
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        metrics = Metrics()
        locks = LockService(store, mirror, metrics, 30)
        a, a_secret, _ = await locks.open_session("a", 30, "host", 1)
        b, b_secret, _ = await locks.open_session("b", 30, "host", 2)
        first = await _until(locks.acquire(a, "a", "g", 0, secret=a_secret), AcquireStage.GRANTED)
        waiting = locks.acquire(b, "b", "g", 0, secret=b_secret)
        await _until(waiting, AcquireStage.QUEUED)

        watching.cancel()  # the mirror keeps showing the feature on
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await store.set_features(FeaturesRecord())
        await locks.release(a, "a", "g", first.epoch, secret=a_secret)

        granted = await _until(waiting, AcquireStage.GRANTED)
        hold = await holder(store)
        assert hold is not None and hold.record.job == "b" and not hold.record.handed_over
        assert granted.epoch == hold.create_revision == hold_epoch(hold) > first.epoch
        counted = {
            way: metrics.registry.get_sample_value(
                "timeslice_hand_overs_total", {"transactions": way}
            )
            for way in ("one", "two")
        }
        assert counted == {"one": None, "two": 1.0}, counted
        await waiting.aclose()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
