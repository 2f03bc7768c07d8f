"""Helpers of the group-store tests: a store on its own key prefix, and the steps the
orchestrator takes with it (a client's session and Acquire, a driver's claim and grant)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from timeslice_orchestrator.store.etcd import EtcdClient, KeyValue
from timeslice_orchestrator.store.groups import (
    Authority,
    Enqueued,
    EnqueueRequest,
    Grant,
    GroupStore,
)
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import (
    GroupStats,
    HolderRecord,
    QueuedJob,
    QueueRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    SwitchRecord,
)


@asynccontextmanager
async def group_store(endpoint: str) -> AsyncIterator[GroupStore]:
    """A store on a key prefix of its own, on the shared etcd."""
    etcd = EtcdClient([endpoint])
    try:
        yield GroupStore(etcd, Keyspace(f"/test/{uuid.uuid4().hex}"))
    finally:
        await etcd.close()


async def snapshot(store: GroupStore) -> dict[str, KeyValue]:
    """Every key of the store's prefix, by its name under the prefix, but the beacon (a
    mirror's check of its own watch, not the store's state)."""
    _, kvs = await store.etcd.get_prefix(store.keys.root)
    beacon = store.keys.beacon()
    return {
        kv.key.decode().removeprefix(f"{store.keys.prefix}/"): kv for kv in kvs if kv.key != beacon
    }


async def open_session(store: GroupStore, job: str, ttl: int = 30) -> Stored[SessionRecord]:
    return await store.session(await store.open_session(job, ttl, "host", 1))


def sid(session: Stored[SessionRecord]) -> str:
    return f"{session.lease:016x}"


async def enqueue(
    store: GroupStore,
    session: Stored[SessionRecord],
    group: str = "g",
    *,
    request_id: str = "",
    attempt: str = "first",
) -> Enqueued:
    return await store.enqueue(EnqueueRequest(session, sid(session), group, 0, request_id, attempt))


async def queued(store: GroupStore, group: str, job: str) -> QueuedJob:
    """The job's queue entry as a driver reads it."""
    kv = await store.etcd.get(store.keys.queue_entry(group, job))
    assert kv is not None, f"{job} is not queued for {group}"
    return QueuedJob(job, Stored.of(kv, QueueRecord.decode(kv.value)))


async def holder(store: GroupStore, group: str = "g") -> Stored[HolderRecord] | None:
    kv = await store.etcd.get(store.keys.holder(group))
    return Stored.of(kv, HolderRecord.decode(kv.value)) if kv else None


async def driver(store: GroupStore, group: str = "g", name: str = "r1", ttl: int = 30) -> Authority:
    """A replica incarnation (its own lease) that claimed the group's driver key."""
    auth = Authority(name, await store.etcd.grant_lease(ttl))
    assert await store.claim_driver(group, auth)
    return auth


async def resident_revision(store: GroupStore, group: str = "g") -> int:
    kv = await store.etcd.get(store.keys.resident(group))
    return kv.mod_revision if kv else 0


def new_holder(waiter: QueuedJob) -> HolderRecord:
    """The hold a grant to ``waiter`` writes (as the driver builds it)."""
    entry = waiter.entry.record
    now = time.time()
    return HolderRecord(
        job=waiter.job,
        session=entry.session,
        granted_at=now,
        waited_seconds=now - entry.enqueued_at,
        request_id=entry.request_id,
        attempt=entry.attempt,
        ticket=waiter.revision,
    )


async def grant(
    store: GroupStore,
    auth: Authority,
    job: str,
    group: str = "g",
    *,
    switch: Stored[SwitchRecord] | None = None,
    waiter: QueuedJob | None = None,
) -> int | None:
    """Grant ``group`` to ``job`` (its entry as read now, unless given) in place or after
    ``switch``; the job's state ends up resident on node n0."""
    waiter = waiter or await queued(store, group, job)
    return await store.grant(
        auth,
        Grant(
            group,
            waiter,
            new_holder(waiter),
            ResidentRecord({"n0": [job]}),
            await resident_revision(store, group),
            GroupStats(grants=1),
            switch,
        ),
    )
