"""The dashboard's server side, on a fake mirror: the page and its policy, strict query strings,
the stream cap, coalesced updates, switch ends, and a stuck browser being dropped with bounded
memory."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from timeslice_orchestrator.dashboard import (
    PAGE,
    Dashboard,
    DashboardConfig,
    content_security_policy,
    dashboard_url,
    parse_query,
)
from timeslice_orchestrator.dashboard_story import group_color
from timeslice_orchestrator.holds import HoldTracker
from timeslice_orchestrator.hub import HostReport
from timeslice_orchestrator.store.mirror import GroupView, RelayPost
from timeslice_orchestrator.store.records import (
    AgentRecord,
    GroupStats,
    HolderRecord,
    NodeStep,
    QueuedJob,
    QueueRecord,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    WorkerRecord,
)

R = TypeVar("R")
EVIL = "<script>alert(1)</script><img src=x onerror=alert(2)>"


class FakeMirror:
    """The reads the dashboard makes, over views a test sets."""

    def __init__(self) -> None:
        self.revision = 1
        self.views: dict[str, GroupView] = {}
        self.agent_records: dict[str, AgentRecord] = {}
        self.listeners: list[Callable[[set[str]], None]] = []

    def group_names(self) -> list[str]:
        return sorted(self.views)

    def has_group(self, group: str) -> bool:
        return group in self.views

    def group(self, group: str) -> GroupView:
        return self.views.get(group) or view(group)

    def stats(self, group: str) -> GroupStats | None:
        return self.group(group).stats

    def holder(self, group: str) -> Stored[HolderRecord] | None:
        return self.group(group).holder

    def switch(self, group: str) -> Stored[SwitchRecord] | None:
        return self.group(group).switch

    def has_waiters(self, group: str) -> bool:
        return bool(self.group(group).queue)

    def quiet(self, group: str) -> bool:
        v = self.group(group)
        return (
            v.holder is None and not v.queue and v.switch is None and v.pending_operation() is None
        )

    def agents(self) -> dict[str, AgentRecord]:
        return dict(self.agent_records)

    def relays(self) -> list[RelayPost]:
        return []

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Callable[[set[str]], None]) -> None:
        self.listeners.remove(listener)

    def set_agents(self, **agents: AgentRecord) -> None:
        self.agent_records = agents
        for listener in self.listeners:
            listener({"agent"})

    def set(self, *views: GroupView) -> None:
        self.revision += 1
        for v in views:
            self.views[v.group] = v
        for listener in self.listeners:
            listener({f"group:{v.group}" for v in views})


def stored(record: R, revision: int = 5) -> Stored[R]:
    return Stored(record, revision, revision, 0)


def view(
    group: str,
    holder: str | None = None,
    queue: tuple[str, ...] = (),
    switches: int = 0,
    last_switch: float = 0.0,
    switch: SwitchRecord | None = None,
    nodes: dict[str, list[str]] | None = None,
    parked: dict[str, list[str]] | None = None,
) -> GroupView:
    return GroupView(
        group=group,
        revision=1,
        exists=True,
        holder=stored(HolderRecord(holder, "s-" + holder, 1000.0)) if holder else None,
        queue=[
            QueuedJob(job, stored(QueueRecord("s-" + job, 0, 1000.0), 10 + i))
            for i, job in enumerate(queue)
        ],
        resident=stored(ResidentRecord(nodes or {}, parked or {})) if nodes or parked else None,
        switch=stored(switch) if switch else None,
        driver="r1",
        driver_lease=1,
        stats=GroupStats(switches=switches, grants=switches, last_switch_seconds=last_switch),
    )


def make(mirror: FakeMirror, **config: float) -> tuple[Dashboard, HoldTracker, CollectorRegistry]:
    tracker = HoldTracker()
    registry = CollectorRegistry()
    dash = Dashboard(
        mirror,
        tracker,
        DashboardConfig(**config),  # type: ignore[arg-type]
        replica="r1",
        registry=registry,
    )
    dash.start()
    return dash, tracker, registry


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry]]:
    mirror = FakeMirror()
    mirror.set(view("g", holder="a", queue=("b",), nodes={"n1": ["a"]}), view(EVIL, holder=EVIL))
    dash, _, registry = make(mirror, max_streams=3, min_interval=0.05, stuck_seconds=0.5)
    app = web.Application()
    app.router.add_routes(dash.routes())
    server = TestServer(app)
    await server.start_server()
    try:
        yield mirror, dash, server, registry
    finally:
        dash.stop()
        await server.close()


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[tuple[str, object]]:
    """The next ``n`` events of an SSE response (comments skipped)."""
    out: list[tuple[str, object]] = []
    name = ""
    async with asyncio.timeout(5):
        while len(out) < n:
            line = (await resp.content.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: ") :])))
    return out


async def test_page_is_constant_self_contained_and_under_a_strict_policy(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    _, _, server, _ = served
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/")) as resp:
            assert resp.status == 200
            body = await resp.read()
            csp = resp.headers["Content-Security-Policy"]
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert body == PAGE
    assert csp == content_security_policy()
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    text = PAGE.decode()
    # Nothing from elsewhere (no internet on the machines), and no markup built from data.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "innerHTML" not in text and "outerHTML" not in text and "insertAdjacentHTML" not in text
    assert "document.write" not in text and "eval(" not in text


async def test_names_travel_as_json_data_never_as_markup(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    _, _, server, _ = served
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/state")) as resp:
            assert resp.content_type == "application/json"
            state = await resp.json()
    names = {g["name"]: g for g in state["groups"]}
    assert names[EVIL]["holder"] == EVIL  # shown as it is, escaped by the page (textContent)
    assert names["g"]["queue"] == ["b"] and names["g"]["queue_length"] == 1
    assert names["g"]["nodes"] == [{"node": "n1", "jobs": ["a"], "connected": False}]


@pytest.mark.parametrize(
    "query",
    [
        "group=%zz",
        "group=%ff%fe",
        "group=a&group=b",
        "nope=1",
        "group",
        "group=" + "<script>",
        "group=a/b",
        "group=..x",
        "&&&",
        "group=" + "x" * 2000,
    ],
)
async def test_a_malformed_query_string_is_refused_and_changes_nothing(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry], query: str
) -> None:
    _, dash, server, registry = served

    def state() -> tuple[object, ...]:
        snap = dash.snapshot()
        # Only the clock moves: the time now, and the chart's point for now.
        return (snap["groups"], snap["revision"], snap["history"][:-1], list(dash.recent))

    before = (state(), dash.streams)
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/events", "/state"):
            url = f"http://{server.host}:{server.port}{path}?{query}"
            async with http.get(url, skip_auto_headers=()) as resp:
                assert resp.status == 400, (path, query, resp.status)
    assert (state(), dash.streams) == before
    assert registry.get_sample_value("timeslice_dashboard_refused_total", {"reason": "bad_query"})


def test_parse_query_accepts_what_the_page_sends() -> None:
    assert parse_query("") == {}
    assert parse_query("group=g-1.a:b_c") == {"group": "g-1.a:b_c"}
    assert parse_query("group=g%2D1") == {"group": "g-1"}


async def test_streams_beyond_the_cap_get_503(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    _, dash, server, registry = served
    async with aiohttp.ClientSession() as http:
        open_ = [await http.get(server.make_url("/events")) for _ in range(3)]
        for resp in open_:
            assert resp.status == 200
            ((name, _),) = await read_events(resp, 1)
            assert name == "snapshot"
        assert dash.streams == 3
        async with http.get(server.make_url("/events")) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"]
        for resp in open_:
            resp.close()
    async with asyncio.timeout(5):
        while dash.streams:
            await asyncio.sleep(0.05)
    assert registry.get_sample_value(
        "timeslice_dashboard_refused_total", {"reason": "too_many_streams"}
    )


async def test_updates_coalesce_to_the_latest_state_and_switch_ends_are_kept(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    mirror, dash, server, _ = served
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/events?group=g")) as resp:
            ((name, snap),) = await read_events(resp, 1)
            assert name == "snapshot"
            assert isinstance(snap, dict) and [g["name"] for g in snap["groups"]] == ["g"]
            # A burst of changes: the browser gets the last state, in few messages.
            for i in range(200):
                mirror.set(view("g", holder="a", queue=tuple(f"j{k}" for k in range(i % 7))))
            mirror.set(
                view("g", holder="b", switches=1, last_switch=1.25, nodes={"n1": ["b"]}),
                view("other", holder="x"),  # not this stream's group
            )
            seen: list[tuple[str, object]] = []
            while True:
                seen += await read_events(resp, 1)
                groups = [d for n, d in seen if n == "groups"]
                last = groups[-1] if groups else None
                if isinstance(last, dict) and last["groups"][0]["holder"] == "b":
                    break
            assert len(groups) < 10, len(groups)
            assert all(g["name"] == "g" for d in groups for g in d["groups"])  # type: ignore[index]
            recent = [d for n, d in seen if n == "recent"]
            if not recent:
                recent = [d for _, d in await read_events(resp, 1)]
    assert dash.recent[0].to_json() | {"at": 0} == {
        "group": "g",
        "from": "a",
        "to": "b",
        "outcome": "committed",
        "seconds": 1.25,
        "at": 0,
        "emulated": False,
    }


async def test_a_switch_in_flight_shows_its_phase_and_nodes() -> None:
    mirror = FakeMirror()
    dash, _, _ = make(mirror)
    record = SwitchRecord(
        "sw1",
        "g",
        "b",
        12,
        [NodeStep("n1", "a", "b"), NodeStep("n2", "", "b")],
        SwitchPhase.CHECKPOINT,
        "r1",
        1000.0,
    )
    mirror.set(view("g", holder=None, queue=("b",), switch=record))
    (group,) = dash.snapshot()["groups"]
    switch = group["switch"]
    assert switch["phase"] == "checkpoint" and switch["to"] == "b" and switch["from"] == ["a"]
    assert (switch["done"], switch["total"]) == (1, 2)  # n2 has nothing to checkpoint
    dash.stop()


def test_recent_switches_and_history_are_bounded() -> None:
    mirror = FakeMirror()
    dash, _, _ = make(mirror, recent_switches=5, sample_seconds=1, history_seconds=10)
    for i in range(1, 50):
        mirror.set(view("g", holder=f"j{i}", switches=i, last_switch=0.1))
    assert len(dash.recent) == 5 and dash.recent[0].to_job == "j49"
    for _ in range(50):
        dash.sample()
    assert len(dash.history) == 10
    dash.stop()


async def test_a_stuck_browser_is_dropped_and_holds_bounded_memory() -> None:
    """A client that never reads: its buffers fill, the next write blocks past the deadline,
    and the stream is dropped; meanwhile what the stream owes is at most one entry a group."""
    mirror = FakeMirror()
    names = [f"group-{i:03d}-" + "x" * 200 for i in range(150)]
    mirror.set(*(view(n, holder="a" * 200, queue=tuple("q" * 200 + str(k) for k in range(20)))
                 for n in names))  # fmt: skip
    dash, _, registry = make(mirror, stuck_seconds=0.5, min_interval=0.0, max_groups=200)
    app = web.Application()
    app.router.add_routes(dash.routes())
    server = TestServer(app)
    await server.start_server()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a browser that never reads
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
        await asyncio.get_running_loop().sock_sendall(
            sock, b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        async with asyncio.timeout(5):
            while dash.streams == 0:
                await asyncio.sleep(0.01)
        (stream,) = dash._streams
        most = 0
        async with asyncio.timeout(20):
            flip = 0
            while dash.streams:
                flip += 1
                mirror.set(*(view(n, holder=f"b{flip}" * 50) for n in names))
                most = max(most, len(stream.dirty))
                await asyncio.sleep(0.01)
        assert most <= len(names)
        assert registry.get_sample_value("timeslice_dashboard_streams_dropped_total") == 1
        assert registry.get_sample_value("timeslice_dashboard_streams") == 0
        # The listener keeps no reference to the dropped stream.
        mirror.set(view(names[0], holder="c"))
        assert dash.streams == 0
    finally:
        sock.close()
        dash.stop()
        await server.close()


def sim_agent(node: str, *jobs: str, group: str = "g", emulated: bool = True) -> AgentRecord:
    return AgentRecord(
        node=node,
        replica="r1",
        backend="sim" if emulated else "cuda",
        emulated=emulated,
        connected_at=1000.0,
        workers=[WorkerRecord(j, group, 10 + i, 100_000_000) for i, j in enumerate(jobs)],
    )


def test_every_figure_an_emulated_backend_made_says_so() -> None:
    mirror = FakeMirror()
    mirror.agent_records = {"n1": sim_agent("n1", "a", "b"), "n2": sim_agent("n2", "a", "b")}
    mirror.set(view("g", holder="a", nodes={"n1": ["a"], "n2": ["a"]}))
    dash, _, _ = make(mirror)
    mirror.set(view("g", holder="b", switches=1, last_switch=0.75, nodes={"n1": ["b"]}))
    (group,) = dash.snapshot()["groups"]
    assert group["backends"] == ["sim"] and group["emulated"] is True
    assert dash.recent[0].emulated and dash.recent[0].to_json()["emulated"] is True
    switch = next(e for e in group["timeline"] if e["kind"] == "switch")
    assert switch["emulated"] is True and switch["seconds"] == 0.75
    # A real backend: nothing is labelled.
    mirror.set_agents(n1=sim_agent("n1", "a", "b", emulated=False))
    mirror.set(view("g", holder="a", switches=2, last_switch=0.5, nodes={"n1": ["a"]}))
    (group,) = dash.snapshot()["groups"]
    assert group["backends"] == ["cuda"] and group["emulated"] is False
    assert dash.recent[0].emulated is False
    dash.stop()


def test_the_timeline_shows_who_held_and_how_long_each_switch_took() -> None:
    mirror = FakeMirror()
    wall = [5000.0]
    mirror.set(view("g"))
    dash = Dashboard(mirror, HoldTracker(), wall=lambda: wall[0])
    dash.start()
    mirror.set(view("g", holder="a"))
    wall[0] = 5010.0
    record = SwitchRecord(
        "sw1", "g", "b", 12, [NodeStep("n1", "a", "b")], SwitchPhase.CHECKPOINT, "r1", 5010.0
    )
    mirror.set(view("g", queue=("b",), switch=record))  # a's hold ends: the switch starts
    wall[0] = 5011.25
    mirror.set(view("g", holder="b", switches=1, last_switch=1.25))
    (group,) = dash.snapshot()["groups"]
    assert group["timeline"] == [
        {"kind": "hold", "job": "a", "start": 5000.0, "end": 5010.0},
        {
            "kind": "switch",
            "from": "a",
            "to": "b",
            "start": 5010.0,
            "end": 5011.25,
            "seconds": 1.25,
            "outcome": "committed",
            "emulated": False,
        },
        {"kind": "hold", "job": "b", "start": 5011.25, "end": None},
    ]
    # Quiet for longer than the chart goes back: the timeline goes with it.
    mirror.set(view("g", switches=1))
    wall[0] += dash.config.history_seconds + 1
    dash.sample()
    assert "g" not in dash.story.timelines
    mirror.views.clear()
    mirror.set()
    dash.stop()


def test_colours_are_per_name_and_a_new_group_recolours_nothing() -> None:
    mirror = FakeMirror()
    mirror.set(view("train", holder="a"))
    dash, tracker, _ = make(mirror)
    tracker.observe("train", 1, 0.0)
    first = {g["name"]: g["color"] for g in dash.snapshot()["groups"]}
    mirror.set(view("aaa-new", holder="b"))  # sorts first: a colour by position would move
    tracker.observe("aaa-new", 2, 0.0)
    snap = dash.snapshot()
    second = {g["name"]: g["color"] for g in snap["groups"]}
    assert second["train"] == first["train"] == group_color("train")
    assert second["aaa-new"] == group_color("aaa-new") != second["train"]
    point = snap["history"][-1]
    assert point["colors"] == {g: group_color(g) for g in point["duty"]}
    dash.stop()


def test_duty_is_shown_over_the_time_watched() -> None:
    """A group that appeared 30 s ago and was held 18 s of them: 60% over 30 s."""
    mirror = FakeMirror()
    clock = [600.0]
    tracker = HoldTracker(window=300)
    tracker.begin(0.0, [])
    dash = Dashboard(mirror, tracker, clock=lambda: clock[0])
    dash.start()
    mirror.set(view("g"))
    tracker.observe("g", 0, 600.0)
    for k in range(3):
        tracker.observe("g", 10 + k, 600.0 + 10 * k)
        tracker.observe("g", 0, 606.0 + 10 * k)
    clock[0] = 630.0
    (group,) = dash.snapshot()["groups"]
    assert (group["duty"], group["duty_over"]) == (0.6, 30.0)
    dash.stop()


def test_the_nodes_view_shows_backend_connection_and_parked_bytes() -> None:
    mirror = FakeMirror()
    mirror.agent_records = {
        "n1": sim_agent("n1", "a", "b"),
        "n2": sim_agent("n2", "c", group="h", emulated=False),
    }
    mirror.set(view("g", holder="b", nodes={"n1": ["b"]}, parked={"n1": ["a"]}))
    dash, _, _ = make(mirror)
    nodes = {n["node"]: n for n in dash.snapshot()["nodes"]}
    assert nodes["n1"]["backend"] == "sim" and nodes["n1"]["emulated"] is True
    assert nodes["n1"]["parked"] == ["a"] and nodes["n1"]["parked_bytes"] == 100_000_000
    assert nodes["n1"]["connected_at"] == 1000.0 and nodes["n1"]["host_free_bytes"] is None
    assert nodes["n2"]["backend"] == "cuda" and nodes["n2"]["emulated"] is False
    assert nodes["n2"]["parked_bytes"] == 0
    dash.stop()


def test_dashboard_url_is_one_people_can_open() -> None:
    assert dashboard_url("127.0.0.1", 8080) == "http://127.0.0.1:8080/"
    assert dashboard_url("0.0.0.0", 9090) == "http://localhost:9090/"
    assert dashboard_url("::", 9090) == "http://localhost:9090/"
    assert dashboard_url("::1", 80) == "http://[::1]:80/"
    assert dashboard_url("orch.example", 8081) == "http://orch.example:8081/"


def test_timelines_are_bounded_in_groups_and_entries() -> None:
    mirror = FakeMirror()
    dash, _, _ = make(mirror, timeline_groups=3, timeline_entries=4)
    for i in range(10):
        mirror.set(*(view(f"g{k}", holder=f"j{i}") for k in range(6)))
    assert len(dash.story.timelines) == 3  # the first three to be held (in a set's order)
    # Four kept, and the hold in progress.
    assert all(len(t.entries(since=0)) == 4 + 1 for t in dash.story.timelines.values())
    dash.stop()


async def test_a_stream_gets_the_nodes_view_again_only_when_parked_jobs_change(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    mirror, _, server, _ = served
    mirror.set_agents(n1=sim_agent("n1", "a", "b"))
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/events")) as resp:
            ((name, snap),) = await read_events(resp, 1)
            assert name == "snapshot" and isinstance(snap, dict)
            assert [n["node"] for n in snap["nodes"]] == ["n1"]
            mirror.set(view("g", holder="a", queue=("c",), nodes={"n1": ["a"]}))
            ((name, update),) = await read_events(resp, 1)
            assert name == "groups" and isinstance(update, dict) and "nodes" not in update
            mirror.set(view("g", holder="b", nodes={"n1": ["b"]}, parked={"n1": ["a"]}))
            ((name, update),) = await read_events(resp, 1)
            assert name == "groups" and isinstance(update, dict)
            (node,) = update["nodes"]
            assert node["parked"] == ["a"] and node["parked_bytes"] == 100_000_000


class FakeHosts:
    """The hub's host memory reports, as the dashboard reads them."""

    def __init__(self) -> None:
        self.reports: dict[str, HostReport] = {}
        self.host_version = 0

    def host_report(self, node: str) -> HostReport | None:
        return self.reports.get(node)

    def heard(self, node: str, available: int, at: float) -> None:
        self.reports[node] = HostReport(available, at, modelled=True)
        self.host_version += 1


