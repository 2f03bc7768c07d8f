"""Removing an idle group (store/idle.py) against a real etcd: every key of the group goes in
one transaction, and a key written after the revision it was judged idle at keeps them all."""

from __future__ import annotations

from tests.integration.groupstore import enqueue, open_session, snapshot
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.idle import IdleStore


async def _latest(store: GroupStore) -> int:
    """The revision the store's keys were last written at, as a sweep judges idleness."""
    return max(kv.mod_revision for kv in (await snapshot(store)).values())


async def test_an_idle_group_goes_with_every_key_and_no_other(store: GroupStore) -> None:
    session = await open_session(store, "a")
    await enqueue(store, session, group="g")
    await enqueue(store, session, group="other")
    before = set(await snapshot(store))
    assert {"groups/g/meta", "groups/other/meta"} <= before
    assert any(k.startswith("groups/g/queue/") for k in before)

    idle = IdleStore(store.etcd, store.keys)
    assert await idle.remove_idle_group("g", await _latest(store))
    after = set(await snapshot(store))
    assert after == {k for k in before if not k.startswith("groups/g/")}
    assert "groups/other/meta" in after


async def test_a_key_written_since_keeps_the_whole_group(store: GroupStore) -> None:
    first, second = await open_session(store, "a"), await open_session(store, "b")
    await enqueue(store, first, group="g")
    judged_at = await _latest(store)
    await enqueue(store, second, group="g")  # a new waiter after the group was judged idle
    before = await snapshot(store)

    idle = IdleStore(store.etcd, store.keys)
    assert not await idle.remove_idle_group("g", judged_at)
    assert await snapshot(store) == before
    # Judged again, at the newer revision: now it goes.
    assert await idle.remove_idle_group("g", await _latest(store))
    assert not any(k.startswith("groups/g/") for k in await snapshot(store))


async def test_a_group_with_a_prefix_of_another_name_leaves_the_other(store: GroupStore) -> None:
    # "g" is a prefix of "g2": the range is the group's root with its separator, not the name.
    session = await open_session(store, "a")
    await enqueue(store, session, group="g")
    await enqueue(store, session, group="g2")
    idle = IdleStore(store.etcd, store.keys)
    assert await idle.remove_idle_group("g", await _latest(store))
    keys = set(await snapshot(store))
    assert "groups/g2/meta" in keys
    assert "groups/g/meta" not in keys
