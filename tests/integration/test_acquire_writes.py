"""How many etcd writes an Acquire and a Yield cost, counted on the wire (a watch).

A free group nobody waits for is granted in the Acquire's own transaction: one write, no
queue entry, no hop to the driver. Its hold is like any other: the epoch is the holder key's
create revision, and the ticket (its place in line) is below the epoch and above every earlier
grant's ticket. A contended Acquire still queues and is granted by the driver.

A Yield that hands the group over to a waiter whose state is in place is one write where the
deployment's features record allows it (a new deployment: ``one``), and a release then a
grant where it does not (one upgraded from an older version: ``two``); each such test runs
both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from tests.conftest import ClusterFactory
from tests.integration.etcdview import etcd_client, set_features
from tests.integration.rawclient import opened, raw_stub
from timeslice_orchestrator.store.etcd import EventType
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import FeaturesRecord, HolderRecord
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    AcquireState,
    GetGroupStatusRequest,
    OpenSessionRequest,
    TimeSliceStub,
    YieldRequest,
)
from timeslice_tools.dev.cluster import LocalCluster

T = TypeVar("T")

HAND_OVER = pytest.mark.parametrize("one_transaction", [True, False], ids=["one", "two"])


async def _deployment(cluster: LocalCluster, one_transaction: bool) -> None:
    """A new deployment hands over in one transaction; make this one an upgraded one that
    has not enabled it yet, unless ``one_transaction``."""
    if not one_transaction:
        await set_features(cluster, FeaturesRecord())


async def _writes(
    cluster: LocalCluster, action: Callable[[], Awaitable[T]]
) -> tuple[T, list[tuple[int, EventType, str]]]:
    """What ``action`` wrote under the cluster's prefix: (revision, event, key) of every
    change, but the beacon (a quiet replica's check of its own watch, not the call's)."""
    prefix = cluster.prefix
    client = etcd_client(cluster)
    root = f"{prefix}/".encode()
    beacon = Keyspace(prefix).beacon()
    try:
        start, _ = await client.get_prefix(root)
        result = await action()
        end, _ = await client.get_prefix(root)
        seen: list[tuple[int, EventType, str]] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                async for batch in client.watch_prefix(root, start + 1):
                    seen += [
                        (e.kv.mod_revision, e.type, e.kv.key.decode().removeprefix(prefix))
                        for e in batch.events
                        if e.kv.mod_revision <= end and e.kv.key != beacon
                    ]
        return result, seen
    finally:
        await client.close()


async def _granted(stub: object, request: AcquireRequest) -> AcquireEvent:
    events = [ev async for ev in stub.acquire(request)]  # type: ignore[attr-defined]
    assert events[-1].state == AcquireState.GRANTED, events
    return events[-1]  # type: ignore[no-any-return]


async def _session(stub: TimeSliceStub, job: str) -> tuple[str, str]:
    """Open a session for ``job``: its id and secret."""
    return opened(await stub.open_session(OpenSessionRequest(job_id=job, ttl_seconds=30)))


async def _until_queued(stub: TimeSliceStub, group: str = "g") -> None:
    async with asyncio.timeout(10):
        while not (await stub.get_group_status(GetGroupStatusRequest(group))).queue:
            await asyncio.sleep(0.01)


@HAND_OVER
async def test_a_free_group_costs_one_write_to_acquire_and_one_to_yield(
    cluster_factory: ClusterFactory, one_transaction: bool
) -> None:
    cluster = cluster_factory(agents=0)
    await _deployment(cluster, one_transaction)
    prefix = cluster.prefix
    async with raw_stub(cluster.target) as stub:
        a, a_secret = await _session(stub, "a")
        b, b_secret = await _session(stub, "b")
        first, writes = await _writes(
            cluster,
            lambda: _granted(
                stub, AcquireRequest(a, "a", "g", request_id="r", session_secret=a_secret)
            ),
        )
        assert {r for r, _, _ in writes} == {first.epoch}, writes
        assert {k for _, _, k in writes} == {
            "/groups/g/holder",
            "/groups/g/meta",
            "/groups/g/resident",
            "/groups/g/stats",
        }
        assert 0 < first.ticket < first.epoch
        # Read-your-writes: the replica that answered already shows the hold.
        status = await stub.get_group_status(GetGroupStatusRequest("g"))
        assert (status.holder_job_id, status.holder_epoch) == ("a", first.epoch)
        _, writes = await _writes(
            cluster,
            lambda: stub.yield_(YieldRequest(a, "a", "g", first.epoch, session_secret=a_secret)),
        )
        assert len({r for r, _, _ in writes}) == 1, writes
        second, writes = await _writes(
            cluster,
            lambda: _granted(
                stub, AcquireRequest(b, "b", "g", request_id="s", session_secret=b_secret)
            ),
        )
        assert {r for r, _, _ in writes} == {second.epoch}, writes
        assert first.ticket < first.epoch < second.ticket < second.epoch  # FIFO by ticket
        # Contended: b holds, a queues; the driver grants a when b yields.
        waiter = asyncio.create_task(
            _granted(stub, AcquireRequest(a, "a", "g", request_id="t", session_secret=a_secret))
        )
        await _until_queued(stub)
        await stub.yield_(YieldRequest(b, "b", "g", second.epoch, session_secret=b_secret))
        third = await waiter
        assert second.epoch < third.ticket < third.epoch
    client = etcd_client(cluster)
    try:
        kv = await client.get(f"{prefix}/groups/g/holder".encode())
    finally:
        await client.close()
    assert kv is not None and kv.mod_revision == third.epoch
    if one_transaction:  # b's hold overwritten: the key is still the one b's grant created
        assert kv.create_revision == second.epoch
    else:
        assert kv.create_revision == third.epoch
    assert HolderRecord.decode(kv.value).ticket == third.ticket


@HAND_OVER
async def test_a_yield_hands_the_group_to_a_waiter_whose_state_is_in_place(
    cluster_factory: ClusterFactory, one_transaction: bool
) -> None:
    # Nothing has to move for b (no workers), so the replica that serves a's Yield grants b
    # in place before it answers: b's hold is in etcd when the Yield returns.
    cluster = cluster_factory(agents=0)
    await _deployment(cluster, one_transaction)
    async with raw_stub(cluster.target) as stub:
        a, a_secret = await _session(stub, "a")
        b, b_secret = await _session(stub, "b")
        first = await _granted(
            stub, AcquireRequest(a, "a", "g", request_id="r", session_secret=a_secret)
        )
        waiter = asyncio.create_task(
            _granted(stub, AcquireRequest(b, "b", "g", request_id="s", session_secret=b_secret))
        )
        await _until_queued(stub)
        _, writes = await _writes(
            cluster,
            lambda: stub.yield_(YieldRequest(a, "a", "g", first.epoch, session_secret=a_secret)),
        )
        if one_transaction:
            # Written before the Yield returned, all at once: a's hold overwritten by b's, b's
            # queue entry gone, a's time in the ledger, the statistics.
            second = await waiter
            assert {(r, t, k) for r, t, k in writes} == {
                (second.epoch, EventType.PUT, "/groups/g/holder"),
                (second.epoch, EventType.DELETE, "/groups/g/queue/b"),
                (second.epoch, EventType.PUT, "/groups/g/usage"),
                (second.epoch, EventType.PUT, "/groups/g/stats"),
            }, writes
            assert first.epoch < second.ticket < second.epoch
            return
        # Written before the Yield returned: the release, then b's grant (the driver may
        # claim the group between them; it finds nothing left to do).
        release = min(r for r, _, _ in writes)
        assert {(t, k) for r, t, k in writes if r == release} == {
            (EventType.DELETE, "/groups/g/holder"),
            (EventType.PUT, "/groups/g/usage"),
        }, writes
        grants = {r for r, t, k in writes if (t, k) == (EventType.PUT, "/groups/g/holder")}
        assert len(grants) == 1, writes
        grant = grants.pop()
        assert (grant, EventType.DELETE, "/groups/g/queue/b") in writes
        second = await waiter
        assert second.epoch == grant
        assert first.epoch < second.ticket < second.epoch


@HAND_OVER
async def test_a_grant_that_moves_nothing_leaves_the_residency_record_alone(
    cluster_factory: ClusterFactory, one_transaction: bool
) -> None:
    # No workers anywhere, so no grant changes whose state is where: after the first grant
    # wrote the (empty) residency record, neither an Acquire of the free group nor a Yield's
    # hand-over writes it again; each still compares it.
    cluster = cluster_factory(agents=0)
    await _deployment(cluster, one_transaction)
    async with raw_stub(cluster.target) as stub:
        a, a_secret = await _session(stub, "a")
        b, b_secret = await _session(stub, "b")
        first, writes = await _writes(
            cluster,
            lambda: _granted(
                stub, AcquireRequest(a, "a", "g", request_id="r", session_secret=a_secret)
            ),
        )
        assert (first.epoch, EventType.PUT, "/groups/g/resident") in writes
        await stub.yield_(YieldRequest(a, "a", "g", first.epoch, session_secret=a_secret))
        second, writes = await _writes(
            cluster,
            lambda: _granted(
                stub, AcquireRequest(b, "b", "g", request_id="s", session_secret=b_secret)
            ),
        )
        assert {k for _, _, k in writes} == {"/groups/g/holder", "/groups/g/stats"}, writes
        waiter = asyncio.create_task(
            _granted(stub, AcquireRequest(a, "a", "g", request_id="t", session_secret=a_secret))
        )
        await _until_queued(stub)
        _, writes = await _writes(
            cluster,
            lambda: stub.yield_(YieldRequest(b, "b", "g", second.epoch, session_secret=b_secret)),
        )
        third = await waiter
        # The hand-over's own transaction also carries b's time into the ledger.
        ledger = {"/groups/g/usage"} if one_transaction else set()
        assert {k for r, _, k in writes if r == third.epoch} == {
            "/groups/g/holder",
            "/groups/g/queue/a",
            "/groups/g/stats",
            *ledger,
        }, writes
    client = etcd_client(cluster)
    try:
        resident = await client.get(f"{cluster.prefix}/groups/g/resident".encode())
    finally:
        await client.close()
    assert resident is not None and resident.mod_revision == first.epoch
