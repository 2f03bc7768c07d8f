"""The etcd key layout, both ways: every key a transaction writes parses back to its parts."""

from __future__ import annotations

import pytest

from timeslice_orchestrator.store.keys import KeyRef, Keyspace, Kind, group_topic

SPACE = Keyspace("/timeslice/default")


@pytest.mark.parametrize(
    ("key", "ref"),
    [
        (SPACE.session("s-1"), KeyRef(Kind.SESSION, name="s-1")),
        (SPACE.agent("node-0"), KeyRef(Kind.AGENT, name="node-0")),
        (SPACE.relay("node-0", "d-9"), KeyRef(Kind.RELAY, name="node-0", directive="d-9")),
        (SPACE.features(), KeyRef(Kind.FEATURES)),
        (SPACE.meta("g"), KeyRef(Kind.META, "g")),
        (SPACE.holder("g"), KeyRef(Kind.HOLDER, "g")),
        (SPACE.resident("g"), KeyRef(Kind.RESIDENT, "g")),
        (SPACE.switch("g"), KeyRef(Kind.SWITCH, "g")),
        (SPACE.driver("g"), KeyRef(Kind.DRIVER, "g")),
        (SPACE.members("g"), KeyRef(Kind.MEMBERS, "g")),
        (SPACE.usage("g"), KeyRef(Kind.USAGE, "g")),
        (SPACE.stats("g"), KeyRef(Kind.STATS, "g")),
        (SPACE.queue_entry("g", "job-a"), KeyRef(Kind.QUEUE, "g", "job-a")),
        (SPACE.fault("g", "job-a"), KeyRef(Kind.FAULT, "g", "job-a")),
        (SPACE.operation("g", "op-1"), KeyRef(Kind.OPERATION, "g", "op-1")),
    ],
)
def test_every_written_key_parses_back(key: bytes, ref: KeyRef) -> None:
    assert key.startswith(SPACE.root)
    assert SPACE.parse(key) == ref


def test_a_group_key_of_a_newer_version_still_names_its_group() -> None:
    ref = SPACE.parse(SPACE.group_root("g") + b"something/new")
    assert ref == KeyRef(Kind.OTHER, "g")
    assert ref.topic == group_topic("g") == "group:g"


@pytest.mark.parametrize(
    "key",
    [
        b"/timeslice/other/sessions/s",  # another deployment
        b"/timeslice/defaultx/sessions/s",  # a prefix that merely starts the same
        SPACE.root + b"unknown/thing",
        SPACE.root + b"sessions/a/b",
        SPACE.root + b"\xff\xfe",  # not UTF-8: nobody of ours wrote it
        SPACE.beacon(),  # outside the layout the mirror reads
        SPACE.fence("node-0"),  # read on hello, not mirrored
        SPACE.known_node("node-0"),
    ],
)
def test_foreign_or_unmirrored_keys_parse_to_none(key: bytes) -> None:
    assert SPACE.parse(key) is None


def test_topics_group_keys_by_what_they_wake() -> None:
    assert SPACE.parse(SPACE.queue_entry("g", "j")).topic == "group:g"  # type: ignore[union-attr]
    assert SPACE.parse(SPACE.session("s")).topic == "sessions"  # type: ignore[union-attr]
    assert SPACE.parse(SPACE.agent("n")).topic == "agents"  # type: ignore[union-attr]
    assert SPACE.parse(SPACE.relay("n", "d")).topic == "relay"  # type: ignore[union-attr]


def test_prefixes_cover_exactly_their_keys() -> None:
    assert SPACE.queue_entry("g", "j").startswith(SPACE.queue("g"))
    assert SPACE.holder("g").startswith(SPACE.group_root("g"))
    assert not SPACE.holder("g2").startswith(SPACE.group_root("g"))  # g is not a prefix of g2
    assert SPACE.group_root("g").startswith(SPACE.groups())


@pytest.mark.parametrize("prefix", ["timeslice", "/timeslice/", ""])
def test_a_malformed_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix must start with '/'"):
        Keyspace(prefix)
