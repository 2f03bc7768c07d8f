"""The group store's queue and hold transactions (store/queue.py: enqueue, withdraw, release,
a free group taken at once) against a real etcd.

Each test drives one transaction the way the orchestrator does and then reads etcd directly:
what it wrote, on which lease, and what a compare that should fail left untouched.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.integration.groupstore import (
    driver,
    enqueue,
    grant,
    holder,
    open_session,
    sid,
    snapshot,
)
from timeslice.errors import (
    AlreadyExists,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
)
from timeslice_orchestrator.store.etcd import EtcdClient, KeyValue
from timeslice_orchestrator.store.groups import (
    Authority,
    EnqueueRequest,
    FreeGroup,
    GroupStore,
    Hold,
)
from timeslice_orchestrator.store.records import (
    FaultRecord,
    GroupStats,
    Hint,
    HolderRecord,
    QueueRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    UsageRecord,
)

# -- enqueue ----------------------------------------------------------------------------------


async def test_enqueue_creates_the_group_and_an_entry_on_the_session_lease(
    store: GroupStore,
) -> None:
    session = await open_session(store, "a")
    await store.etcd.put(store.keys.fault("g", "a"), FaultRecord("old", 1.0).encode())
    enqueued = await enqueue(store, session, request_id="r1", attempt="t1")
    assert not enqueued.reattached
    assert enqueued.entry_revision == enqueued.revision
    keys = await snapshot(store)
    assert set(keys) == {f"sessions/{sid(session)}", "groups/g/meta", "groups/g/queue/a"}
    entry = keys["groups/g/queue/a"]
    assert entry.lease == session.lease
    assert entry.create_revision == enqueued.entry_revision
    assert entry.value == enqueued.entry_value
    record = QueueRecord.decode(entry.value)
    assert (record.session, record.request_id, record.attempt) == (sid(session), "r1", "t1")


async def test_enqueue_again_reattaches_to_the_entry_and_keeps_the_place(
    store: GroupStore,
) -> None:
    a, b = await open_session(store, "a"), await open_session(store, "b")
    first = await enqueue(store, a, attempt="t1")
    await enqueue(store, b)
    again = await enqueue(store, a, attempt="t2")
    assert again.reattached
    assert again.entry_revision == first.entry_revision  # still ahead of b
    assert again.revision > first.revision
    entry = (await snapshot(store))["groups/g/queue/a"]
    assert entry.create_revision == first.entry_revision
    assert entry.lease == a.lease
    assert entry.value == again.entry_value
    assert QueueRecord.decode(entry.value).attempt == "t2"


async def test_the_same_job_cannot_wait_in_two_sessions(store: GroupStore) -> None:
    await enqueue(store, await open_session(store, "a"))
    before = await snapshot(store)
    with pytest.raises(AlreadyExists, match="another session"):
        await enqueue(store, await open_session(store, "a"))
    after = await snapshot(store)
    assert after["groups/g/queue/a"] == before["groups/g/queue/a"]


async def test_an_expired_session_cannot_enqueue(store: GroupStore) -> None:
    session = await open_session(store, "a")
    await store.close_session(sid(session))
    with pytest.raises(SessionExpired):
        await enqueue(store, session)  # the record as read before it expired
    assert await snapshot(store) == {}


async def test_a_retry_of_the_granted_call_reattaches_to_the_grant(store: GroupStore) -> None:
    session = await open_session(store, "a")
    first = await enqueue(store, session, request_id="r1", attempt="t1")
    epoch = await grant(store, await driver(store), "a")
    assert epoch is not None
    again = await enqueue(store, session, request_id="r1", attempt="t2")
    assert again.reattached
    assert again.entry_revision == first.entry_revision  # the grant's ticket: its place in line
    assert again.entry_value == b""
    hold = await holder(store)
    assert hold is not None
    assert hold.create_revision == epoch  # the same grant, the same epoch
    assert hold.lease == session.lease
    assert (hold.record.attempt, hold.record.ticket) == ("t2", first.entry_revision)
    assert "groups/g/queue/a" not in await snapshot(store)


async def test_the_holder_cannot_enqueue_except_as_a_retry_of_its_call(
    store: GroupStore,
) -> None:
    session = await open_session(store, "a")
    await enqueue(store, session, request_id="r1")
    await grant(store, await driver(store), "a")
    with pytest.raises(AlreadyExists, match="already holds"):
        await enqueue(store, session, request_id="r2")
    with pytest.raises(AlreadyExists, match="already holds"):
        await enqueue(store, session)
    other = await open_session(store, "a")
    with pytest.raises(AlreadyExists, match="already holds"):
        await enqueue(store, other, request_id="r1")


class _CountingReads(EtcdClient):
    """A client that counts single-key reads (what a hint is there to save)."""

    reads = 0

    async def get(self, key: bytes, *, revision: int = 0) -> KeyValue | None:
        self.reads += 1
        return await super().get(key, revision=revision)


async def _counting(store: GroupStore) -> GroupStore:
    return GroupStore(_CountingReads(store.etcd.endpoints), store.keys)


async def test_a_hint_saves_the_holder_read_and_no_hint_reads_it(store: GroupStore) -> None:
    counting = await _counting(store)
    try:
        a, b = await open_session(store, "a"), await open_session(store, "b")
        await counting.enqueue(EnqueueRequest(a, sid(a), "g", 0), Hint(None))
        assert counting.etcd.reads == 0  # type: ignore[attr-defined]
        await counting.enqueue(EnqueueRequest(b, sid(b), "g", 0))
        assert counting.etcd.reads == 1  # type: ignore[attr-defined]
    finally:
        await counting.etcd.close()


async def test_a_stale_hint_costs_a_retry_never_a_wrong_answer(store: GroupStore) -> None:
    a, b = await open_session(store, "a"), await open_session(store, "b")
    await enqueue(store, a)
    await grant(store, await driver(store), "a")
    # A mirror that has not seen a's grant yet: "nobody holds the group".
    enqueued = await store.enqueue(EnqueueRequest(b, sid(b), "g", 0), Hint(None))
    assert not enqueued.reattached
    assert "groups/g/queue/b" in await snapshot(store)
    # A mirror that still shows a as the holder after a yielded: a decides on a fresh read.
    seen = await holder(store)
    hold = Hold("g", "a", seen.create_revision if seen else 0, sid(a))
    await store.release(hold)
    again = await store.enqueue(EnqueueRequest(a, sid(a), "g", 0), Hint(seen))
    assert not again.reattached
    assert "groups/g/queue/a" in await snapshot(store)


# -- withdraw ---------------------------------------------------------------------------------


async def test_withdraw_drops_the_entry(store: GroupStore) -> None:
    enqueued = await enqueue(store, await open_session(store, "a"))
    assert await store.withdraw(enqueued) is False
    assert "groups/g/queue/a" not in await snapshot(store)


async def test_withdraw_leaves_an_entry_a_later_attempt_reattached_to(store: GroupStore) -> None:
    session = await open_session(store, "a")
    abandoned = await enqueue(store, session, attempt="t1")
    await enqueue(store, session, attempt="t2")  # the client moved to another replica
    assert await store.withdraw(abandoned) is False
    entry = (await snapshot(store))["groups/g/queue/a"]
    assert QueueRecord.decode(entry.value).attempt == "t2"


async def test_withdraw_gives_back_a_grant_that_raced_the_exit(store: GroupStore) -> None:
    enqueued = await enqueue(store, await open_session(store, "a"))
    assert await grant(store, await driver(store), "a") is not None
    assert await store.withdraw(enqueued) is True
    assert await holder(store) is None


async def test_withdraw_leaves_a_grant_a_later_attempt_reattached_to(store: GroupStore) -> None:
    session = await open_session(store, "a")
    abandoned = await enqueue(store, session, request_id="r1", attempt="t1")
    epoch = await grant(store, await driver(store), "a")
    await enqueue(store, session, request_id="r1", attempt="t2")
    assert await store.withdraw(abandoned) is False
    hold = await holder(store)
    assert hold is not None and hold.create_revision == epoch


async def test_an_undelivered_grant_goes_back_only_while_its_attempt_holds_it(
    store: GroupStore,
) -> None:
    """A call's stream ends as its grant is sent: the grant goes back, unless the client has
    re-attached to it through another replica meanwhile (it re-stamped the hold)."""
    session = await open_session(store, "a")
    await enqueue(store, session, request_id="r1", attempt="t1")
    epoch = await grant(store, await driver(store), "a")
    assert epoch is not None
    await enqueue(store, session, request_id="r1", attempt="t2")  # the client moved
    hold = Hold("g", "a", epoch, sid(session))
    assert await store.release_undelivered(hold, "t1") is None
    assert (held := await holder(store)) is not None and held.create_revision == epoch
    assert await store.release_undelivered(hold, "t2") is not None
    assert await holder(store) is None
    assert await store.release_undelivered(hold, "t2") is None  # gone already


async def test_withdraw_leaves_a_grant_older_than_its_entry(store: GroupStore) -> None:
    """Only a grant made after this attempt queued can have served it."""
    enqueued = await enqueue(store, await open_session(store, "a"))
    epoch = await grant(store, await driver(store), "a")
    assert epoch is not None
    later = dataclasses.replace(enqueued, entry_revision=epoch + 1)
    assert await store.withdraw(later) is False
    assert await holder(store) is not None


async def test_withdraw_leaves_another_sessions_grant(store: GroupStore) -> None:
    a = await open_session(store, "a")
    enqueued = await enqueue(store, a)
    auth = await driver(store)
    assert await store.withdraw(enqueued) is False
    await store.close_session(sid(a))
    # The same job, through a new session, waits and is granted: not the withdrawn call's.
    await enqueue(store, await open_session(store, "a"), attempt=enqueued.attempt)
    assert await grant(store, auth, "a") is not None
    assert await store.withdraw(enqueued) is False
    assert await holder(store) is not None


# -- release ----------------------------------------------------------------------------------


async def _held(store: GroupStore) -> tuple[Stored[SessionRecord], int, Authority]:
    session = await open_session(store, "a")
    await enqueue(store, session)
    auth = await driver(store)
    epoch = await grant(store, auth, "a")
    assert epoch is not None
    return session, epoch, auth


async def test_release_ends_the_hold_and_books_its_time(store: GroupStore) -> None:
    session, epoch, auth = await _held(store)
    await store.release(Hold("g", "a", epoch, sid(session)))
    keys = await snapshot(store)
    assert "groups/g/holder" not in keys
    ledger = UsageRecord.decode(keys["groups/g/usage"].value)
    assert ledger.jobs["a"].holds == 1
    assert ledger.jobs["a"].held_seconds >= 0
    # Any session of the job may give the hold back when it names none.
    other = await open_session(store, "a")
    await enqueue(store, other)
    next_epoch = await grant(store, auth, "a")
    assert next_epoch is not None
    await store.release(Hold("g", "a", next_epoch))
    ledger = UsageRecord.decode((await snapshot(store))["groups/g/usage"].value)
    assert ledger.jobs["a"].holds == 2


async def test_release_refuses_the_wrong_epoch_job_session_or_group(store: GroupStore) -> None:
    session, epoch, _ = await _held(store)
    before = await snapshot(store)
    with pytest.raises(NotHolder, match="epoch"):
        await store.release(Hold("g", "a", epoch - 1, sid(session)))
    with pytest.raises(PermissionDenied, match="another job"):
        await store.release(Hold("g", "b", epoch))
    with pytest.raises(PermissionDenied, match="another session"):
        await store.release(Hold("g", "a", epoch, sid(await open_session(store, "a"))))
    with pytest.raises(NotFound):
        await store.release(Hold("nope", "a", epoch))
    after = await snapshot(store)
    assert after["groups/g/holder"] == before["groups/g/holder"]
    await store.release(Hold("g", "a", epoch, sid(session)))
    with pytest.raises(NotHolder, match="nobody"):
        await store.release(Hold("g", "a", epoch, sid(session)))


async def test_release_with_stale_hints_is_still_exact(store: GroupStore) -> None:
    session, first, auth = await _held(store)
    old_hold = await holder(store)
    await store.release(Hold("g", "a", first, sid(session)))
    usage_kv = (await snapshot(store))["groups/g/usage"]
    stale_usage = Stored.of(usage_kv, UsageRecord.decode(usage_kv.value))
    await enqueue(store, session)
    second = await grant(store, auth, "a")
    assert second is not None
    await store.release(Hold("g", "a", second, sid(session)))  # the ledger moves on
    await enqueue(store, session)
    third = await grant(store, auth, "a")
    assert third is not None
    # The holder hint is of an older hold (ignored); the ledger hint lags one release.
    await store.release(Hold("g", "a", third, sid(session)), Hint(old_hold), Hint(stale_usage))
    keys = await snapshot(store)
    assert "groups/g/holder" not in keys
    assert UsageRecord.decode(keys["groups/g/usage"].value).jobs["a"].holds == 3


async def _restamped(store: GroupStore) -> tuple[Stored[SessionRecord], int, Stored[HolderRecord]]:
    """A hold, and the caller's copy of it from before a re-attach re-stamped it."""
    session, epoch, _ = await _held(store)
    hold = await holder(store)
    assert hold is not None
    assert await store.etcd.put(
        store.keys.holder("g"),
        dataclasses.replace(hold.record, attempt="later").encode(),
        lease=hold.lease,
    )
    return session, epoch, hold


