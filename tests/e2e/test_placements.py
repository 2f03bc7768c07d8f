"""Automatic placement end to end (docs/placement.md): real replicas, etcd and a sim agent.

Jobs ask for a role in a pool instead of a group; the orchestrator places them, they run
through the group it chose, a job whose measured phases changed is moved at its restart point
(never while it runs), and mutual exclusion, FIFO and fencing hold on what was recorded. A
replica killed while it places loses no assignment.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ClusterFactory
from tests.faults.harness import journals
from timeslice import AsyncTimeSliceClient, TimeSliceOrchestratorClient, register
from timeslice._roles import wire_profile
from timeslice.cli.base import call, parse_targets
from timeslice.errors import InvalidArgument, NotFound, PermissionDenied
from timeslice.integrations import verl
from timeslice.placement import JobProfile, Mode
from timeslice_orchestrator.visibility import OTHER_JOB
from timeslice_proto.timeslice.placement.v1 import (
    CreatePoolRequest,
    GetPoolRequest,
    PlacementStub,
    PlaceRequest,
    PlaceResponse,
    Pool,
    RuleKind,
    UpdatePoolRequest,
)
from timeslice_proto.timeslice.v1 import TimeSliceStub
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Hold,
    Recorder,
    check_fencing,
    check_fifo,
    check_mutual_exclusion,
)

POOL = "e2e-pool"
GROUPS = ["pg-1", "pg-2"]


async def _operator(cluster: LocalCluster, what: str, rpc: Any) -> Any:
    """One call with the tests' operator certificate, to the first replica that answers."""

    async def stubbed(stub: TimeSliceStub, timeout: float) -> Any:
        return await rpc(PlacementStub(stub.channel), timeout)

    return await call(parse_targets(cluster.target), what, stubbed)


async def _pool(cluster: LocalCluster, target: str | None = None) -> Pool:
    async def rpc(stub: TimeSliceStub, timeout: float) -> Pool:
        return await PlacementStub(stub.channel).get_pool(GetPoolRequest(POOL), timeout=timeout)

    return await call(parse_targets(target or cluster.target), "GetPool", rpc)


def _cli(cluster: LocalCluster, *args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", *args, "--target", cluster.target, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
        env={**os.environ, **cluster.client_env},
    )  # fmt: skip
    return json.loads(out.stdout)


async def _steps(
    client: AsyncTimeSliceClient, role: str, recorder: Recorder, steps: int, on: float, off: float
) -> str:
    """``steps`` accelerator phases of ``on`` seconds through the role's scope, ``off`` apart."""
    scope = client.on_accelerators(pool=POOL, role=role, timeout=30)
    for _ in range(steps):
        async with scope as grant:
            start = recorder.now()
            await asyncio.sleep(on)
            recorder.hold(
                Hold(
                    client.job_id, scope.group_id, grant.epoch, grant.ticket, start, recorder.now()
                )
            )
        await asyncio.sleep(off)
    return scope.group_id


