"""The dashboard's placement pools (dashboard_pools.py) on a fake mirror and a fake pool
store: the JSON a page gets (groups with expected vs measured duty, each role's decision and
reason), reads only while a page is open and at most every refresh, and a failed or slow read
shown with its reason without holding the event stream back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.unit.test_dashboard import FakeMirror, make, read_events, view
from timeslice_orchestrator.dashboard import Dashboard
from timeslice_orchestrator.dashboard_pools import PoolsConfig, PoolsPanel
from timeslice_orchestrator.dashboard_story import group_color
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.pools import PoolState
from timeslice_orchestrator.store.records import (
    DeclaredProfile,
    PoolAssignmentsRecord,
    PoolAuditRecord,
    PoolPin,
    PoolRecord,
    RoleAssignment,
)

EVIL = "<b>x</b>"


def assignment(group: str, decision: str, reason: str, source: str) -> RoleAssignment:
    profile = DeclaredProfile(0.3, 2.0, 0.5, "sync", 0.0, source)
    return RoleAssignment(group, decision, reason, profile, 1000.0, "r1")


def pool_state() -> PoolState:
    config = PoolRecord(
        groups=["g1", "g2"],
        cap=0.8,
        created_at=1.0,
        pins=[PoolPin("b", "trainer", "g2")],
        excluded=[["a", "c"]],
        drained=["g2"],
        claims={"g1": "gpus-a"},
    )
    assignments = PoolAssignmentsRecord(
        jobs={
            "a": {"sampler": assignment("g1", "placed", "placed on g1: alone", "declared")},
            "b": {"trainer": assignment("g2", "pinned", f"pinned to g2 {EVIL}", "measured")},
        },
        expected={"g1": 0.31234, "g2": 0.5},
    )
    return PoolState("p1", config, assignments, PoolAuditRecord())


class FakePools:
    """The reads the panel makes of the pool store; ``fail``/``hang`` break them."""

    def __init__(self, *states: PoolState) -> None:
        self.states = {s.pool: s for s in states}
        self.fail: Exception | None = None
        self.hang = False

    async def pools(self) -> list[str]:
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail is not None:
            raise self.fail
        return sorted(self.states)

    async def read(self, pool: str) -> PoolState | None:
        return self.states.get(pool)


class FakeDuty:
    """``DutyBook``'s figures, as a test sets them."""

    def __init__(self) -> None:
        self.seen_pools: list[str] = []

    def seen(self, state: PoolState) -> None:
        self.seen_pools.append(state.pool)

    def measured(self, state: PoolState, group: str) -> float:
        return {"g1": 0.25, "g2": 0.0}[group]


async def test_the_pools_json_has_each_groups_duty_and_each_roles_decision_and_reason() -> None:
    duty = FakeDuty()
    panel = PoolsPanel(FakePools(pool_state()), duty)
    assert await panel.fresh()
    shown = panel.json()
    assert shown["error"] == "" and shown["omitted"] == 0 and shown["at"] > 0
    (pool,) = shown["pools"]
    assert pool["name"] == "p1" and pool["cap"] == 0.8
    assert pool["groups"] == [
        {
            "name": "g1",
            "color": group_color("g1"),
            "expected": 0.3123,
            "measured": 0.25,
            "drained": False,
            "claim": "gpus-a",
            "jobs": ["a/sampler"],
        },
        {
            "name": "g2",
            "color": group_color("g2"),
            "expected": 0.5,
            "measured": 0.0,
            "drained": True,
            "claim": "",
            "jobs": ["b/trainer"],
        },
    ]
    assert pool["pins"] == ["b/trainer -> g2"] and pool["excluded"] == ["a + c"]
    assert [(a["job"], a["role"], a["group"], a["decision"]) for a in pool["assignments"]] == [
        ("a", "sampler", "g1", "placed"),
        ("b", "trainer", "g2", "pinned"),
    ]
    first, second = pool["assignments"]
    assert first["reason"] == "placed on g1: alone"
    assert (first["provisional"], first["source"]) == (True, "declared")
    assert second["reason"] == f"pinned to g2 {EVIL}"  # data, escaped by the page (textContent)
    assert (second["provisional"], second["source"]) == (False, "measured")
    assert duty.seen_pools == ["p1"]  # the metric follows what the page shows


