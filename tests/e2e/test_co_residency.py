"""Residency-aware switching: with --co-residency, a job whose state fits next to the others
stays on the devices, and the least recently used job is the one evicted when space runs out."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import ClusterFactory
from tests.faults.harness import journals
from timeslice import AsyncTimeSliceClient, register
from timeslice_agent.journal import JournalEntry


async def test_jobs_that_fit_share_the_devices(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        agents=1,
        orchestrator_args=["--co-residency"],
        agent_args=["--sim-capacity-gb", "80", "--sim-bandwidth-gbps", "200"],
    )
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id=j, socket=socket, state_bytes=30 * 10**9) for j in "abc"]
    try:
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
            AsyncTimeSliceClient(cluster.target, job_id="c") as c,
        ):
            for client in (a, b):
                await client.acquire("g", timeout=20)
                await client.yield_("g")
            again = await a.acquire("g", timeout=20)  # 30 + 30 GB fit in 80: still there
            assert not again.restored
            await a.yield_("g")
            status = await a.status("g")
            assert list(status.nodes[0].resident_jobs) == ["b", "a"]
            assert not [e for e in journals(cluster) if e.kind == "checkpoint"]

            await c.acquire("g", timeout=20)  # 90 GB would not fit: b, used least recently, goes
            await c.yield_("g")
            evicted = [e.job for e in journals(cluster) if e.kind == "checkpoint"]
            assert evicted == ["b"]
            status = await a.status("g")
            assert list(status.nodes[0].resident_jobs) == ["a", "c"]
            assert status.nodes[0].resident_job_id == "c"
    finally:
        for w in workers:
            w.close()


async def test_prefetch_restores_the_next_job_while_the_holder_runs(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        agents=1,
        orchestrator_args=["--co-residency", "--prefetch"],
        # 30 GB at 30 GB/s: a restore takes a second.
        agent_args=["--sim-capacity-gb", "80", "--sim-bandwidth-gbps", "30"],
    )
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id=j, socket=socket, state_bytes=30 * 10**9) for j in "abc"]
    try:
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
            AsyncTimeSliceClient(cluster.target, job_id="c") as c,
        ):
            for client in (b, a, c):  # c's arrival parks b, the least recently used
                await client.acquire("g", timeout=20)
                await client.yield_("g")
            assert [e.job for e in journals(cluster) if e.kind == "checkpoint"] == ["b"]

            await a.acquire("g", timeout=20)
            waiter = asyncio.create_task(b.acquire("g", timeout=20))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the prefetch: b comes back beside a (c leaves)
                status = await a.status("g")
                if "b" in status.nodes[0].resident_jobs and status.switch is None:
                    break
                await asyncio.sleep(0.05)
            assert list(status.nodes[0].resident_jobs) == ["a", "b"]
            assert status.holder_job_id == "a" and not waiter.done()

            def restores_of_b() -> list[JournalEntry]:
                return [e for e in journals(cluster) if e.kind == "restore" and e.job == "b"]

            restores = restores_of_b()
            await a.yield_("g")
            grant = await waiter
            assert not grant.restored, "b was already on the devices"
            # Nothing moved between the yield and the grant (a restore would be journalled
            # before its ack, and the grant waits for the ack).
            assert restores_of_b() == restores
            await b.yield_("g")
    finally:
        for w in workers:
            w.close()