async def test_roles_are_placed_run_and_moved_only_at_their_restart_point(
    cluster_factory: ClusterFactory,
) -> None:
    # Room for one job's state at a time, moved in about 10 ms: every switch checkpoints
    # and restores (fenced directives in the journal) and costs little of a phase. The
    # pool's first group runs on node-0, its second on node-1.
    cluster = cluster_factory(
        agents=2, agent_args=["--sim-capacity-gb", "0.6", "--sim-state-gb", "0.5"]
    )
    socket, other_node = (str(cluster.agent_sockets[n]) for n in ("node-0", "node-1"))
    created = await asyncio.to_thread(
        _cli, cluster, "pool", "create", POOL, "--groups", ",".join(GROUPS), "--cap", "0.5"
    )
    assert created["groups"] == GROUPS
    recorder = Recorder()
    # Both declare a light sampler: the pool packs them onto one group (0.4 of a 0.5 cap).
    light = JobProfile(busy=0.2, period_seconds=0.4)
    a1 = AsyncTimeSliceClient(cluster.target, job_id="a", **cluster.job_tls("a"))
    b = AsyncTimeSliceClient(cluster.target, job_id="b", **cluster.job_tls("b"))
    async with b:
        async with a1:
            group_a = await a1.group_for(POOL, "sampler", profile=light)
            group_b = await b.group_for(POOL, "sampler", profile=light)
            assert group_a == group_b == GROUPS[0]
            workers = [
                await asyncio.to_thread(register, group_a, job_id=j, socket=socket)
                for j in ("a", "b")
            ]
            # a is far busier than it declared (its profile changed); b is light.
            busy_a = asyncio.ensure_future(_steps(a1, "sampler", recorder, 8, 0.3, 0.01))
            ran_b = asyncio.ensure_future(_steps(b, "sampler", recorder, 14, 0.03, 0.25))
            assert await busy_a == group_a
            # Measured busy now, but running (it holds the group): another process of a
            # asking again gets the group it runs on, never a move.
            async with a1.on_accelerators(pool=POOL, role="sampler", timeout=30):
                async with AsyncTimeSliceClient(
                    cluster.target, job_id="a", **cluster.job_tls("a")
                ) as again:
                    kept = await again.place(POOL, ["sampler"])
            assert kept.roles[0].group_id == group_a, kept
            assert kept.roles[0].decision == "kept", kept
            workers[0].close()  # a's process ends: its next start is a restart point
        # a restarts, measured: with b on its group it would exceed the cap, so it moves.
        async with AsyncTimeSliceClient(cluster.target, job_id="a", **cluster.job_tls("a")) as a2:
            answer = await a2.place(POOL, ["sampler"])
            moved = answer.roles[0]
            assert (moved.decision, moved.previous_group_id) == ("moved", group_a), (
                moved,
                await _pool(cluster),
            )
            assert moved.source == "measured" and not moved.provisional, moved
            assert moved.expected_busy > 0.4, moved
            # The client resolves (and keeps) the group the placement recorded.
            assert await a2.group_for(POOL, "sampler") == moved.group_id == GROUPS[1]
            worker = await asyncio.to_thread(
                register, moved.group_id, job_id="a", socket=other_node
            )
            assert await _steps(a2, "sampler", recorder, 3, 0.05, 0.01) == GROUPS[1]
            worker.close()
        assert await ran_b == group_b
        workers[1].close()
    check_mutual_exclusion(recorder.holds)
    check_fifo(recorder.holds)
    check_fencing(journals(cluster), nodes=["node-0", "node-1"])
    shown = await asyncio.to_thread(_cli, cluster, "place", POOL, "--show")
    what = [(e["what"], e["jobId"], e["groupId"]) for e in shown["audit"]]
    assert what[1:] == [
        ("placed", "a", GROUPS[0]),
        ("placed", "b", GROUPS[0]),
        ("moved", "a", GROUPS[1]),
    ], what
    duty = {d["groupId"]: d for d in shown["duty"]}
    assert duty[GROUPS[1]]["jobs"] == ["a/sampler"] and duty[GROUPS[0]]["jobs"] == ["b/sampler"]
    assert duty[GROUPS[0]]["measured"] > 0 and duty[GROUPS[1]]["expected"] > 0.4
    # The same figures on /metrics (the replica that placed knows the pool).
    url = f"http://{cluster.replica_http[0]}/metrics"
    scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    series = {
        (s.labels["group"], s.labels["kind"]): s.value
        for family in text_string_to_metric_families(scraped.decode())
        if family.name == "timeslice_placement_duty_ratio"
        for s in family.samples
    }
    assert series[(GROUPS[1], "expected")] == pytest.approx(duty[GROUPS[1]]["expected"])
    assert series[(GROUPS[0], "measured")] > 0


async def test_a_job_places_only_itself_and_only_operators_change_pools(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0)
    await _operator(
        cluster,
        "CreatePool",
        lambda stub, t: stub.create_pool(CreatePoolRequest(POOL, [*GROUPS, "pg-3"]), timeout=t),
    )
    async with AsyncTimeSliceClient(cluster.target, job_id="a", **cluster.job_tls("a")) as a:

        async def as_b(stub: TimeSliceStub, timeout: float) -> PlaceResponse:
            request = PlaceRequest(pool=POOL, job_id="b", roles=["main"])
            return await PlacementStub(stub.channel).place(request, timeout=timeout)

        with pytest.raises(PermissionDenied):
            await _as(a, as_b)

        async def create(stub: TimeSliceStub, timeout: float) -> Pool:
            request = CreatePoolRequest("other", ["x"])
            return await PlacementStub(stub.channel).create_pool(request, timeout=timeout)

        with pytest.raises(PermissionDenied):
            await _as(a, create)
        # Bad input is refused, typed, and records nothing.
        with pytest.raises(InvalidArgument):
            await a.place(POOL, ["main"], profiles={(POOL, "main"): _Busy(2.0)})  # type: ignore[dict-item]
        with pytest.raises(InvalidArgument):
            await a.place(POOL, ["main", "main"])
        with pytest.raises(NotFound):
            await a.place("no-such-pool", ["main"])
        assert (await _pool(cluster)).assignments == []
        first = await a.place(POOL, ["main"])
        assert first.placed
        placed_a = first.roles[0].group_id
        # Nothing was recorded for b by a.
        assert [x.job_id for x in (await _pool(cluster)).assignments] == ["a"]
        async with AsyncTimeSliceClient(cluster.target, job_id="b", **cluster.job_tls("b")) as b:
            assert (await b.place(POOL, ["main"])).placed

        async def read(stub: TimeSliceStub, timeout: float) -> Pool:
            request = GetPoolRequest(POOL)
            return await PlacementStub(stub.channel).get_pool(request, timeout=timeout)

        # A job reads its own assignments and audit entries only, and no other job's id (b
        # is excluded from sharing with a; both are placed alone); an operator reads all.
        await _operator(
            cluster,
            "UpdatePool",
            lambda stub, t: stub.update_pool(
                UpdatePoolRequest(POOL, RuleKind.EXCLUDE, "a", other_job_id="b"), timeout=t
            ),
        )
        again = await a.place(POOL, ["main"])
        own = await _as(a, read)
        assert [x.job_id for x in own.assignments] == ["a"]
        assert {e.job_id for e in own.audit} == {"a"}
        assert sorted(d.jobs[0] for d in own.duty if d.jobs) == ["a/main"]
        assert [(x.job_id, x.other_job_id) for x in own.excluded] == [("a", OTHER_JOB)]
        seen = own.to_json() + again.to_json()
        assert '"b"' not in seen and "b/main" not in seen, seen
        everything = (await _pool(cluster)).to_json()
        assert "b/main" in everything and '"b"' in everything
    assert [x.job_id for x in (await _pool(cluster)).assignments] == ["a", "b"]
    # The environment of a time-sliced veRL run may name a pool and a role instead of a group.
    with pytest.raises(InvalidArgument, match="TIMESLICE_TARGET"):
        verl.Slicer.from_env({"TIMESLICE_JOB_ID": "v", "TIMESLICE_POOL": POOL})
    env = {"TIMESLICE_JOB_ID": "v", "TIMESLICE_POOL": POOL, "TIMESLICE_TARGET": cluster.target}
    slicer = await asyncio.to_thread(verl.Slicer.from_env, env)
    try:
        # Unmeasured, each job gets a group of its own (the default profile is 60% busy).
        assert slicer.group_id == "pg-3"
    finally:
        await asyncio.to_thread(slicer.client.close)
    pool = await _pool(cluster)
    assert [(x.job_id, x.role, x.group_id) for x in pool.assignments][-1] == (
        "v",
        "trainer",
        slicer.group_id,
    )

    # The blocking client resolves and holds the role's group the same way (a is at its
    # restart point, measured by nothing yet: it stays).
    def hold_as_a() -> str:
        with TimeSliceOrchestratorClient(cluster.target, job_id="a") as c:
            scope = c.on_accelerators(pool=POOL, role="main", timeout=10)
            with scope as grant:
                assert c.grants()[scope.group_id].epoch == grant.epoch
            return c.group_for(POOL, "main")

    assert await asyncio.to_thread(hold_as_a) == placed_a