async def test_a_failed_or_slow_read_shows_its_reason_within_the_deadline() -> None:
    reader = FakePools(pool_state())
    panel = PoolsPanel(reader, FakeDuty(), PoolsConfig(refresh_seconds=0.01, deadline_seconds=0.2))
    await panel.fresh()
    reader.fail = StoreUnavailable("etcd at 127.0.0.1:1 unreachable")
    await asyncio.sleep(0.02)
    assert await panel.fresh()
    assert panel.json()["error"] == "etcd at 127.0.0.1:1 unreachable"
    assert panel.json()["pools"][0]["name"] == "p1"  # the last read stays, under the error
    reader.fail, reader.hang = None, True
    await asyncio.sleep(0.02)
    started = time.monotonic()
    assert await panel.fresh()
    assert time.monotonic() - started < 2.0  # the deadline (0.2 s), generously
    assert panel.json()["error"] == "etcd did not answer within 0.2 s"
    reader.hang = False
    await asyncio.sleep(0.02)
    assert await panel.fresh()
    assert panel.json()["error"] == ""


async def test_pools_are_read_at_most_every_refresh() -> None:
    panel = PoolsPanel(FakePools(pool_state()), FakeDuty(), PoolsConfig(refresh_seconds=60))
    results = await asyncio.gather(*(panel.fresh() for _ in range(5)))
    assert sorted(results) == [False, False, False, False, True]
    assert panel.reads == 1  # at once or later, one read per refresh


def test_pools_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        PoolsConfig(refresh_seconds=0)
    with pytest.raises(ValueError):
        PoolsConfig(max_pools=0)


@pytest.fixture
async def with_pools() -> AsyncIterator[tuple[FakePools, PoolsPanel, Dashboard, TestServer]]:
    mirror = FakeMirror()
    mirror.set(view("g1", holder="a"))
    dash, _, _ = make(mirror, min_interval=0.05, ping_seconds=0.2)
    reader = FakePools()
    panel = PoolsPanel(reader, FakeDuty(), PoolsConfig(refresh_seconds=0.1, deadline_seconds=0.5))
    dash.pools = panel
    app = web.Application()
    app.router.add_routes(dash.routes())
    server = TestServer(app)
    await server.start_server()
    runner = asyncio.create_task(dash.run())
    try:
        yield reader, panel, dash, server
    finally:
        runner.cancel()
        dash.stop()
        await server.close()


async def test_a_page_gets_the_pools_as_they_change_and_no_page_means_no_reads(
    with_pools: tuple[FakePools, PoolsPanel, Dashboard, TestServer],
) -> None:
    reader, panel, dash, server = with_pools
    await asyncio.sleep(0.3)
    assert panel.reads == 0  # no page open
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/events")) as resp:
            ((name, snapshot),) = await read_events(resp, 1)
            assert name == "snapshot"
            assert isinstance(snapshot, dict) and snapshot["pools"]["pools"] == []
            reader.states["p1"] = pool_state()
            # The stream never waited for a read: the pools come as their own event.
            while True:
                ((name, data),) = await read_events(resp, 1)
                if name == "pools":
                    break
            assert isinstance(data, dict)
            assert [p["name"] for p in data["pools"]] == ["p1"]
            reader.fail = StoreUnavailable("etcd down")
            while True:
                ((name, data),) = await read_events(resp, 1)
                if name == "pools":
                    break
            assert isinstance(data, dict) and data["error"] == "etcd down"
        # /state reads on demand (under the deadline) and carries the same JSON.
        reader.fail = None
        await asyncio.sleep(0.15)
        async with http.get(server.make_url("/state")) as resp:
            state = await resp.json()
        assert state["pools"]["error"] == "" and state["pools"]["pools"][0]["name"] == "p1"
    async with asyncio.timeout(10):  # the stream's handler notices the browser went (pings)
        while dash.streams:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.15)  # a read under way ends
    reads = panel.reads
    await asyncio.sleep(0.5)
    assert panel.reads == reads  # no page open: no more reads
