"""The mirror's list-then-watch loop (store/follower.py) against a real etcd: a lagging mirror is
a typed outage, a stuck watch is found (with or without writes of its own) and started again,
and a watch that brings changes needs no beacon."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    WatchBatch,
)
from timeslice_tools.dev.etcd import EtcdServer


async def test_a_lagging_mirror_is_a_typed_unavailable(etcd: EtcdClient) -> None:
    from timeslice_orchestrator.store.etcd import StoreUnavailable
    from timeslice_orchestrator.store.follower import Mirror
    from timeslice_orchestrator.store.keys import Keyspace

    mirror = Mirror(etcd, Keyspace(f"/test/{uuid.uuid4().hex}"))  # never started: never catches up
    with pytest.raises(StoreUnavailable, match="behind"):
        await mirror.wait_for_revision(10**9, 0.05)


class _FirstWatchSilent(EtcdClient):
    """The real client, except that its first watch is created and then hears nothing (a
    watch stuck on a member that still answers reads, as once seen under load)."""

    watches = 0

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[WatchBatch]:
        self.watches += 1
        if self.watches == 1:
            await asyncio.Event().wait()
        async for batch in super().watch_prefix(prefix, start_revision):
            yield batch


async def test_a_stuck_watch_is_started_again(etcd_server: EtcdServer) -> None:
    from timeslice_orchestrator.store.follower import WATCH_STUCK_AFTER, Mirror
    from timeslice_orchestrator.store.keys import Keyspace

    client = _FirstWatchSilent([etcd_server.endpoint])
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    mirror = Mirror(client, keys)
    running = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        written = await client.put(keys.root + b"k", b"v")
        started = asyncio.get_running_loop().time()
        # Without the watchdog this waits out its whole deadline: the watch never delivers.
        await mirror.wait_for_revision(written, WATCH_STUCK_AFTER + 5)
        took = asyncio.get_running_loop().time() - started
        assert client.watches == 2 and mirror.reconnects == 1
        assert took >= WATCH_STUCK_AFTER - 0.1, took
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await client.close()


@pytest.fixture
def quick_beacon(monkeypatch: pytest.MonkeyPatch) -> float:
    from timeslice_orchestrator.store import follower

    monkeypatch.setattr(follower, "WATCH_QUIET_AFTER", 0.5)
    return 0.5


async def _written_elsewhere(etcd_server: EtcdServer, key: bytes) -> int:
    """Write ``key`` through another client: a change the mirror must see without any write
    of its own to wait for."""
    other = EtcdClient([etcd_server.endpoint])
    try:
        return await other.put(key, b"v")
    finally:
        await other.close()


async def test_a_stuck_watch_is_found_without_a_write_of_our_own(
    etcd_server: EtcdServer, quick_beacon: float
) -> None:
    from timeslice_orchestrator.store.follower import WATCH_STUCK_AFTER, Mirror
    from timeslice_orchestrator.store.keys import Keyspace

    client = _FirstWatchSilent([etcd_server.endpoint])
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    mirror = Mirror(client, keys, name="replica-1")
    running = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        written = await _written_elsewhere(etcd_server, keys.root + b"k")
        # Without the beacon nothing ever waits for this watch, and it stays stuck.
        async with asyncio.timeout(quick_beacon + WATCH_STUCK_AFTER + 10):
            while mirror.revision < written:
                await asyncio.sleep(0.02)
        assert client.watches == 2 and mirror.reconnects == 1
        beacon = await client.get(keys.beacon())
        assert beacon is not None and beacon.value == b"replica-1"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await client.close()


async def test_a_watch_that_brings_changes_gets_no_beacon(
    etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timeslice_orchestrator.store import follower
    from timeslice_orchestrator.store.keys import Keyspace

    monkeypatch.setattr(follower, "WATCH_QUIET_AFTER", 2.0)
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    mirror = follower.Mirror(etcd, keys)
    running = asyncio.create_task(mirror.run())
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        first = await etcd.put(keys.root + b"k", b"v")
        await mirror.wait_for_revision(first, 10)  # the watch is running and delivering
        longest_gap, last = 0.0, loop.time()
        for i in range(60):  # a change every 0.1 s for 6 s, three quiet intervals
            await etcd.put(keys.root + f"k{i % 3}".encode(), b"v")
            longest_gap, last = max(longest_gap, loop.time() - last), loop.time()
            await asyncio.sleep(0.1)
        # Only a stall of this host half as long as the quiet interval would excuse a beacon.
        beacon = await etcd.get(keys.beacon())
        assert beacon is None or longest_gap > 1.0, "a beacon while the watch brought news"
        async with asyncio.timeout(15):  # quiet now: a beacon, brought back by the watch
            while (beacon := await etcd.get(keys.beacon())) is None:
                await asyncio.sleep(0.05)
            while mirror.revision < beacon.mod_revision:
                await asyncio.sleep(0.02)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
