"""Placement pools in a real etcd (store/pools.py): create, compared writes, the bounded audit."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from timeslice.errors import NotFound
from timeslice_orchestrator.store import pools as pools_module
from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.pools import PoolChange, PoolState, PoolStore
from timeslice_orchestrator.store.records import (
    AuditEntryRecord,
    DeclaredProfile,
    PoolAssignmentsRecord,
    RoleAssignment,
)


def _store(etcd: EtcdClient) -> PoolStore:
    return PoolStore(etcd, Keyspace(f"/test-pools-{uuid.uuid4().hex[:8]}"))


def _assign(group: str) -> RoleAssignment:
    profile = DeclaredProfile(0.3, 10.0, 0.5, "sync", 0.0, "declared")
    return RoleAssignment(group, "placed", "test", profile, 1.0, "r0")


async def test_create_read_and_recreate_keeps_rules(etcd: EtcdClient) -> None:
    store = _store(etcd)
    assert await store.read("p") is None
    with pytest.raises(NotFound):
        await store.update("p", lambda s: PoolChange())
    created = await store.create("p", ["g1", "g2"], 0.8, "r0")
    assert created.config.groups == ["g1", "g2"] and created.config.cap == 0.8
    read = await store.read("p")
    assert read is not None and read.revisions == created.revisions

    def drain(state: PoolState | None) -> PoolChange:
        assert state is not None
        config = state.config
        config.drained = ["g2"]
        return PoolChange(config=config, audit=[AuditEntryRecord(at=2.0, what="rule:drain")])

    await store.update("p", drain)
    again = await store.create("p", ["g1", "g2", "g3"], 0.9, "r0")
    assert again.config.drained == ["g2"] and again.config.groups == ["g1", "g2", "g3"]
    assert [e.what for e in again.audit.entries] == ["pool", "rule:drain", "pool"]
    assert await store.pools() == ["p"]


async def test_concurrent_writers_never_lose_an_assignment(etcd: EtcdClient) -> None:
    """Each writer adds its job to what it read; a write made from a stale read fails its
    compare and is made again, so every job is there at the end (a blind put would drop
    some)."""
    store = _store(etcd)
    await store.create("p", ["g1"], 0.9, "r0")
    jobs = [f"job-{n}" for n in range(12)]

    async def add(job: str) -> None:
        def change(state: PoolState | None) -> PoolChange:
            assert state is not None
            current = {j: dict(r) for j, r in state.assignments.jobs.items()}
            current[job] = {"main": _assign("g1")}
            return PoolChange(
                assignments=PoolAssignmentsRecord(current),
                audit=[AuditEntryRecord(at=1.0, what="placed", job=job)],
            )

        await store.update("p", change)

    await asyncio.gather(*(add(j) for j in jobs))
    state = await store.read("p")
    assert state is not None
    assert sorted(state.assignments.jobs) == sorted(jobs)
    assert sorted(e.job for e in state.audit.entries if e.what == "placed") == sorted(jobs)


async def test_the_audit_keeps_the_last_entries(
    etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pools_module, "AUDIT_KEPT", 5)
    store = _store(etcd)
    await store.create("p", ["g1"], 0.9, "r0")
    for n in range(8):
        entry = AuditEntryRecord(at=float(n), what="placed", job=f"j{n}")

        def append(state: PoolState | None, entry: AuditEntryRecord = entry) -> PoolChange:
            return PoolChange(audit=[entry])

        await store.update("p", append)
    state = await store.read("p")
    assert state is not None
    assert [e.job for e in state.audit.entries] == ["j3", "j4", "j5", "j6", "j7"]


async def test_an_empty_change_writes_nothing(etcd: EtcdClient) -> None:
    store = _store(etcd)
    created = await store.create("p", ["g1"], 0.9, "r0")
    state, made = await store.update("p", lambda s: PoolChange())
    assert made.empty and state.revisions == created.revisions
