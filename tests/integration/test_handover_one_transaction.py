"""A yield that grants the next waiter in its own transaction (store.handover), on a real etcd.

The hand-over overwrites the holder key, so the new hold's epoch is the revision of that write
(``hold_epoch``), not the key's create revision; everything else a release and a grant write
lands in the same revision, and a stale read of any part of it changes nothing.
"""

from __future__ import annotations

import dataclasses
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
    sid,
    snapshot,
)
from timeslice.errors import NotHolder, PermissionDenied
from timeslice_orchestrator.store.groups import EnqueueRequest, Grant, GroupStore, Hold
from timeslice_orchestrator.store.handover import CURRENT_FEATURES
from timeslice_orchestrator.store.records import (
    FeaturesRecord,
    GroupStats,
    HolderRecord,
    SessionRecord,
    Stored,
    UsageRecord,
    hold_epoch,
)


async def _features(store: GroupStore) -> Stored[FeaturesRecord]:
    await store.set_features(CURRENT_FEATURES)
    features = await store.features()
    assert features is not None
    return features


async def _stats(store: GroupStore, group: str = "g") -> tuple[GroupStats, int]:
    kv = await store.etcd.get(store.keys.stats(group))
    assert kv is not None
    return GroupStats.decode(kv.value), kv.mod_revision


async def _usage(store: GroupStore, group: str = "g") -> Stored[UsageRecord] | None:
    kv = await store.etcd.get(store.keys.usage(group))
    return Stored.of(kv, UsageRecord.decode(kv.value)) if kv else None


async def _to_next(store: GroupStore, job: str, group: str = "g") -> Grant:
    """The grant in place of ``job``'s queue entry, as a yielding replica builds it."""
    waiter = await queued(store, group, job)
    stats, stats_revision = await _stats(store, group)
    kv = await store.etcd.get(store.keys.resident(group))
    return Grant(
        group,
        waiter,
        new_holder(waiter),
        None,
        kv.mod_revision if kv else 0,
        dataclasses.replace(stats, grants=stats.grants + 1),
        stats_revision=stats_revision,
    )


def _request(
    session: Stored[SessionRecord], session_id: str, request_id: str, attempt: str
) -> EnqueueRequest:
    return EnqueueRequest(session, session_id, "g", 0, request_id, attempt)


async def _held(store: GroupStore, group: str = "g") -> Stored[HolderRecord]:
    hold = await holder(store, group)
    assert hold is not None
    return hold


async def _hand_over(
    store: GroupStore, hold: Hold, to: str, features: Stored[FeaturesRecord] | None = None
) -> int | None:
    return await store.hand_over(
        hold,
        await _held(store, hold.group),
        await _usage(store, hold.group),
        await _to_next(store, to, hold.group),
        features or await _features(store),
    )


async def _a_holds_and_b_waits(store: GroupStore) -> tuple[Hold, str]:
    """a holds g (granted by a driver), b waits; returns a's hold and b's session id."""
    a, b = await open_session(store, "a"), await open_session(store, "b")
    await enqueue(store, a)
    epoch = await grant(store, await driver(store), "a")
    assert epoch is not None
    await enqueue(store, b, request_id="b-call")
    return Hold("g", "a", epoch, sid(a)), sid(b)


async def test_start_features_writes_only_on_an_empty_keyspace(store: GroupStore) -> None:
    assert await store.features() is None
    assert await store.start_features()
    stored = await store.features()
    assert stored is not None and stored.record == CURRENT_FEATURES
    assert stored.record.one_transaction_hand_over
    # A second replica of the new deployment, or a restart: written already.
    assert not await store.start_features()


async def test_an_upgraded_deployment_gets_no_features_at_start(store: GroupStore) -> None:
    # Keys an older version wrote (here a session): its replicas may still be running.
    await open_session(store, "a")
    assert not await store.start_features()
    assert await store.features() is None


async def test_a_hand_over_is_one_write_of_the_hold_and_the_rest_in_one_revision(
    store: GroupStore,
) -> None:
    a_hold, b_session = await _a_holds_and_b_waits(store)
    features = await _features(store)
    before = await _held(store)
    epoch = await _hand_over(store, a_hold, "b", features)
    assert epoch is not None and epoch > a_hold.epoch

    hold = await _held(store)
    assert hold.record.job == "b" and hold.record.session == b_session
    assert hold.record.handed_over
    # The key was overwritten, not deleted: its create revision is still a's epoch.
    assert hold.create_revision == a_hold.epoch and hold.mod_revision == epoch
    assert hold_epoch(hold) == epoch
    assert hold.lease != before.lease  # now attached to b's session
    keys = await snapshot(store)
    assert "groups/g/queue/b" not in keys
    assert keys["groups/g/usage"].mod_revision == epoch
    assert "a" in UsageRecord.decode(keys["groups/g/usage"].value).jobs
    assert keys["groups/g/stats"].mod_revision == epoch
    # Just before, the key was a's hold: there was never a revision without a hold.
    was = await store.etcd.get(store.keys.holder("g"), revision=epoch - 1)
    assert was is not None and HolderRecord.decode(was.value).job == "a"


