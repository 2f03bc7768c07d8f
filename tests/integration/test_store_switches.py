"""The group store's driver transactions against a real etcd: the driver claim, switch
records, grants, giving up on a waiter, and what a stale replica can no longer write."""

from __future__ import annotations

import time

import pytest

from tests.integration.groupstore import (
    driver,
    enqueue,
    grant,
    holder,
    new_holder,
    open_session,
    queued,
    resident_revision,
    snapshot,
)
from timeslice_orchestrator.store.groups import (
    Authority,
    Fault,
    Grant,
    GroupStore,
    new_switch_id,
)
from timeslice_orchestrator.store.records import (
    FaultRecord,
    FenceRecord,
    GroupStats,
    HolderRecord,
    NodeStep,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
)


def _switch(to_job: str, to_revision: int, *, prefetch: bool = False) -> SwitchRecord:
    return SwitchRecord(
        switch_id=new_switch_id(),
        group="g",
        to_job=to_job,
        to_revision=to_revision,
        steps=[NodeStep(node="n0", evict="a", restore=to_job)],
        phase=SwitchPhase.CHECKPOINT,
        driver="r1",
        started_at=time.time(),
        prefetch=prefetch,
    )


async def _begin(store: GroupStore, auth: Authority, job: str) -> Stored[SwitchRecord]:
    waiter = await queued(store, "g", job)
    switch = await store.begin_switch(
        "g", auth, _switch(job, waiter.revision), await resident_revision(store)
    )
    assert switch is not None
    return switch


# -- the driver key ---------------------------------------------------------------------------


async def test_one_replica_incarnation_drives_a_group(store: GroupStore) -> None:
    first = Authority("r1", await store.etcd.grant_lease(30))
    assert await store.claim_driver("g", first)
    assert await store.claim_driver("g", first)  # staying the driver
    kv = (await snapshot(store))["groups/g/driver"]
    assert (kv.value, kv.lease) == (b"r1", first.lease)
    # Another replica, or the same name restarted (a new lease), does not drive.
    assert not await store.claim_driver("g", Authority("r2", await store.etcd.grant_lease(30)))
    assert not await store.claim_driver("g", Authority("r1", await store.etcd.grant_lease(30)))
    # The claim goes with the lease; then another replica takes over.
    await store.etcd.revoke_lease(first.lease)
    assert await store.claim_driver("g", Authority("r2", await store.etcd.grant_lease(30)))


# -- grants -----------------------------------------------------------------------------------


async def test_a_grant_in_place_commits_holder_queue_residency_and_stats(
    store: GroupStore,
) -> None:
    session = await open_session(store, "a")
    enqueued = await enqueue(store, session, request_id="r1", attempt="t1")
    epoch = await grant(store, await driver(store), "a")
    assert epoch is not None
    keys = await snapshot(store)
    hold = keys["groups/g/holder"]
    assert hold.create_revision == epoch  # the epoch is the holder key's create revision
    assert hold.lease == session.lease  # the hold goes with the holder's session
    record = HolderRecord.decode(hold.value)
    assert (record.job, record.request_id, record.attempt) == ("a", "r1", "t1")
    assert record.ticket == enqueued.entry_revision
    assert "groups/g/queue/a" not in keys
    assert ResidentRecord.decode(keys["groups/g/resident"].value).nodes == {"n0": ["a"]}
    assert GroupStats.decode(keys["groups/g/stats"].value).grants == 1


async def test_a_grant_needs_the_group_free_and_the_entry_as_read(store: GroupStore) -> None:
    auth = await driver(store)
    a, b = await open_session(store, "a"), await open_session(store, "b")
    await enqueue(store, a)
    await enqueue(store, b)
    read = await queued(store, "g", "b")
    assert await grant(store, auth, "a") is not None
    assert await grant(store, auth, "b") is None, "granted while a holds the group"
    await store.etcd.delete(store.keys.holder("g"))  # a yields
    await enqueue(store, b, attempt="again")  # b re-attached since the driver read its entry
    assert await grant(store, auth, "b", waiter=read) is None
    assert await grant(store, auth, "b") is not None


async def test_a_grant_needs_the_residency_as_read(store: GroupStore) -> None:
    auth = await driver(store)
    await enqueue(store, await open_session(store, "a"))
    await store.etcd.put(store.keys.resident("g"), ResidentRecord({"n0": ["x"]}).encode())
    waiter = await queued(store, "g", "a")
    stale = Grant("g", waiter, new_holder(waiter), ResidentRecord(), 0, GroupStats())
    assert await store.grant(auth, stale) is None
    assert await holder(store) is None


