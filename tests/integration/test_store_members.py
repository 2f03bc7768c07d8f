"""Membership, agent records, relayed directives, the key layout, and the mirror's typed
accessors, against a real etcd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.integration.groupstore import (
    driver,
    enqueue,
    grant,
    open_session,
    sid,
    snapshot,
)
from tests.integration.polling import until
from timeslice.errors import FailedPrecondition
from timeslice_orchestrator.store import follower
from timeslice_orchestrator.store.etcd import LeaseExpired, StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore, Hold
from timeslice_orchestrator.store.keys import KeyRef, Keyspace, Kind
from timeslice_orchestrator.store.records import (
    AgentRecord,
    FenceRecord,
    GroupStats,
    MembersRecord,
    RelayRecord,
    ResidentRecord,
    Stored,
    WorkerRecord,
)
from timeslice_orchestrator.store.relay import RelayStore

# -- membership -------------------------------------------------------------------------------


async def test_pinning_members_creates_the_group_and_unpinning_keeps_it(
    store: GroupStore,
) -> None:
    revision = await store.set_members("g", ["n2", "n1", "n2"])
    keys = await snapshot(store)
    assert keys["groups/g/members"].mod_revision == revision
    assert MembersRecord.decode(keys["groups/g/members"].value).nodes == ["n1", "n2"]
    assert "groups/g/meta" in keys
    meta = keys["groups/g/meta"]
    revision = await store.set_members("g", [])
    keys = await snapshot(store)
    assert keys["groups/g/members"].mod_revision == revision
    assert MembersRecord.decode(keys["groups/g/members"].value).nodes == []
    assert keys["groups/g/meta"] == meta  # created once


async def test_an_agent_can_say_a_job_is_no_longer_resident(store: GroupStore) -> None:
    assert not await store.forget_residency("g", "n0", "a")  # no residency at all
    resident = ResidentRecord({"n0": ["a", "b"], "n1": ["a"]})
    await store.etcd.put(store.keys.resident("g"), resident.encode())
    assert not await store.forget_residency("g", "n0", "c")
    assert await store.forget_residency("g", "n0", "a")
    assert await store.forget_residency("g", "n1", "a")
    stored = (await snapshot(store))["groups/g/resident"]
    assert ResidentRecord.decode(stored.value).nodes == {"n0": ["b"]}


async def test_forgetting_residency_loses_to_a_concurrent_change(store: GroupStore) -> None:
    key = store.keys.resident("g")
    await store.etcd.put(key, ResidentRecord({"n0": ["a"]}).encode())
    real_get = store.etcd.get

    async def get_then_change(k: bytes) -> object:
        read = await real_get(k)
        await store.etcd.put(key, ResidentRecord({"n0": ["a", "b"]}).encode())  # a switch
        return read

    store.etcd.get = get_then_change  # type: ignore[method-assign,assignment]
    try:
        assert not await store.forget_residency("g", "n0", "a")
    finally:
        del store.etcd.get
    assert ResidentRecord.decode((await snapshot(store))["groups/g/resident"].value).nodes == {
        "n0": ["a", "b"]
    }


async def test_an_agent_record_keeps_its_lease_while_it_lives(store: GroupStore) -> None:
    first = await store.agent_lease("n0", 30)
    record = AgentRecord("n0", "r1", "sim", True, 1.0, [WorkerRecord("a", "g", 1, 10)])
    await store.publish_agent(record, first, fence_revision=0)
    kv = (await snapshot(store))["agents/n0"]
    assert kv.lease == first
    assert AgentRecord.decode(kv.value) == record
    # Reconnecting (to any replica) reuses the live lease: the record never lapses.
    assert await store.agent_lease("n0", 30) == first
    await store.etcd.revoke_lease(first)
    fresh = await store.agent_lease("n0", 30)
    assert fresh != first
    assert await store.etcd.lease_ttl(fresh) > 0


# -- fencing a node out ------------------------------------------------------------------------


async def test_fencing_a_node_removes_it_and_marks_its_residency_unknown(
    store: GroupStore,
) -> None:
    lease = await store.agent_lease("n1", 30)
    await store.publish_agent(AgentRecord("n1", "r1", "sim", True, 1.0), lease, fence_revision=0)
    await store.etcd.put(
        store.keys.resident("g"), ResidentRecord({"n0": ["a"], "n1": ["b", "a"]}).encode()
    )
    await store.etcd.put(store.keys.resident("h"), ResidentRecord({"n1": ["c"]}).encode())
    await store.etcd.put(store.keys.resident("k"), ResidentRecord({"n0": ["c"]}).encode())
    assert await store.fence_of("n1") is None
    fence = FenceRecord("silent for 4.0 s", 1.0, "r0", ["g", "h"])
    revision = await store.fence_node("n1", fence)
    keys = await snapshot(store)
    assert "agents/n1" not in keys  # it left every group at once
    with pytest.raises(LeaseExpired):
        await store.etcd.keepalive_once(lease)  # the stream's holder finds out
    stored = await store.fence_of("n1")
    assert stored is not None and stored.mod_revision == revision and stored.record == fence
    assert ResidentRecord.decode(keys["groups/g/resident"].value).nodes == {"n0": ["a"]}
    assert ResidentRecord.decode(keys["groups/h/resident"].value).nodes == {}
    assert ResidentRecord.decode(keys["groups/k/resident"].value).nodes == {"n0": ["c"]}
    # Each group touched says why.
    for group in ("g", "h"):
        stats = GroupStats.decode(keys[f"groups/{group}/stats"].value)
        assert stats.last_error == "node n1 fenced out: silent for 4.0 s"
    assert "groups/k/stats" not in keys
    # Every epoch issued before the fence is below it.
    assert revision > keys["groups/g/resident"].create_revision
    # Its hello reconciles: what the agent reports is what the group counts on.
    assert await store.set_node_residency("g", "n1", ["b"])
    assert not await store.set_node_residency("g", "n1", ["b"])  # already so
    nodes = ResidentRecord.decode((await snapshot(store))["groups/g/resident"].value).nodes
    assert nodes == {"n0": ["a"], "n1": ["b"]}
    # A later fence has a higher revision (the agent adopts the highest it is told).
    assert await store.fence_node("n1", FenceRecord("again", 2.0, "r1")) > revision


async def test_a_hello_that_missed_a_fence_does_not_publish_the_node(store: GroupStore) -> None:
    """Another replica fences the node between the hello's read of its fence and the write of
    its record: the node must not rejoin its groups unreconciled."""
    seen = await store.fence_of("n2")
    assert seen is None  # what the hello read: never fenced
    lease = await store.agent_lease("n2", 30)
    revision = await store.fence_node("n2", FenceRecord("silent", 1.0, "r0", ["g"]))
    record = AgentRecord("n2", "r1", "sim", True, 1.0)
    with pytest.raises(FailedPrecondition, match="fenced after its hello"):
        await store.publish_agent(record, lease, fence_revision=0)
    assert "agents/n2" not in await snapshot(store)
    # The next hello reads the fence, reconciles, and publishes.
    await store.publish_agent(record, await store.agent_lease("n2", 30), fence_revision=revision)
    assert "agents/n2" in await snapshot(store)


# -- relayed directives -----------------------------------------------------------------------


@pytest.fixture
def relay(store: GroupStore) -> RelayStore:
    return RelayStore(store.etcd, store.keys)


async def _posted(store: GroupStore, node: str, directive_id: str) -> Stored[RelayRecord]:
    kv = await store.etcd.get(store.keys.relay(node, directive_id))
    assert kv is not None
    return Stored.of(kv, RelayRecord.decode(kv.value))


async def test_a_directive_is_posted_once_answered_and_removed(
    store: GroupStore, relay: RelayStore
) -> None:
    lease = await store.etcd.grant_lease(30)
    record = RelayRecord(driver="r1", directive="ZGly")
    assert await relay.post("n0", "d1", record, lease)
    assert not await relay.post("n0", "d1", RelayRecord(driver="r2", directive="x"), lease)
    posted = await _posted(store, "n0", "d1")
    assert posted.record == record and posted.lease == lease
    assert await relay.answer("n0", "d1", posted, "YWNr")
    answered = await _posted(store, "n0", "d1")
    assert (answered.record.ack, answered.record.directive) == ("YWNr", "ZGly")
    assert answered.lease == lease  # still goes with the driver
    # An answer to a copy that changed since (answered already) does not land.
    assert not await relay.answer("n0", "d1", posted, "other")
    await relay.remove("n0", "d1")
    assert not await relay.answer("n0", "d1", answered, "late")  # the driver gave up
    assert await snapshot(store) == {}


async def test_a_post_goes_with_the_drivers_lease(store: GroupStore, relay: RelayStore) -> None:
    lease = await store.etcd.grant_lease(30)
    assert await relay.post("n0", "d1", RelayRecord(driver="r1", directive="x"), lease)
    await store.etcd.revoke_lease(lease)
    assert await snapshot(store) == {}


# -- the key layout ---------------------------------------------------------------------------


def test_every_key_parses_back_into_its_parts() -> None:
    keys = Keyspace("/ts/prod")
    cases = {
        keys.session("00000000000000ab"): KeyRef(Kind.SESSION, name="00000000000000ab"),
        keys.agent("node-1"): KeyRef(Kind.AGENT, name="node-1"),
        keys.relay("node-1", "s1-evict-node-1-a"): KeyRef(
            Kind.RELAY, name="node-1", directive="s1-evict-node-1-a"
        ),
        keys.meta("g"): KeyRef(Kind.META, "g"),
        keys.queue_entry("g", "job"): KeyRef(Kind.QUEUE, "g", "job"),
        keys.holder("g"): KeyRef(Kind.HOLDER, "g"),
        keys.resident("g"): KeyRef(Kind.RESIDENT, "g"),
        keys.switch("g"): KeyRef(Kind.SWITCH, "g"),
        keys.driver("g"): KeyRef(Kind.DRIVER, "g"),
        keys.members("g"): KeyRef(Kind.MEMBERS, "g"),
        keys.usage("g"): KeyRef(Kind.USAGE, "g"),
        keys.stats("g"): KeyRef(Kind.STATS, "g"),
        keys.fault("g", "job"): KeyRef(Kind.FAULT, "g", "job"),
        b"/ts/prod/groups/g/later": KeyRef(Kind.OTHER, "g"),
    }
    for key, ref in cases.items():
        assert keys.parse(key) == ref, key
    assert keys.queue("g") == b"/ts/prod/groups/g/queue/"
    assert keys.root == b"/ts/prod/"
    foreign = (
        b"/ts/prodx/groups/g/holder",
        b"/ts/other/sessions/1",
        b"/ts/prod/else/x",
        b"/ts/prod/groups/\xff\xfe/holder",  # not UTF-8: nobody of ours wrote it
    )
    for key in foreign:
        assert keys.parse(key) is None
    assert {r.topic for r in cases.values()} == {"sessions", "agents", "relay", "group:g"}
    with pytest.raises(ValueError):
        Keyspace("ts/prod")


# -- the mirror -------------------------------------------------------------------------------


@asynccontextmanager
async def _mirror(store: GroupStore) -> AsyncIterator[Mirror]:
    mirror = Mirror(store.etcd, store.keys)
    task = asyncio.create_task(mirror.run())
    try:
        async with asyncio.timeout(5):
            await mirror.synced.wait()
        yield mirror
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_mirror_is_read_through_typed_accessors(
    store: GroupStore, relay: RelayStore
) -> None:
    a, b = await open_session(store, "a"), await open_session(store, "b")
    await enqueue(store, a, request_id="r1")
    auth = await driver(store)
    epoch = await grant(store, auth, "a")
    assert epoch is not None
    await enqueue(store, b)
    await store.etcd.put(f"{store.keys.prefix}/else/x".encode(), b"foreign")
    await store.publish_agent(
        AgentRecord("n0", "r1", "sim", True, 1.0), auth.lease, fence_revision=0
    )
    await relay.post("n0", "d1", RelayRecord(driver="r1", directive="x"), auth.lease)
    async with _mirror(store) as mirror:
        hold = mirror.holder("g")
        assert hold is not None and hold.create_revision == epoch and hold.record.job == "a"
        assert mirror.usage("g") is None
        session = mirror.session(sid(a))
        assert session is not None and session.record.job == "a"
        assert list(mirror.agents()) == ["n0"]
        assert [(p.node, p.directive_id) for p in mirror.relays()] == [("n0", "d1")]
        posted = mirror.relay("n0", "d1")
        assert posted is not None and posted.record.driver == "r1"
        assert mirror.group_names() == ["g"]
        view = mirror.group("g")
        assert view.exists and [q.job for q in view.queue] == ["b"]
        assert view.driver == "r1" and view.driver_lease == auth.lease
        # Changes arrive through the watch.
        await store.release(Hold("g", "a", epoch, sid(a)))
        await relay.remove("n0", "d1")
        head = await store.etcd.put(store.keys.meta("h"), b"{}")
        await mirror.wait_for_revision(head, 5)
        assert mirror.holder("g") is None
        usage = mirror.usage("g")
        assert usage is not None and usage.record.jobs["a"].holds == 1
        assert mirror.relay("n0", "d1") is None and mirror.relays() == []
        assert mirror.group_names() == ["g", "h"]
        assert not mirror.group("nope").exists


async def test_a_node_is_known_for_good_once_its_agent_published(store: GroupStore) -> None:
    assert await store.known_nodes(["n0", "n1"]) == set()
    lease = await store.agent_lease("n0", 30)
    await store.publish_agent(AgentRecord("n0", "r1", "sim", True, 1.0), lease, fence_revision=0)
    marker = (await snapshot(store))["nodes/n0"]
    assert marker.lease == 0, "the marker outlives the agent record"
    await store.publish_agent(AgentRecord("n0", "r1", "sim", True, 2.0), lease, fence_revision=0)
    assert (await snapshot(store))["nodes/n0"].mod_revision == marker.mod_revision
    await store.etcd.revoke_lease(lease)
    assert "agents/n0" not in await snapshot(store)
    many = [f"n{i}" for i in range(250)]  # more than one transaction's worth of reads
    assert await store.known_nodes(many) == {"n0"}


async def test_a_note_in_last_error_is_written_once(store: GroupStore) -> None:
    assert not await store.note_error("g", "waiting"), "no group: nothing to explain"
    assert "groups/g/stats" not in await snapshot(store)
    await store.set_members("g", ["n0"])
    assert await store.note_error("g", "waiting")
    written = (await snapshot(store))["groups/g/stats"]
    assert GroupStats.decode(written.value).last_error == "waiting"
    assert not await store.note_error("g", "waiting")
    assert (await snapshot(store))["groups/g/stats"].mod_revision == written.mod_revision


async def test_a_wait_given_up_does_not_count_as_the_watch_being_stuck(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that gave up waiting for a revision the watch may never bring (one written
    under another prefix) no longer holds the mirror "behind": its watch is not restarted,
    and its member passed over, every few seconds for nothing."""
    monkeypatch.setattr(follower, "WATCH_STUCK_AFTER", 1.0)
    async with _mirror(store) as mirror:
        with pytest.raises(StoreUnavailable):
            await mirror.wait_for_revision(mirror.revision + 1000, 0.2)
        await asyncio.sleep(2.0)
        assert mirror.reconnects == 0