async def test_a_yield_releases_a_hold_re_stamped_since_its_copy(store: GroupStore) -> None:
    """The yield's replica read the hold from a mirror that had not seen a re-attach yet (the
    client moved, re-attached to its grant, and yielded at once): the hold is still the
    job's, same epoch and session, and goes. (It used to be refused as "lost", and the group
    stayed held until the job's session ended.)"""
    session, epoch, stale = await _restamped(store)
    await store.release(Hold("g", "a", epoch, sid(session)), Hint(stale), Hint(None))
    assert await holder(store) is None


async def test_an_exact_release_loses_to_a_hold_re_stamped_underneath(store: GroupStore) -> None:
    """The give-back of an undelivered grant must not release a hold a later attempt of its
    call re-attached to between the check and the delete."""
    session, epoch, stale = await _restamped(store)
    with pytest.raises(NotHolder, match="lost its hold"):
        await store.release(
            Hold("g", "a", epoch, sid(session)), Hint(stale), Hint(None), exact=True
        )
    assert await holder(store) is not None


# -- a free group, granted in the Acquire transaction -------------------------------------------


def _free(
    ticket: int,
    *,
    resident_revision: int = 0,
    stats_revision: int = 0,
    members_revision: int = 0,
    grants: int = 1,
) -> FreeGroup:
    return FreeGroup(
        ticket=ticket,
        resident=ResidentRecord({"n0": ["a"]}),
        resident_revision=resident_revision,
        stats=GroupStats(grants=grants),
        stats_revision=stats_revision,
        members_revision=members_revision,
    )