async def test_a_grant_without_the_driver_role_needs_the_stats_as_read(store: GroupStore) -> None:
    # What a yield does to hand the group over at once: no driver key, but the stats (which
    # the driver writes) must be as read, so the grant cannot overwrite the driver's writes.
    await enqueue(store, await open_session(store, "a"))
    waiter = await queued(store, "g", "a")
    stats = await store.etcd.get(store.keys.stats("g"))
    seen = stats.mod_revision if stats else 0

    def handing_over(stats_revision: int | None) -> Grant:
        holder = new_holder(waiter)
        return Grant("g", waiter, holder, ResidentRecord(), 0, GroupStats(), None, stats_revision)

    with pytest.raises(ValueError):
        await store.grant(None, handing_over(None))
    assert await store.grant(None, handing_over(seen + 1000)) is None
    assert await holder(store) is None
    epoch = await store.grant(None, handing_over(seen))
    assert epoch is not None
    held = await holder(store)
    assert held is not None and held.create_revision == epoch and held.record.job == "a"


# -- switches ---------------------------------------------------------------------------------


async def test_a_switch_is_begun_advanced_and_committed(store: GroupStore) -> None:
    auth = await driver(store)
    await enqueue(store, await open_session(store, "b"))
    switch = await _begin(store, auth, "b")
    keys = await snapshot(store)
    assert keys["groups/g/switch"].create_revision == switch.create_revision
    assert SwitchRecord.decode(keys["groups/g/switch"].value).phase is SwitchPhase.CHECKPOINT
    # Only one switch at a time.
    assert await store.begin_switch("g", auth, _switch("b", 1), 0) is None
    moved = await store.update_switch("g", auth, switch, SwitchPhase.RESTORE)
    assert moved is not None
    assert moved.create_revision == switch.create_revision  # the switch's epoch stays
    assert moved.mod_revision > switch.mod_revision
    stored = SwitchRecord.decode((await snapshot(store))["groups/g/switch"].value)
    assert stored.phase is SwitchPhase.RESTORE
    # The commit must name the switch as it is now: an older copy fails.
    assert await grant(store, auth, "b", switch=switch) is None
    epoch = await grant(store, auth, "b", switch=moved)
    assert epoch is not None and epoch > moved.create_revision
    keys = await snapshot(store)
    assert "groups/g/switch" not in keys and "groups/g/queue/b" not in keys
    assert HolderRecord.decode(keys["groups/g/holder"].value).job == "b"


async def test_a_grant_in_place_is_refused_while_a_switch_runs(store: GroupStore) -> None:
    auth = await driver(store)
    await enqueue(store, await open_session(store, "b"))
    await _begin(store, auth, "b")
    assert await grant(store, auth, "b") is None


async def test_a_stale_copy_of_the_switch_cannot_advance_it(store: GroupStore) -> None:
    auth = await driver(store)
    await enqueue(store, await open_session(store, "b"))
    switch = await _begin(store, auth, "b")
    copy = Stored(
        SwitchRecord.decode(switch.record.encode()),
        switch.create_revision,
        switch.mod_revision,
        switch.lease,
    )
    assert await store.update_switch("g", auth, switch, SwitchPhase.RESTORE) is not None
    assert await store.update_switch("g", auth, copy, SwitchPhase.ROLLBACK) is None
    stored = SwitchRecord.decode((await snapshot(store))["groups/g/switch"].value)
    assert stored.phase is SwitchPhase.RESTORE


async def test_a_switch_needs_the_group_free_and_a_prefetch_names_the_holder(
    store: GroupStore,
) -> None:
    auth = await driver(store)
    await enqueue(store, await open_session(store, "a"))
    await grant(store, auth, "a")
    await enqueue(store, await open_session(store, "b"))
    waiter = await queued(store, "g", "b")
    revision = await resident_revision(store)
    assert await store.begin_switch("g", auth, _switch("b", waiter.revision), revision) is None
    hold = await holder(store)
    assert hold is not None
    record = _switch("b", waiter.revision, prefetch=True)
    prefetch = await store.begin_switch("g", auth, record, revision, hold.mod_revision)
    assert prefetch is not None and prefetch.record.prefetch


async def test_ending_a_switch_keeps_the_waiter_or_gives_up_on_it(store: GroupStore) -> None:
    auth = await driver(store)
    b = await open_session(store, "b")
    await enqueue(store, b)
    switch = await _begin(store, auth, "b")
    stats = GroupStats(last_error="rolled back")
    resident = ResidentRecord({"n0": ["a"]})
    assert await store.end_switch("g", auth, switch, resident, stats)
    keys = await snapshot(store)
    assert "groups/g/switch" not in keys
    assert "groups/g/queue/b" in keys  # an aborted switch keeps its waiter in line
    assert ResidentRecord.decode(keys["groups/g/resident"].value).nodes == {"n0": ["a"]}
    assert GroupStats.decode(keys["groups/g/stats"].value).last_error == "rolled back"
    # A failed restore gives up on the waiter: the entry goes, a fault record says why.
    switch = await _begin(store, auth, "b")
    waiter = await queued(store, "g", "b")
    assert await store.end_switch(
        "g", auth, switch, resident, stats, Fault(waiter, "restore failed")
    )
    keys = await snapshot(store)
    assert "groups/g/queue/b" not in keys and "groups/g/switch" not in keys
    fault = keys["groups/g/faulted/b"]
    assert FaultRecord.decode(fault.value).reason == "restore failed"
    assert fault.lease == b.lease  # it goes with the waiter's session
    # The fault record is cleared when the job queues again.
    await enqueue(store, b)
    assert "groups/g/faulted/b" not in await snapshot(store)


