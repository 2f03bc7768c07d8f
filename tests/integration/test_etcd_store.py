"""The typed etcd wrapper against a real etcd: transactions, leases, watch resume, compaction."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from timeslice_orchestrator.store.etcd import (
    Delete,
    EtcdClient,
    EventType,
    Get,
    LeaseExpired,
    LeaseKeeper,
    Put,
    Txn,
    WatchBatch,
    WatchCompacted,
    absent,
    prefix_end,
)
from timeslice_orchestrator.store.etcd import watch as etcd_watch
from timeslice_tools.dev.etcd import EtcdServer


def unique() -> bytes:
    return f"/test/{uuid.uuid4().hex}/".encode()


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_txn_create_if_absent_and_reads(etcd: EtcdClient) -> None:
    p = unique()
    first = await etcd.txn(Txn([absent(p + b"k")], [Put(p + b"k", b"1")], [Get(p + b"k")]))
    assert first.succeeded
    second = await etcd.txn(Txn([absent(p + b"k")], [Put(p + b"k", b"2")], [Get(p + b"k")]))
    assert not second.succeeded
    assert second.reads[0][0].value == b"1"
    assert second.reads[0][0].create_revision == first.revision
    nested = await etcd.txn(
        Txn([absent(p + b"x")], [Txn([absent(p + b"y")], [Put(p + b"y", b"n")]), Delete(p + b"k")])
    )
    assert nested.succeeded
    assert (await etcd.get(p + b"y")) is not None and (await etcd.get(p + b"k")) is None


async def test_lease_keeper_keeps_and_loses(etcd: EtcdClient) -> None:
    p = unique()
    # A 3 s TTL: with 1 s, a stall of this process or of etcd on a loaded machine could lose it.
    lease = await etcd.grant_lease(3)
    await etcd.put(p + b"leased", b"v", lease=lease)
    keeper = LeaseKeeper(etcd, lease, 3)
    task = asyncio.create_task(keeper.run())
    await asyncio.sleep(7)
    assert await etcd.get(p + b"leased") is not None, "kept alive past its TTL"
    await etcd.revoke_lease(lease)
    async with asyncio.timeout(3):
        await keeper.lost.wait()
    await task
    assert await etcd.get(p + b"leased") is None
    with pytest.raises(LeaseExpired):
        await etcd.keepalive_once(lease)


async def test_watch_resumes_from_revision_and_reports_compaction(etcd: EtcdClient) -> None:
    p = unique()
    r1 = await etcd.put(p + b"a", b"1")
    await etcd.put(p + b"b", b"2")
    seen: list[tuple[EventType, bytes]] = []
    last = 0
    async with asyncio.timeout(5):
        async for batch in etcd.watch_prefix(p, r1):
            for ev in batch.events:
                seen.append((ev.type, ev.kv.key))
                last = ev.kv.mod_revision
            if len(seen) >= 2:
                break
    assert seen == [(EventType.PUT, p + b"a"), (EventType.PUT, p + b"b")]
    await etcd.delete(p + b"a")
    # Resume from the last revision + 1: only what happened since.
    async with asyncio.timeout(5):
        async for batch in etcd.watch_prefix(p, last + 1):
            if batch.events:
                assert [(e.type, e.kv.key) for e in batch.events] == [(EventType.DELETE, p + b"a")]
                break
    # Compact past r1: a watch from r1 must say so instead of silently missing events.
    head = await etcd.put(p + b"c", b"3")
    await etcd.compact(head)
    with pytest.raises(WatchCompacted):
        async with asyncio.timeout(5):
            async for _ in etcd.watch_prefix(p, r1):
                pass


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


class _WatchStreams:
    """Wraps a member's watch stub (the gRPC boundary): counts the progress requests written
    on its streams and, with ``stall_first``, makes the first stream hear nothing after etcd
    confirms it (a stream stuck while its member answers reads)."""

    def __init__(self, stub: Any, *, stall_first: bool) -> None:
        self._stub = stub
        self._stall_first = stall_first
        self.opened = 0
        self.progress_requests = 0

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # the stub's name
        self.opened += 1
        return _WatchCall(
            self, self._stub.Watch(*args, **kwargs), self._stall_first and self.opened == 1
        )


class _WatchCall:
    def __init__(self, streams: _WatchStreams, call: Any, stall: bool) -> None:
        self._streams, self._call, self._stall = streams, call, stall
        self._reads = 0
        self._cancelled = asyncio.Event()

    async def write(self, request: Any) -> None:
        if request.HasField("progress_request"):
            self._streams.progress_requests += 1
        await self._call.write(request)

    async def read(self) -> Any:
        self._reads += 1
        if self._stall and self._reads > 1:
            await self._cancelled.wait()
            raise asyncio.CancelledError
        return await self._call.read()

    def cancel(self) -> bool:
        self._cancelled.set()
        return bool(self._call.cancel())


@pytest.fixture
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_watch, "WATCH_PROBE_AFTER", 0.3)
    monkeypatch.setattr(etcd_watch, "WATCH_PROBE_TIMEOUT", 0.5)


@pytest.mark.usefixtures("quick_probes")
async def test_a_quiet_watch_answers_progress_requests_and_lives_on(etcd: EtcdClient) -> None:
    streams = _WatchStreams(etcd._members[0].watch, stall_first=False)
    etcd._members[0].watch = streams
    p = unique()
    start = await etcd.put(p + b"a", b"1")
    batches: list[WatchBatch] = []

    async def watch() -> None:
        async for batch in etcd.watch_prefix(p, start + 1):
            batches.append(batch)

    watching = asyncio.create_task(watch())
    try:
        # Writes elsewhere move etcd's revision: a progress answer passed on as a batch would
        # show here as an empty one at a revision this watch has not caught up to.
        for _ in range(8):
            await etcd.put(unique(), b"elsewhere")
            await asyncio.sleep(0.3)
        assert streams.progress_requests >= 2, "a silent watch was never asked for progress"
        assert batches == [], "a progress answer was passed on as a batch"
        written = await etcd.put(p + b"b", b"2")
        async with asyncio.timeout(5):
            while not batches:
                await asyncio.sleep(0.02)
        assert [ev.kv.mod_revision for ev in batches[0].events] == [written]
        assert streams.opened == 1 and not watching.done()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


@pytest.mark.usefixtures("quick_probes")
async def test_a_watch_stream_that_stops_answering_starts_again(etcd_server: EtcdServer) -> None:
    from timeslice_orchestrator.store.follower import Mirror
    from timeslice_orchestrator.store.keys import Keyspace

    client = EtcdClient([etcd_server.endpoint])
    streams = _WatchStreams(client._members[0].watch, stall_first=True)
    client._members[0].watch = streams
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    mirror = Mirror(client, keys)
    running = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        # Another writer's change: no write of this replica for the mirror's own stuck-watch
        # check to miss, so only the stream's probe can find that the watch stopped.
        other = EtcdClient([etcd_server.endpoint])
        try:
            written = await other.put(keys.root + b"k", b"v")
        finally:
            await other.close()
        async with asyncio.timeout(10):
            while mirror.revision < written:
                await asyncio.sleep(0.02)
        assert streams.opened == 2 and mirror.reconnects == 1
        assert streams.progress_requests >= 1
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await client.close()


async def test_keepalive_keeps_one_stream_per_lease(etcd: EtcdClient) -> None:
    opened: list[int] = []
    real = etcd._lease.LeaseKeepAlive

    def counting(*args: object, **kwargs: object) -> object:
        opened.append(1)
        return real(*args, **kwargs)

    etcd._lease.LeaseKeepAlive = counting
    first, second = await etcd.grant_lease(30), await etcd.grant_lease(30)
    for _ in range(5):
        assert await etcd.keepalive_once(first) == 30
    assert await etcd.keepalive_once(second) == 30
    assert len(opened) == 2, "a stream per refresh instead of one per lease"
    # A stream that broke while idle is replaced once, and the refresh goes through.
    etcd._keepalives[first].close()
    assert await etcd.keepalive_once(first) == 30
    assert len(opened) == 3
    # A revoked lease closes its stream; refreshing it says it is gone.
    await etcd.revoke_lease(first)
    assert first not in etcd._keepalives
    with pytest.raises(LeaseExpired):
        await etcd.keepalive_once(first)
    assert first not in etcd._keepalives


async def test_keepalive_streams_of_lapsed_leases_are_closed(etcd: EtcdClient) -> None:
    lease, other = await etcd.grant_lease(1), await etcd.grant_lease(30)
    await etcd.keepalive_once(lease)
    await asyncio.sleep(2.2)  # past its TTL and the sweep interval, refreshed nowhere
    await etcd.keepalive_once(other)
    assert lease not in etcd._keepalives
    assert other in etcd._keepalives


async def test_no_batch_reports_a_revision_ahead_of_the_events_it_brought(
    etcd: EtcdClient,
) -> None:
    # A watch resumed from an old revision is first confirmed by etcd with a header at etcd's
    # current revision and no events; a batch at that revision would tell the mirror it has
    # caught up before the events in between arrive (found once by the etcd restart fault
    # test, which only sometimes lost the race).
    p = unique()
    first = await etcd.put(p + b"a", b"1")
    for i in range(20):
        head = await etcd.put(p + b"k%d" % i, b"x")
    caught_up = 0  # the newest event the watch has brought
    async with asyncio.timeout(5):
        async for batch in etcd.watch_prefix(p, first):
            caught_up = max([caught_up, *(e.kv.mod_revision for e in batch.events)])
            assert batch.revision <= caught_up, (
                f"a batch at revision {batch.revision} with {len(batch.events)} events before "
                f"the events up to it arrived (caught up to {caught_up})"
            )
            if caught_up >= head:
                break
