"""Scheduling policies, the co-operative "please yield" signal, and multi-group acquire."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from timeslice import AsyncTimeSliceClient
from timeslice_proto.timeslice.v1 import GroupStatus
from timeslice_tools.history import Hold, Recorder, check_mutual_exclusion


def _queued(n: int) -> Callable[[GroupStatus], bool]:
    """Whether exactly ``n`` waiters are queued."""
    return lambda s: len(s.queue) == n


async def _queue_then_release(
    holder: AsyncTimeSliceClient, waiters: list[tuple[AsyncTimeSliceClient, int]]
) -> list[str]:
    """With ``holder`` holding g, queue the waiters in order, release, record grant order."""
    order: list[str] = []

    async def wait(client: AsyncTimeSliceClient, priority: int) -> None:
        await client.acquire("g", timeout=30, priority=priority)
        order.append(client.job_id)
        await asyncio.sleep(0.05)
        await client.yield_("g")

    tasks = []
    for n, (client, priority) in enumerate(waiters, start=1):
        tasks.append(asyncio.create_task(wait(client, priority)))
        await wait_for_status(holder, "g", _queued(n), 10)
    await holder.yield_("g")
    await asyncio.gather(*tasks)
    return order


async def test_priority_policy_serves_the_highest_priority_first(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, orchestrator_args=["--policy", "priority"])
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="holder") as holder,
        AsyncTimeSliceClient(cluster.target, job_id="low") as low,
        AsyncTimeSliceClient(cluster.target, job_id="mid") as mid,
        AsyncTimeSliceClient(cluster.target, job_id="high") as high,
    ):
        await holder.acquire("g")
        order = await _queue_then_release(holder, [(low, 0), (mid, 3), (high, 9)])
        assert order == ["high", "mid", "low"]
        assert (await holder.status("g")).policy == "priority"


async def test_fifo_is_the_default(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="holder") as holder,
        AsyncTimeSliceClient(cluster.target, job_id="low") as low,
        AsyncTimeSliceClient(cluster.target, job_id="high") as high,
    ):
        await holder.acquire("g")
        order = await _queue_then_release(holder, [(low, 0), (high, 9)])
        assert order == ["low", "high"]


async def test_fair_share_serves_the_least_served_first(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0, orchestrator_args=["--policy", "fair"])
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="holder") as holder,
        AsyncTimeSliceClient(cluster.target, job_id="greedy") as greedy,
        AsyncTimeSliceClient(cluster.target, job_id="modest") as modest,
    ):
        await greedy.acquire("g")
        await asyncio.sleep(0.5)  # greedy has used the group for a while
        await greedy.yield_("g")
        await modest.acquire("g")
        await modest.yield_("g")
        # The replica's mirror shows modest's usage a moment after its yield returns.
        status = await wait_for_status(
            holder, "g", lambda s: "modest" in {u.job_id for u in s.usage}, 10
        )
        usage = {u.job_id: u.held_seconds for u in status.usage}
        assert usage["greedy"] > 0.4 and usage["modest"] < usage["greedy"]
        await holder.acquire("g")
        # greedy queues first, but modest has held the group far less.
        order = await _queue_then_release(holder, [(greedy, 0), (modest, 0)])
        assert order == ["modest", "greedy"]


async def test_holder_past_the_maximum_hold_is_asked_to_yield(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, orchestrator_args=["--max-hold", "0.5"])
    asked: list[str] = []
    async with (
        AsyncTimeSliceClient(
            cluster.target, job_id="long", session_ttl=1, on_yield_request=asked.append
        ) as long,
        AsyncTimeSliceClient(cluster.target, job_id="next") as nxt,
    ):
        await long.acquire("g")
        await asyncio.sleep(1.0)
        assert not long.yield_requested("g"), "nobody waits: no reason to ask"
        waiter = asyncio.create_task(nxt.acquire("g", timeout=20))
        for _ in range(100):
            if long.yield_requested("g"):
                break
            await asyncio.sleep(0.05)
        assert long.yield_requested("g") and asked == ["g"]
        assert not waiter.done(), "co-operative: nothing is taken away by force"
        await long.yield_("g")
        await waiter
        await nxt.yield_("g")
        assert not long.yield_requested("g")


async def test_acquire_all_never_deadlocks(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    recorder = Recorder()
    rng = random.Random(3)

    async def job(name: str, groups: list[str]) -> int:
        async with AsyncTimeSliceClient(cluster.target, job_id=name) as client:
            for _ in range(15):
                grants = await client.acquire_all(groups, timeout=30)
                start = recorder.now()
                await asyncio.sleep(rng.uniform(0, 0.01))
                end = recorder.now()
                for g, grant in grants.items():
                    recorder.hold(Hold(name, g, grant.epoch, grant.ticket, start, end))
                await client.yield_all(list(grants))
        return 15

    # Opposite orders on purpose: naive one-by-one acquisition would deadlock here.
    # Unpacked, so gather is typed as returning the list it returns at run time.
    jobs = [
        job("trainer-sync", ["trainer", "sampler"]),
        job("sampler-sync", ["sampler", "trainer"]),
        job("trainer-only", ["trainer"]),
    ]
    done = await asyncio.wait_for(asyncio.gather(*jobs), 90)
    assert done == [15, 15, 15]
    check_mutual_exclusion(recorder.holds)