@pytest.mark.parametrize("moved", ["features", "hold", "waiter", "usage"])
async def test_a_hand_over_whose_reads_moved_changes_nothing(store: GroupStore, moved: str) -> None:
    a_hold, _ = await _a_holds_and_b_waits(store)
    features = await _features(store)
    current, usage = await _held(store), await _usage(store)
    to_b = await _to_next(store, "b")
    k = store.keys
    if moved == "features":  # an operator switched it off (or on again) meanwhile
        await store.set_features(FeaturesRecord())
    elif moved == "hold":  # re-stamped by a re-attach of a's call
        await store.etcd.put(k.holder("g"), current.record.encode(), lease=current.lease)
    elif moved == "waiter":  # b's entry re-stamped by a re-attach of b's call
        b_session = to_b.waiter.entry.record.session
        await store.enqueue(_request(await store.session(b_session), b_session, "", "2"))
    else:  # another yield's time went into the ledger
        ledger = UsageRecord()
        ledger.add("c", time.time() - 1, time.time())
        await store.etcd.put(k.usage("g"), ledger.encode())
    before = await snapshot(store)
    assert await store.hand_over(a_hold, current, usage, to_b, features) is None
    assert await snapshot(store) == before


async def test_a_hand_over_of_a_hold_the_caller_does_not_have_is_refused(
    store: GroupStore,
) -> None:
    a_hold, _ = await _a_holds_and_b_waits(store)
    before = await snapshot(store)
    with pytest.raises(PermissionDenied):
        await _hand_over(store, dataclasses.replace(a_hold, job="c"), "b")
    with pytest.raises(NotHolder):
        await _hand_over(store, dataclasses.replace(a_hold, epoch=a_hold.epoch - 1), "b")
    with pytest.raises(PermissionDenied):
        await _hand_over(store, dataclasses.replace(a_hold, session_id="0" * 16), "b")
    after = await snapshot(store)
    assert {k: v for k, v in after.items() if k != "features"} == before


async def test_a_hand_over_needs_the_features_record_to_allow_it(store: GroupStore) -> None:
    a_hold, _ = await _a_holds_and_b_waits(store)
    await store.set_features(FeaturesRecord())
    off = await store.features()
    assert off is not None
    with pytest.raises(ValueError, match="do not all understand"):
        await _hand_over(store, a_hold, "b", off)


async def test_the_handed_over_hold_is_released_by_its_epoch_and_a_reattach_keeps_it(
    store: GroupStore,
) -> None:
    a_hold, b_session = await _a_holds_and_b_waits(store)
    b = await store.session(b_session)
    epoch = await _hand_over(store, a_hold, "b")
    assert epoch is not None
    # b's Acquire is retried on another replica (the grant did not reach it): it re-attaches,
    # which rewrites the hold (its mod revision moves), and must keep the epoch b was given.
    hold = await _held(store)
    entry = await store.enqueue(_request(b, b_session, hold.record.request_id, "retry"))
    assert entry.reattached
    hold = await _held(store)
    assert hold.mod_revision > epoch and hold.record.attempt == "retry"
    assert hold_epoch(hold) == epoch
    # a's stale yield (its epoch is still the key's create revision) is not b's.
    with pytest.raises(PermissionDenied):
        await store.release(a_hold)
    await store.release(Hold("g", "b", epoch, b_session))
    assert await holder(store) is None


async def test_a_stale_yield_of_the_same_job_cannot_end_its_later_hold(store: GroupStore) -> None:
    """a -> b -> a by hand-overs: the key is never deleted, so its create revision is a's
    first epoch all along; a's yield of that first hold (a late retry) must not end a's
    second hold, which is what an older replica would do (docs/operations.md, "Upgrades")."""
    a_hold, b_session = await _a_holds_and_b_waits(store)
    b_epoch = await _hand_over(store, a_hold, "b")
    assert b_epoch is not None
    a = await store.session(a_hold.session_id)
    await store.enqueue(_request(a, a_hold.session_id, "", "again"))
    a_again = await _hand_over(store, Hold("g", "b", b_epoch, b_session), "a")
    assert a_again is not None and a_again > b_epoch > a_hold.epoch
    hold = await _held(store)
    assert hold.create_revision == a_hold.epoch  # what an older replica takes for the epoch
    with pytest.raises(NotHolder):
        await store.release(a_hold)
    assert hold_epoch(await _held(store)) == a_again
    await store.release(Hold("g", "a", a_again, a_hold.session_id))
    assert await holder(store) is None


async def test_misread_holds_names_the_handed_over_holds_until_they_end(
    store: GroupStore,
) -> None:
    """What ``features show`` counts before a rollback: only holds a hand-over wrote over an
    earlier one (a hold a driver granted, even rewritten by a re-attach, is read alike by
    every version), and one whose record does not decode (it cannot be shown safe)."""
    a_hold, b_session = await _a_holds_and_b_waits(store)
    c = await open_session(store, "c")
    await enqueue(store, c, "h", request_id="c-call")
    assert await grant(store, await driver(store, "h"), "c", group="h") is not None
    # A re-attach rewrites h's hold; its create revision stays its epoch.
    assert (await enqueue(store, c, "h", request_id="c-call", attempt="retry")).reattached
    hold_h = await holder(store, "h")
    assert hold_h is not None and hold_h.mod_revision > hold_h.create_revision
    assert await store.misread_holds() == []

    epoch = await _hand_over(store, a_hold, "b")
    assert epoch is not None
    assert await store.misread_holds() == ["g"]
    await store.etcd.put(store.keys.holder("x"), b"not a record")
    assert sorted(await store.misread_holds()) == ["g", "x"]
    await store.etcd.delete(store.keys.holder("x"))

    await store.release(Hold("g", "b", epoch, b_session))  # b's next yield ends it
    assert await store.misread_holds() == []