@dataclass(frozen=True)
class _Busy:
    """A profile as a client could send it, unchecked (JobProfile refuses busy > 1 itself)."""

    busy: float
    period_seconds: float = 1.0
    cv: float = 0.1
    mode: Mode = Mode.SYNC
    switch_seconds: float = 0.0


async def _as(client: AsyncTimeSliceClient, rpc: Any) -> Any:
    """A raw call over ``client``'s connection (its certificate)."""
    return await client._runner.run(client._core.unary("raw", rpc))


async def test_a_replica_killed_while_placing_loses_no_assignment(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=0)
    await _operator(
        cluster,
        "CreatePool",
        lambda stub, t: stub.create_pool(CreatePoolRequest(POOL, [*GROUPS, "pg-3"]), timeout=t),
    )
    first, second = cluster.targets
    roles = ["sampler", "trainer", "reward"]

    # Light roles, so that every one of them fits somewhere in the pool.
    light = JobProfile(busy=0.04, period_seconds=1.0)
    declared = [wire_profile(role, light) for role in roles]

    async def place(target: str, job: str) -> PlaceResponse:
        async def rpc(stub: TimeSliceStub, timeout: float) -> PlaceResponse:
            request = PlaceRequest(pool=POOL, job_id=job, roles=roles, profiles=declared)
            return await PlacementStub(stub.channel).place(request, timeout=timeout)

        return await call(parse_targets(target), f"Place({job})", rpc)

    # Two replicas placing the same job at once agree (one compared transaction wins).
    both = await asyncio.gather(place(first, "twice"), place(second, "twice"))
    assert [r.group_id for r in both[0].roles] == [r.group_id for r in both[1].roles]
    # Jobs placed through either replica while the first is killed mid-way.
    clients = [
        AsyncTimeSliceClient(f"{first},{second}", job_id=f"job-{n}", call_timeout=20)
        for n in range(6)
    ]
    try:
        profiles = {(POOL, role): light for role in roles}
        calls = [asyncio.ensure_future(c.place(POOL, roles, profiles=profiles)) for c in clients]
        await asyncio.sleep(0.05)
        cluster.kill_replica(0)
        answers = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    pool = await _pool(cluster, second)
    recorded = {(a.job_id, a.role): a.group_id for a in pool.assignments}
    for client, answer in zip(clients, answers, strict=True):
        assert isinstance(answer, PlaceResponse), answer  # failed over, never lost
        assert answer.placed, answer
        for r in answer.roles:
            assert recorded[(client.job_id, r.role)] == r.group_id, (client.job_id, r)
    # Every recorded job has all its roles (one transaction per placement: never half).
    jobs = {job for job, _ in recorded}
    assert all((job, role) in recorded for job in jobs for role in roles)
    assert {f"job-{n}" for n in range(6)} <= jobs
