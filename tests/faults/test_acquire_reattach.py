"""A replica dies between committing a grant and delivering it: the SDK re-attaches to it.

The SDK names each acquire with a ``request_id`` that it sends again on every retry. When the
replica serving a waiter's Acquire dies after the waiter's grant was committed in etcd but
before GRANTED reached the client, the client's retry on another replica must be recognised
as the same call and handed the committed grant (same epoch, same ticket), not refused
("already holds") and not granted twice. The fake orchestrator of the SDK tests ignores
``request_id``; this runs the real replicas.

How the grant is made undeliverable: the waiter's stream is on replica r0, which is paused
(SIGSTOP) while the holder yields through r1; r1 hands the group over to the waiter at once
(its state needs no moving), so the grant commits while r0 cannot send it. Then r0 is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from tests.integration.etcdview import etcd_client
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import (
    GroupStats,
    HolderRecord,
    QueueRecord,
    Stored,
    hold_epoch,
)
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Attempt,
    Hold,
    Recorder,
    check_fifo,
    check_mutual_exclusion,
    check_nothing_lost,
)

pytestmark = pytest.mark.slow

GROUP = "g"
R = TypeVar("R")


class Etcd:
    """The group's keys, read straight from etcd (not through any replica)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._client = etcd_client(cluster)
        self._keys = Keyspace(cluster.prefix)

    async def close(self) -> None:
        await self._client.close()

    async def holder(self) -> Stored[HolderRecord] | None:
        kv = await self._client.get(self._keys.holder(GROUP))
        return Stored.of(kv, HolderRecord.decode(kv.value)) if kv else None

    async def entry(self, job: str) -> Stored[QueueRecord] | None:
        kv = await self._client.get(self._keys.queue_entry(GROUP, job))
        return Stored.of(kv, QueueRecord.decode(kv.value)) if kv else None

    async def stats(self) -> GroupStats:
        kv = await self._client.get(self._keys.stats(GROUP))
        return GroupStats.decode(kv.value) if kv else GroupStats()