async def test_a_free_group_is_granted_in_one_transaction(store: GroupStore) -> None:
    session = await open_session(store, "a")
    await store.etcd.put(store.keys.fault("g", "a"), FaultRecord("old", 1.0).encode())
    seen = await store.etcd.put(store.keys.fault("g", "x"), FaultRecord("other", 1.0).encode())
    request = EnqueueRequest(session, sid(session), "g", 0, "r1", "t1")
    taken = await store.take_free(request, _free(seen))
    assert taken is not None
    assert taken.epoch == taken.revision  # one write: the grant is the transaction
    assert taken.entry_revision == seen < taken.epoch
    keys = await snapshot(store)
    hold = keys["groups/g/holder"]
    assert hold.create_revision == taken.epoch
    assert hold.lease == session.lease
    record = HolderRecord.decode(hold.value)
    assert (record.job, record.session, record.request_id, record.attempt, record.ticket) == (
        "a",
        sid(session),
        "r1",
        "t1",
        seen,
    )
    assert (record.waited_seconds, record.restored, record.previous_job) == (0.0, False, "")
    assert ResidentRecord.decode(keys["groups/g/resident"].value).nodes == {"n0": ["a"]}
    assert GroupStats.decode(keys["groups/g/stats"].value).grants == 1
    assert "groups/g/meta" in keys
    assert "groups/g/faulted/a" not in keys and "groups/g/faulted/x" in keys
    assert not any(name.startswith("groups/g/queue/") for name in keys)
    # It is a grant like any other: yielded with its epoch, re-attached to by a retry.
    again = await enqueue(store, session, request_id="r1", attempt="t2")
    assert again.reattached and again.entry_revision == seen
    await store.release(Hold("g", "a", taken.epoch, sid(session)))
    assert "groups/g/holder" not in await snapshot(store)