async def test_ending_a_switch_cannot_undo_a_fence(store: GroupStore) -> None:
    """A node fenced out while the switch ran stays unknown: the end computed from the
    residency as read before the fence is refused, and the next try reads the fence."""
    auth = await driver(store)
    await store.etcd.put(
        store.keys.resident("g"), ResidentRecord({"n0": ["a"], "n1": ["a"]}).encode()
    )
    b = await open_session(store, "b")
    await enqueue(store, b)
    switch = await _begin(store, auth, "b")
    read = await resident_revision(store)
    await store.fence_node("n1", FenceRecord("silent", 1.0, "r2", ["g"]))
    stale = ResidentRecord({"n0": ["a"], "n1": ["a"]})
    stats = GroupStats(last_error="rolled back")
    assert not await store.end_switch("g", auth, switch, stale, stats, resident_revision=read)
    assert "groups/g/switch" in await snapshot(store)
    fresh = await resident_revision(store)
    resident = ResidentRecord({"n0": ["a"]})
    assert await store.end_switch("g", auth, switch, resident, stats, resident_revision=fresh)
    keys = await snapshot(store)
    assert ResidentRecord.decode(keys["groups/g/resident"].value).nodes == {"n0": ["a"]}


async def test_giving_up_on_a_waiter_names_the_entry_it_decided_on(store: GroupStore) -> None:
    auth = await driver(store)
    b = await open_session(store, "b")
    await enqueue(store, b)
    waiter = await queued(store, "g", "b")
    stats = GroupStats(last_error="gave up")
    # The waiter left and queued again: a new entry, a new place in line.
    await store.etcd.delete(store.keys.queue_entry("g", "b"))
    await enqueue(store, b)
    assert not await store.fault_waiter("g", auth, Fault(waiter, "too many tries"), stats)
    assert "groups/g/faulted/b" not in await snapshot(store)
    current = await queued(store, "g", "b")
    assert await store.fault_waiter("g", auth, Fault(current, "too many tries"), stats)
    keys = await snapshot(store)
    assert "groups/g/queue/b" not in keys
    assert FaultRecord.decode(keys["groups/g/faulted/b"].value).reason == "too many tries"
    assert keys["groups/g/faulted/b"].lease == b.lease
    assert GroupStats.decode(keys["groups/g/stats"].value).last_error == "gave up"


# -- a stale replica --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["lease expired", "another incarnation"])
async def test_a_stale_driver_cannot_write(store: GroupStore, how: str) -> None:
    """A driver whose claim is stale (its lease ran out, or it is a previous incarnation of
    a replica that has since restarted) fails every compare, and writes nothing."""
    stale = await driver(store, name="r1", ttl=30)
    await enqueue(store, await open_session(store, "a"))
    await enqueue(store, await open_session(store, "b"))
    switch = await _begin(store, stale, "a")
    waiter = await queued(store, "g", "b")
    if how == "lease expired":
        await store.etcd.revoke_lease(stale.lease)  # what running out of TTL does
        assert await store.claim_driver("g", Authority("r2", await store.etcd.grant_lease(30)))
    else:
        await store.etcd.delete(store.keys.driver("g"))
        assert await store.claim_driver("g", Authority("r1", await store.etcd.grant_lease(30)))
    before = await snapshot(store)
    resident, stats = ResidentRecord({"n0": ["x"]}), GroupStats(last_error="zombie")
    assert await store.update_switch("g", stale, switch, SwitchPhase.RESTORE) is None
    assert await grant(store, stale, "a", switch=switch) is None
    assert not await store.end_switch("g", stale, switch, resident, stats)
    assert not await store.end_switch("g", stale, switch, resident, stats, Fault(waiter, "zombie"))
    assert not await store.fault_waiter("g", stale, Fault(waiter, "zombie"), stats)
    await store.etcd.delete(store.keys.switch("g"))
    before = {k: v for k, v in before.items() if k != "groups/g/switch"}
    assert await store.begin_switch("g", stale, _switch("a", 1), 0) is None
    assert await grant(store, stale, "a") is None
    assert await snapshot(store) == before
