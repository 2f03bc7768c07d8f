"""Paged prefix reads and large watch responses against a real etcd (issue 13, finding 4).

A read of a whole prefix, or one watch response, used to be one gRPC message, and past a few
thousand groups it exceeded the client's receive limit: a replica could not start. Pages are
read at one revision, so the listing is one snapshot a watch can resume after; a watch
response too large to receive makes the mirror list afresh rather than retry it forever.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from timeslice_orchestrator.store.etcd import (
    Compacted,
    EtcdClient,
    EventType,
    KeyValue,
    Put,
    Txn,
    WatchBatch,
    WatchTooLarge,
)
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import HolderRecord, QueueRecord
from timeslice_tools.dev.etcd import EtcdServer

TXN_OPS = 128  # etcd's default --max-txn-ops


def unique() -> bytes:
    return f"/test/{uuid.uuid4().hex}/".encode()


async def put_many(etcd: EtcdClient, items: list[tuple[bytes, bytes]]) -> int:
    """Write ``items`` in transactions of etcd's largest size; the revision of the last."""
    revision = 0
    for i in range(0, len(items), TXN_OPS):
        ops = [Put(k, v) for k, v in items[i : i + TXN_OPS]]
        result = await etcd.txn(Txn([], ops))
        assert result.succeeded
        revision = result.revision
    return revision


def key(p: bytes, i: int) -> bytes:
    return p + f"k{i:04d}".encode()


async def test_pages_are_one_snapshot_at_the_first_pages_revision(etcd: EtcdClient) -> None:
    p = unique()
    written = await put_many(etcd, [(key(p, i), str(i).encode()) for i in range(50)])
    pages: list[list[KeyValue]] = []
    revisions: set[int] = set()
    async with asyncio.timeout(10):
        async for revision, page in etcd.pages(p, page=7):
            if not pages:
                # Changes after the first page, ahead of and behind the pages still to come,
                # must not show: the listing is the store as of its first page.
                await etcd.put(key(p, 49) + b"-new", b"x")
                await etcd.delete(key(p, 30))
                await etcd.put(key(p, 40), b"changed")
                await etcd.put(key(p, 0) + b"-new", b"x")
            pages.append(page)
            revisions.add(revision)
    assert [len(page) for page in pages] == [7] * 7 + [1]
    # One revision for every page. Not necessarily ``written`` itself: the etcd server is
    # shared, and another test's lease running out can move its revision on in between.
    assert len(revisions) == 1 and min(revisions) >= written
    kvs = [kv for page in pages for kv in page]
    assert [kv.key for kv in kvs] == [key(p, i) for i in range(50)]
    assert [kv.value for kv in kvs] == [str(i).encode() for i in range(50)]
    # get_prefix reads the same way; an empty prefix is one empty page at etcd's revision.
    revision, everything = await etcd.get_prefix(p, page=3)
    assert revision > written and len(everything) == 51
    empty = [(r, page) async for r, page in etcd.pages(unique())]
    assert len(empty) == 1 and empty[0][1] == [] and empty[0][0] >= revision


async def test_a_listing_whose_revision_is_compacted_says_so(etcd: EtcdClient) -> None:
    p = unique()
    await put_many(etcd, [(key(p, i), b"v") for i in range(50)])
    with pytest.raises(Compacted):
        async with asyncio.timeout(10):
            async for _, page in etcd.pages(p, page=5):
                assert page
                head = await etcd.put(p + b"zz", b"moves the revision on")
                await etcd.compact(head)


async def test_a_watch_response_larger_than_4_mib_arrives_whole(etcd: EtcdClient) -> None:
    # One delete of a range: 12,000 events at one revision, about 5 MiB of keys, in one
    # response (gRPC's default limit, 4 MiB, broke the watch on it for good).
    p = unique()
    count = 12_000
    pad = "x" * 400
    first = await put_many(etcd, [(p + f"{i:05d}-{pad}".encode(), b"") for i in range(count)])
    batches: list[WatchBatch] = []
    deleted = await etcd.delete(p, prefix=True)
    assert deleted == count
    async with asyncio.timeout(20):
        async for batch in etcd.watch_prefix(p, first + 1):
            if batch.events:
                batches.append(batch)
                break
    [batch] = batches
    assert len(batch.events) == count
    assert {ev.type for ev in batch.events} == {EventType.DELETE}
    assert len({ev.kv.mod_revision for ev in batch.events}) == 1
    assert sum(len(ev.kv.key) for ev in batch.events) > 4 * 1024 * 1024