async def test_the_mirror_keeps_nothing_of_groups_that_are_gone(store: GroupStore) -> None:
    """Throwaway group names (a group per run, removed by the idle clean-up) must not grow a
    replica's memory for its whole life; and a group seen again wakes its waiters."""
    async with _mirror(store) as mirror:
        names = [f"tmp-{i}" for i in range(300)]
        for name in names:
            await store.etcd.put(store.keys.stats(name), GroupStats().encode())
        await until(lambda: all(mirror.has_group(n) for n in names))
        assert mirror.tracked_topics >= 300
        seen = mirror.version("group:tmp-0")
        waiting = asyncio.create_task(mirror.wait_for_change("group:tmp-0", seen))
        await store.etcd.delete(f"{store.keys.prefix}/groups/tmp-".encode(), prefix=True)
        await until(lambda: not any(mirror.has_group(n) for n in names))
        await asyncio.wait_for(waiting, 5)  # its group went: a change
        assert mirror.tracked_topics < 10
        # Seen again: a waiter from before it went is woken by its return.
        gone = mirror.version("group:tmp-0")
        waiting = asyncio.create_task(mirror.wait_for_change("group:tmp-0", gone))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await store.etcd.put(store.keys.stats("tmp-0"), GroupStats().encode())
        await asyncio.wait_for(waiting, 5)