async def test_a_group_no_longer_as_seen_is_not_taken(store: GroupStore) -> None:
    """Every compare of the one-transaction grant, each failing alone."""
    a, b = await open_session(store, "a"), await open_session(store, "b")
    auth = await driver(store)
    await enqueue(store, b)
    revision = await store.etcd.put(store.keys.meta("g"), b"{}")
    request = EnqueueRequest(a, sid(a), "g", 0)
    assert await store.take_free(request, _free(revision)) is None, "taken with b waiting"
    assert await grant(store, auth, "b") is not None
    keys = await snapshot(store)
    current = {
        "resident_revision": keys["groups/g/resident"].mod_revision,
        "stats_revision": keys["groups/g/stats"].mod_revision,
        "members_revision": 0,
    }
    assert await store.take_free(request, _free(revision, **current)) is None, "from a holder"
    hold = await holder(store)
    assert hold is not None
    await store.release(Hold("g", "b", hold.create_revision))  # leaves both as they are
    for name in current:  # a stale copy of the residency, the stats or the pinned members
        stale = {**current, name: current[name] - 1 if current[name] else 1}
        assert await store.take_free(request, _free(revision, **stale)) is None, name
    members = await store.set_members("g", ["n9"])
    assert await store.take_free(request, _free(revision, **current)) is None
    current["members_revision"] = members
    switch = await store.begin_switch(
        "g",
        auth,
        SwitchRecord("s1", "g", "a", 1, [], SwitchPhase.CHECKPOINT, "r1", 0.0),
        current["resident_revision"],
    )
    assert switch is not None
    assert await store.take_free(request, _free(revision, **current)) is None, "mid-switch"
    await store.etcd.delete(store.keys.switch("g"))
    await store.close_session(sid(a))
    assert await store.take_free(request, _free(revision, **current)) is None, "no session"
    assert "groups/g/holder" not in await snapshot(store)
    live = await open_session(store, "a")
    fresh = EnqueueRequest(live, sid(live), "g", 0)
    assert await store.take_free(fresh, _free(revision, **current)) is not None
