"""The mirror's index (store/mirror.py) fed key by key as the follower's watch would: what a
group reads as (idle, in need of a driver, its summary), who holds what, the quotas' counts,
and a dropped key leaving nothing behind. The follower's watch of a real etcd is in
tests/integration/test_store_follower.py."""

from __future__ import annotations

from timeslice_orchestrator.store.etcd import KeyValue
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.mirror import MirrorIndex
from timeslice_orchestrator.store.records import (
    GroupMetaRecord,
    HolderRecord,
    QueueRecord,
    ResidentRecord,
    SessionRecord,
)

KEYS = Keyspace("/ts")


class Index(MirrorIndex):
    """The index with the two moves the follower makes: a key written, a key deleted."""

    revision_now = 0

    def put(self, key: bytes, value: bytes) -> KeyValue:
        self.revision_now += 1
        kv = KeyValue(key, value, self.revision_now, self.revision_now, 1, 0)
        ref = KEYS.parse(key)
        assert ref is not None, key
        self._store(ref, kv)
        self.revision = self.revision_now
        return kv

    def delete(self, key: bytes) -> None:
        ref = KEYS.parse(key)
        assert ref is not None, key
        self._drop(ref)


def test_a_group_with_a_hold_alone_is_idle_and_a_waiter_needs_a_driver() -> None:
    index = Index(KEYS)
    index.put(KEYS.meta("g"), GroupMetaRecord("job-a").encode())
    assert index.group_names() == ["g"] and index.has_group("g")
    assert index.idle("g") and not index.needs_driver("g")
    index.put(KEYS.holder("g"), HolderRecord("job-a", "s1", 1.0).encode())
    assert index.idle("g") and not index.needs_driver("g")
    entry = KEYS.queue_entry("g", "job-b")
    index.put(entry, QueueRecord("s2", 0, 2.0).encode())
    assert not index.idle("g") and index.needs_driver("g")
    holder, waiting, switching = index.summary("g")
    assert holder is not None and holder.job == "job-a"
    assert (waiting, switching) == (1, False)
    index.delete(entry)
    assert index.idle("g")


def test_a_group_is_quiet_only_while_free_and_idle() -> None:
    """What a replica's start skips (the dashboard, the group metrics): nothing held, queued,
    switching or pending."""
    index = Index(KEYS)
    index.put(KEYS.meta("g"), GroupMetaRecord("job-a").encode())
    assert index.quiet("g")
    holder = KEYS.holder("g")
    index.put(holder, HolderRecord("job-a", "s1", 1.0).encode())
    assert index.idle("g") and not index.quiet("g")
    index.delete(holder)
    entry = KEYS.queue_entry("g", "job-b")
    index.put(entry, QueueRecord("s2", 0, 2.0).encode())
    assert not index.quiet("g")
    index.delete(entry)
    assert index.quiet("g")


def test_a_residency_written_after_the_hold_needs_a_driver() -> None:
    # A node that came back (after a fence) reported what it has: it may lack the holder's
    # state, so a driver must look, although nobody waits.
    index = Index(KEYS)
    index.put(KEYS.resident("g"), ResidentRecord({"n1": ["job-a"]}).encode())
    index.put(KEYS.holder("g"), HolderRecord("job-a", "s1", 1.0).encode())
    assert not index.needs_driver("g")
    index.put(KEYS.resident("g"), ResidentRecord({"n1": []}).encode())
    assert index.needs_driver("g")


def test_who_holds_what_and_the_quotas_counts_follow_each_write() -> None:
    index = Index(KEYS)
    index.put(KEYS.session("s1"), SessionRecord("job-a", "host", 1, 0.0).encode())
    index.put(KEYS.meta("g1"), GroupMetaRecord("job-a").encode())
    index.put(KEYS.meta("g2"), GroupMetaRecord("").encode())  # an operator's group
    index.put(KEYS.holder("g1"), HolderRecord("job-a", "s1", 1.0).encode())
    index.put(KEYS.queue_entry("g2", "job-a"), QueueRecord("s1", 0, 1.0).encode())
    assert index.session_count() == 1 and index.sessions_of("job-a") == 1
    assert index.entries_of("s1") == 2  # a hold and an entry
    assert index.groups_of("job-a") == 1 and index.group_creator("g1") == "job-a"
    assert index.held_by("s1") == ["g1"]
    # The hold handed to another session: s1 no longer holds it.
    index.put(KEYS.holder("g1"), HolderRecord("job-b", "s2", 2.0).encode())
    assert index.held_by("s1") == [] and index.held_by("s2") == ["g1"]
    assert index.entries_of("s1") == 1


def test_a_group_whose_last_key_goes_is_forgotten() -> None:
    index = Index(KEYS)
    index.put(KEYS.meta("g"), GroupMetaRecord("job-a").encode())
    index.put(KEYS.holder("g"), HolderRecord("job-a", "s1", 1.0).encode())
    index.delete(KEYS.holder("g"))
    assert index.held_by("s1") == [] and index.has_group("g")
    index.delete(KEYS.meta("g"))
    assert not index.has_group("g") and index.group_count() == 0
    assert index.groups_of("job-a") == 0
    index.delete(KEYS.meta("never-seen"))  # a delete of a key never seen: nothing to do
