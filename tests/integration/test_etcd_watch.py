"""The etcd client's watches (store/etcd/watch.py) against a real etcd: resume from a revision,
compaction, progress requests on a quiet watch, a stream that stops answering, and no batch
ahead of its events."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    EventType,
    WatchBatch,
    WatchCompacted,
)
from timeslice_orchestrator.store.etcd import watch as etcd_watch
from timeslice_tools.dev.etcd import EtcdServer


def unique() -> bytes:
    return f"/test/{uuid.uuid4().hex}/".encode()


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