async def until(
    what: str, read: Callable[[], Awaitable[R]], ok: Callable[[R], bool], timeout: float
) -> R:
    """Poll ``read`` until ``ok``; fail with the last value after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await read()
        if ok(value):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last seen {value!r}")
        await asyncio.sleep(0.01)


async def test_a_grant_committed_on_a_dying_replica_is_re_attached_by_request_id(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=0, replica_ttl=2)
    r0, r1 = cluster.targets
    recorder = Recorder()
    etcd = Etcd(cluster)
    try:
        async with (
            # The holder and the observer only ever talk to r1; the waiter starts on r0.
            AsyncTimeSliceClient([r1], job_id="a") as a,
            AsyncTimeSliceClient([r0, r1], job_id="b") as b,
            AsyncTimeSliceClient([r1], job_id="observer") as observer,
        ):
            started = recorder.now()
            first = await a.acquire(GROUP, timeout=30)
            granted = recorder.now()
            recorder.attempt(Attempt("a", GROUP, started, granted))

            waiting_since = recorder.now()
            waiter = asyncio.create_task(b.acquire(GROUP, timeout=60))
            await wait_for_status(
                observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10
            )
            entry = await etcd.entry("b")
            assert entry is not None and entry.record.request_id, entry
            assert entry.record.session == b.session_id

            replica = cluster.processes["r0"]
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                released = recorder.now()
                recorder.hold(Hold("a", GROUP, first.epoch, first.ticket, granted, released))
                await a.yield_(GROUP)  # through r1, which hands the group over to b at once
                committed = await until(
                    "b's grant in etcd", etcd.holder, lambda h: h is not None, 10
                )
                assert committed is not None
                # The grant served b's queue entry as r0 wrote it: b's client had not retried
                # (a retry re-stamps the entry first), so the grant is committed and undelivered.
                assert committed.record.job == "b"
                assert committed.record.request_id == entry.record.request_id
                assert committed.record.attempt == entry.record.attempt, (
                    "b's client retried before the grant (its pings to the paused r0 timed "
                    "out): the scenario did not happen as planned"
                )
                assert committed.record.ticket == entry.create_revision
                assert await etcd.entry("b") is None
                assert not waiter.done(), "GRANTED came through a paused replica"
            finally:
                # A stopped process takes SIGKILL as it is: r0 never runs again.
                cluster.kill_replica(0)
            await asyncio.to_thread(replica.wait, 10)

            grant = await asyncio.wait_for(waiter, 30)
            granted = recorder.now()
            recorder.attempt(Attempt("b", GROUP, waiting_since, granted))

            # The client got the committed grant back: same epoch, same ticket. (A hand-over in
            # one transaction overwrote a's hold: the epoch is that write's revision.)
            assert (grant.job_id, grant.epoch, grant.ticket) == (
                "b",
                hold_epoch(committed),
                committed.record.ticket,
            )
            held = await etcd.holder()
            assert held is not None
            # Re-attached through r1 with the same request id: the one hold, re-stamped with
            # r1's attempt (so r0's leftover clean-up could not take it), nothing else written.
            assert held.create_revision == committed.create_revision
            assert hold_epoch(held) == hold_epoch(committed)  # the re-stamp kept the epoch
            assert held.record.request_id == entry.record.request_id
            assert held.record.attempt != committed.record.attempt
            assert held.record.session == committed.record.session == b.session_id
            assert (await etcd.stats()).grants == 2, "a second grant was made"

            status = await observer.status(GROUP)
            assert status.holder_job_id == "b" and status.holder_epoch == grant.epoch
            assert not status.queue

            await asyncio.sleep(0.05)
            released = recorder.now()
            recorder.hold(Hold("b", GROUP, grant.epoch, grant.ticket, granted, released))
            await b.yield_(GROUP)  # the hold is valid: the yield of that epoch is accepted
            assert await etcd.holder() is None, "a hold leaked"
            assert await etcd.entry("b") is None

            # The group keeps working for the other job, in order.
            started = recorder.now()
            again = await a.acquire(GROUP, timeout=30)
            granted = recorder.now()
            recorder.attempt(Attempt("a", GROUP, started, granted))
            assert again.epoch > grant.epoch and again.ticket > grant.ticket
            recorder.hold(Hold("a", GROUP, again.epoch, again.ticket, granted, recorder.now()))
            await a.yield_(GROUP)
            assert (await etcd.stats()).grants == 3
    finally:
        await etcd.close()
    check_mutual_exclusion(recorder.holds)
    check_fifo(recorder.holds)
    check_nothing_lost(recorder.attempts, {"a": 2, "b": 1})
    assert len(recorder.holds) == 3


async def test_a_waiter_leaves_a_replica_paused_long_after_it_connected(
    cluster_factory: ClusterFactory,
) -> None:
    """The SDK pings its replica for as long as the connection lives, not only at first.

    With grpclib's defaults a connection sent one ping (after 2 s) and then none for 300 s, so
    a waiter on a replica paused after that heard nothing for minutes, while its grant, made
    through another replica, sat undelivered and blocked the group.
    """
    cluster = cluster_factory(replicas=2, agents=0, replica_ttl=2)
    r0, r1 = cluster.targets
    async with (
        AsyncTimeSliceClient([r1], job_id="a") as a,
        AsyncTimeSliceClient([r0, r1], job_id="b") as b,
        AsyncTimeSliceClient([r1], job_id="observer") as observer,
    ):
        first = await a.acquire(GROUP, timeout=30)
        waiter = asyncio.create_task(b.acquire(GROUP, timeout=120))
        await wait_for_status(observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10)
        await asyncio.sleep(6)  # past the connection's first ping (grpclib sends it at 2 s)
        replica = cluster.processes["r0"]
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            await a.yield_(GROUP)  # through r1, which grants b at once: r0 cannot tell b
            # Pings every 2 s, 3 s to answer; then the re-attach through r1. 30 s: a bound
            # for a loaded machine, far under the 300 s of the old ping schedule.
            grant = await asyncio.wait_for(waiter, 30)
        finally:
            cluster.kill_replica(0)
        await asyncio.to_thread(replica.wait, 10)
        assert grant.epoch > first.epoch
        await b.yield_(GROUP)
