"""The quotas' counts the mirror keeps (store/owners.py): what is counted, against whom, and
that a rewrite or a drop moves the count instead of leaking it."""

from __future__ import annotations

from timeslice_orchestrator.store.keys import KeyRef, Kind
from timeslice_orchestrator.store.owners import OwnerIndex


def test_each_owned_kind_counts_against_its_owner() -> None:
    index = OwnerIndex()
    index.stored(KeyRef(Kind.SESSION, name="s1"), "job-a")
    index.stored(KeyRef(Kind.SESSION, name="s2"), "job-a")
    index.stored(KeyRef(Kind.QUEUE, group="g1", name="job-a"), "s1")
    index.stored(KeyRef(Kind.HOLDER, group="g2"), "s1")
    index.stored(KeyRef(Kind.META, group="g1"), "job-a")
    assert index.sessions_per_job == {"job-a": 2}
    # Entries and holds share one count per session: both are what a session may pile up.
    assert index.entries_per_session == {"s1": 2}
    assert index.groups_per_job == {"job-a": 1}


def test_keys_of_other_kinds_and_keys_without_an_owner_are_not_counted() -> None:
    index = OwnerIndex()
    index.stored(KeyRef(Kind.RESIDENT, group="g", name="node"), "job-a")
    index.stored(KeyRef(Kind.AGENT, name="node"), "job-a")
    index.stored(KeyRef(Kind.SESSION, name="s1"), None)  # a record that did not decode
    index.stored(KeyRef(Kind.META, group="g"), "")  # an operator's group
    assert not index.sessions_per_job
    assert not index.entries_per_session
    assert not index.groups_per_job


def test_a_rewrite_moves_the_count_to_the_new_owner() -> None:
    index = OwnerIndex()
    hold = KeyRef(Kind.HOLDER, group="g")
    index.stored(hold, "s1")
    index.stored(hold, "s1")  # the same holder rewritten counts once
    assert index.entries_per_session == {"s1": 1}
    index.stored(hold, "s2")
    assert index.entries_per_session == {"s2": 1}
    # Rewritten as undecodable: the old owner is no longer charged for it.
    index.stored(hold, None)
    assert not index.entries_per_session


def test_a_drop_uncounts_and_forgets_a_departed_owner() -> None:
    index = OwnerIndex()
    first, second = KeyRef(Kind.SESSION, name="s1"), KeyRef(Kind.SESSION, name="s2")
    index.stored(first, "job-a")
    index.stored(second, "job-a")
    index.dropped(first)
    assert index.sessions_per_job == {"job-a": 1}
    index.dropped(first)  # dropped twice (a delete seen again): no count below what is there
    assert index.sessions_per_job == {"job-a": 1}
    index.dropped(second)
    # No zero left behind per job that has gone: a flood of short-lived jobs must not grow it.
    assert "job-a" not in index.sessions_per_job
    index.dropped(KeyRef(Kind.QUEUE, group="g", name="never-stored"))
    assert not index.entries_per_session