async def test_host_memory_free_is_shown_for_streams_held_here_and_resent_with_samples(
    served: tuple[FakeMirror, Dashboard, TestServer, CollectorRegistry],
) -> None:
    mirror, dash, server, _ = served
    hosts = FakeHosts()
    dash.hosts = hosts
    other = sim_agent("n2")
    other.replica = "r2"  # its stream is held by another replica
    mirror.set_agents(n1=sim_agent("n1", "a"), n2=other)
    hosts.heard("n1", 12_300_000_000, 1004.0)
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/events")) as resp:
            ((name, snap),) = await read_events(resp, 1)
            assert name == "snapshot" and isinstance(snap, dict)
            n1, n2 = snap["nodes"]
            assert (n1["host_free_bytes"], n1["host_heard_at"]) == (12_300_000_000, 1004.0)
            assert n1["host_emulated"] is True and n1["host_reported_to"] is None
            assert n2["host_free_bytes"] is None and n2["host_reported_to"] == "r2"
            # A heartbeat's new figure reaches the page with the next sample.
            hosts.heard("n1", 9_000_000_000, 1009.0)
            dash.sample()
            events = dict(await read_events(resp, 2))
            assert set(events) == {"duty", "nodes"}
            update = events["nodes"]
            assert isinstance(update, dict)
            assert update["nodes"][0]["host_free_bytes"] == 9_000_000_000
            # Nothing new heard: the next sample sends no nodes view.
            dash.sample()
            ((name, _),) = await read_events(resp, 1)
            assert name == "duty"