async def test_a_watch_response_too_large_to_receive_makes_the_mirror_relist(
    etcd_server: EtcdServer,
) -> None:
    # A client that takes at most 1 MiB: one transaction of 1.25 MiB of values is a watch
    # response it cannot receive. Resuming would ask for it again and again; the mirror lists
    # afresh instead, in pages small enough to fit, and watches on from there.
    small = EtcdClient([etcd_server.endpoint], max_receive_bytes=1024 * 1024)
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    mirror = Mirror(small, keys)
    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tasks:
            watcher = tasks.create_task(mirror.run())
            await mirror.synced.wait()
            value = b"v" * 10_000
            big = Txn([], [Put(keys.meta(f"g{i:03d}"), value) for i in range(TXN_OPS)])
            result = await small.txn(big)
            await mirror.wait_for_revision(result.revision, timeout=20)
            assert len(mirror.group_names()) == TXN_OPS
            after = await small.put(keys.meta("late"), b"1")  # and it watches on
            await mirror.wait_for_revision(after, timeout=10)
            assert "late" in mirror.group_names()
            watcher.cancel()
        with pytest.raises(WatchTooLarge):
            async with asyncio.timeout(10):
                async for _ in small.watch_prefix(keys.root, result.revision):
                    pass
    finally:
        await small.close()


async def test_the_mirror_lists_in_pages_then_watches_without_a_gap(etcd: EtcdClient) -> None:
    # More keys than the first page, written to all the while the mirror lists and starts its
    # watch: once it has caught up, it holds exactly what etcd holds.
    keys = Keyspace(f"/test/{uuid.uuid4().hex}")
    holder = HolderRecord(job="a", session="s", granted_at=1.0).encode()
    waiter = QueueRecord(session="s", priority=0, enqueued_at=1.0).encode()
    items = [(keys.holder(f"g{i:04d}"), holder) for i in range(1500)]
    items += [(keys.queue_entry(f"g{i:04d}", "b"), waiter) for i in range(1500)]
    await put_many(etcd, items)
    mirror = Mirror(etcd, keys)
    stop = asyncio.Event()
    last = 0

    async def write() -> None:
        nonlocal last
        i = 0
        while not stop.is_set():
            last = await etcd.put(keys.holder(f"h{i:04d}"), holder)
            if i % 3 == 0:
                await etcd.delete(keys.queue_entry(f"g{i:04d}", "b"))
            i += 1
            await asyncio.sleep(0)

    async with asyncio.timeout(30), asyncio.TaskGroup() as tasks:
        writer = tasks.create_task(write())
        watcher = tasks.create_task(mirror.run())
        await mirror.synced.wait()
        await asyncio.sleep(0.2)
        stop.set()
        await writer
        await mirror.wait_for_revision(last, timeout=10)
        watcher.cancel()
    revision, kvs = await etcd.get_prefix(keys.root)
    assert revision == mirror.revision
    expected = {kv.key.decode().split("/", 4)[4] for kv in kvs}
    assert len(expected) > 3000  # more than one page, and the writer got some in
    seen = set()
    for group in mirror.group_names():
        view = mirror.group(group)
        if view.holder is not None:
            seen.add(f"{group}/holder")
        seen.update(f"{group}/queue/{q.job}" for q in view.queue)
    assert seen == expected
    assert mirror.held_by("s") == sorted(g for g in mirror.group_names())
    assert not mirror.idle("g0001") and mirror.idle("g0000") and mirror.idle("h0000")
    held, queued, switching = mirror.summary("g0001")
    assert held is not None and (held.job, queued, switching) == ("a", 1, False)
