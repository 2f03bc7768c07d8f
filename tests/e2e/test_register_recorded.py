"""A worker told it is registered is known to the orchestrator: it may acquire at once.

The agent reports its workers to the orchestrator over its stream, and the orchestrator writes
them to etcd. ``register()`` returned as soon as the agent had the worker, so an acquire right
after it could be planned without it: granted in place, with nothing checkpointed, while the
holder's state stayed on the devices beside the new job's (seen as a flake in the driver-kill
test, whose switch then moved nothing). The agent now answers a registration once the
orchestrator has confirmed the worker set that includes it (WorkersRecorded).
"""

from __future__ import annotations

import asyncio

from tests.conftest import ClusterFactory
from tests.faults.harness import journals
from timeslice import AsyncTimeSliceClient, register

FAST_SIM = ["--sim-state-gb", "0.25"]


async def test_a_job_that_acquires_right_after_registering_gets_a_switch(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=1, agent_args=FAST_SIM)
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id="a", socket=socket)]
    try:
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
        ):
            await a.acquire("g", timeout=20)
            workers.append(await asyncio.to_thread(register, "g", job_id="b", socket=socket))
            # Confirmed by the orchestrator, not let through at the end of the agent's wait.
            assert "has not confirmed" not in cluster.log_tail("node-0", 400)
            waiting = asyncio.create_task(b.acquire("g", timeout=20))
            await asyncio.sleep(0.2)
            await a.yield_("g")
            await waiting
            # b's state is on node-0 with a's: the switch to b checkpointed a first.
            moved = [e for e in journals(cluster) if e.kind == "checkpoint" and e.job == "a"]
            assert moved and moved[0].status == "ok", journals(cluster)
            await b.yield_("g")
    finally:
        for worker in workers:
            worker.close()
