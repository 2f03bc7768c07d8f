"""The dashboard's pure parts: a group's colour, a group's timeline, a node's row."""

from __future__ import annotations

import re

import pytest

from timeslice_orchestrator.dashboard_story import (
    GroupTimeline,
    Hold,
    Story,
    SwitchSpan,
    group_color,
    node_json,
)
from timeslice_orchestrator.hub import HostReport
from timeslice_orchestrator.store.records import AgentRecord, WorkerRecord


def test_a_group_colour_is_its_names_alone() -> None:
    names = [f"group-{i}" for i in range(40)]
    colours = {n: group_color(n) for n in names}
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colours.values())
    # Whatever other groups there are, and in whatever order they appear.
    assert {n: group_color(n) for n in reversed(names)} == colours
    assert group_color("train") == group_color("train")
    # Different names get different colours (not a handful of slots by position).
    assert len(set(colours.values())) >= 35
    # Neither too pale for white nor black: every channel below 0xf0, some above 0x30.
    for c in colours.values():
        channels = [int(c[i : i + 2], 16) for i in (1, 3, 5)]
        assert max(channels) < 0xF0 and max(channels) > 0x30, c


def test_a_timeline_tells_who_held_when_and_each_switch() -> None:
    t = GroupTimeline()
    t.holder("a", 100.0)
    t.holder("a", 101.0)  # the same hold: nothing new
    t.holder("", 110.0)  # the switch took a's hold away
    t.switched(SwitchSpan("a", "b", end=111.5, seconds=1.5, outcome="committed", emulated=True))
    t.holder("b", 111.5)
    t.holder("c", 120.0)  # handed over in one transaction
    entries = t.entries(since=0)
    assert entries == [
        Hold("a", 100.0, 110.0),
        SwitchSpan("a", "b", 111.5, 1.5, "committed", True),
        Hold("b", 111.5, 120.0),
        Hold("c", 120.0, None),
    ]
    assert entries[1].start == pytest.approx(110.0)
    as_json = t.to_json(since=0)
    assert as_json[1] == {
        "kind": "switch",
        "from": "a",
        "to": "b",
        "start": 110.0,
        "end": 111.5,
        "seconds": 1.5,
        "outcome": "committed",
        "emulated": True,
    }
    assert as_json[-1] == {"kind": "hold", "job": "c", "start": 120.0, "end": None}
    # What ended before ``since`` is left out; the hold in progress never is.
    assert [e.to_json()["kind"] for e in t.entries(since=115)] == ["hold", "hold"]
    assert t.last_activity == float("inf")


def test_a_timeline_is_bounded_and_knows_when_it_went_quiet() -> None:
    t = GroupTimeline(max_entries=5)
    assert t.last_activity is None
    for i in range(100):
        t.holder(f"j{i}", float(i))
    t.holder("", 100.0)
    entries = t.entries(since=0)
    assert len(entries) == 5 and entries[-1] == Hold("j99", 99.0, 100.0)
    assert t.last_activity == 100.0
    with pytest.raises(ValueError):
        GroupTimeline(max_entries=0)


def test_a_node_row_shows_its_backend_emulation_and_parked_bytes() -> None:
    agent = AgentRecord(
        node="node-0",
        replica="r1",
        backend="sim",
        emulated=True,
        connected_at=1000.0,
        workers=[
            WorkerRecord("a", "g", 1, 250_000_000),
            WorkerRecord("b", "g", 2, 0),
            WorkerRecord("b", "h", 3, 0),
        ],
        devices=2,
        default_state_bytes=40_000_000,
    )
    row = node_json(agent, ["a", "b", "a"])  # a parked for two groups: its bytes once
    assert row == {
        "node": "node-0",
        "backend": "sim",
        "emulated": True,
        "replica": "r1",
        "connected_at": 1000.0,
        "devices": 2,
        "workers": 3,
        "jobs": ["a", "b"],
        "parked": ["a", "a", "b"],
        "parked_bytes": 250_000_000 + 40_000_000,  # b announced none: the default
        "host_free_bytes": None,
        "host_heard_at": None,
        "host_emulated": False,
        "host_reported_to": None,
    }


def test_host_memory_is_shown_where_heard_and_elsewhere_names_the_replica() -> None:
    agent = AgentRecord("node-0", "r1", "sim", True, 1000.0, [])
    heard = HostReport(available_bytes=12_300_000_000, heard_at=1004.0, modelled=True)
    row = node_json(agent, [], heard, "r1")
    assert (row["host_free_bytes"], row["host_heard_at"]) == (12_300_000_000, 1004.0)
    assert row["host_emulated"] is True and row["host_reported_to"] is None
    # Another replica holds the agent's stream: it is named, no figure is made up.
    row = node_json(agent, [], None, "r2")
    assert row["host_free_bytes"] is None and row["host_reported_to"] == "r1"
    # Held here but not reported (an agent that does not say): neither.
    row = node_json(agent, [], None, "r1")
    assert row["host_free_bytes"] is None and row["host_reported_to"] is None


def test_the_story_counts_parked_changes_and_forgets_quiet_groups() -> None:
    story = Story(max_groups=2, max_entries=3)
    agents = {
        "n1": AgentRecord("n1", "r0", "sim", True, 1.0, [WorkerRecord("a", "g", 1, 7)]),
        "n2": AgentRecord("n2", "r0", "sim", True, 1.0, [WorkerRecord("b", "h", 2, 5)]),
    }
    story.parked("g", {"n1": ["a"]})
    version = story.parked_version
    story.parked("g", {"n1": ["a"]})  # the same: nothing to resend
    assert story.parked_version == version
    story.parked("h", {"n2": ["b"]})
    assert story.parked_version == version + 1
    rows = {r["node"]: r for r in story.nodes_json(agents)}
    assert (rows["n1"]["parked_bytes"], rows["n2"]["parked_bytes"]) == (7, 5)
    story.forget("h")
    assert story.parked_version == version + 2
    assert [r["parked_bytes"] for r in story.nodes_json(agents)] == [7, 0]
    # Timelines: at most two groups; one quiet since before the horizon goes.
    for group in ("g", "h", "x"):
        timeline = story.timeline(group)
        if timeline is not None:
            timeline.holder("j", 10.0)
            timeline.holder("", 20.0)
    assert sorted(story.timelines) == ["g", "h"]
    story.timeline("g").holder("k", 50.0)  # type: ignore[union-attr]
    story.prune(horizon=30.0)
    assert sorted(story.timelines) == ["g"] and story.timeline_json("h", 0) == []
    assert story.timeline("x") is not None  # room again