def test_start_decodes_nothing_of_an_idle_group_and_still_sees_its_first_switch() -> None:
    """A deployment of 100,000 idle groups: the start reads the held and busy ones only (the
    replica's start on them, tests/integration/test_scale.py); an idle group is first seen at
    its next change, before any switch of it can end."""

    class CountingMirror(FakeMirror):
        def __init__(self) -> None:
            super().__init__()
            self.stats_read: list[str] = []

        def stats(self, group: str) -> GroupStats | None:
            self.stats_read.append(group)
            return super().stats(group)

    mirror = CountingMirror()
    mirror.set(*(view(f"idle-{i}") for i in range(50)), view("held", holder="a"))
    dash = Dashboard(mirror, HoldTracker())
    dash.start()
    assert mirror.stats_read == ["held"]

    record = SwitchRecord(
        "sw1", "idle-7", "b", 12, [NodeStep("n1", "", "b")], SwitchPhase.CHECKPOINT, "r1", 1.0
    )
    mirror.set(view("idle-7", queue=("b",), switch=record))
    mirror.set(view("idle-7", holder="b", switches=1, last_switch=0.5))
    (end,) = dash.recent
    assert (end.group, end.to_job, end.outcome, end.seconds) == ("idle-7", "b", "committed", 0.5)
    mirror.views.clear()
    mirror.set()
    dash.stop()
