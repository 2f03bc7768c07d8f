"""Host memory free in the dashboard's nodes view, end to end on real processes: a sim agent
with a modelled host reports what it can still park into in its hello and heartbeats; the
replica holding its stream shows the figure (labelled emulated, with when it was heard), and it
goes down once a checkpoint parks a job's state there. The other replica does not guess: it
names the replica that holds the figure.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register

GB = 1_000_000_000
# A 6 GB modelled host, 1 GB states: parking one state leaves 5 GB.
AGENT = ["--sim-state-gb", "1", "--sim-bandwidth-gbps", "50", "--host-memory-gb", "6"]


def _state(http: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{http}/state", timeout=5) as resp:
        found = json.loads(resp.read())
    assert isinstance(found, dict)
    return found


async def _node_row(
    http: str, node: str, check: Callable[[dict[str, Any]], bool], timeout: float = 15
) -> dict[str, Any]:
    """The node's row of the replica's nodes view, once ``check`` holds for it."""
    deadline = time.monotonic() + timeout
    row: dict[str, Any] = {}
    while True:
        state = await asyncio.to_thread(_state, http)
        rows = [r for r in state["nodes"] if r["node"] == node]
        if rows:
            row = rows[0]
            if check(row):
                return row
        if time.monotonic() > deadline:
            raise AssertionError(f"replica {http}: the nodes view never showed it; last: {row}")
        await asyncio.sleep(0.2)


async def test_the_nodes_view_shows_host_memory_free_and_who_holds_it(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=1, agent_args=AGENT)
    (node,) = cluster.nodes
    socket = str(cluster.agent_sockets[node])
    workers = [register("g", job_id=job, socket=socket) for job in ("a", "b")]
    try:
        # The replica holding the agent's stream: the record says which.
        holder_row = await _node_row(cluster.replica_http[0], node, lambda r: bool(r["replica"]))
        by_id = {_state(http)["replica"]: http for http in cluster.replica_http}
        holder = holder_row["replica"]
        (other,) = [rid for rid in by_id if rid != holder]
        row = await _node_row(by_id[holder], node, lambda r: r["host_free_bytes"] == 6 * GB)
        assert row["host_emulated"] is True and row["host_reported_to"] is None
        assert abs(row["host_heard_at"] - time.time()) < 10
        far = await _node_row(by_id[other], node, lambda r: r["host_reported_to"] is not None)
        assert far["host_reported_to"] == holder and far["host_free_bytes"] is None

        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
        ):
            await a.acquire("g", timeout=20)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            await asyncio.sleep(0.5)
            await a.yield_("g")
            await waiter  # a's 1 GB state is parked in the modelled host now
            row = await _node_row(by_id[holder], node, lambda r: r["parked"] == ["a"])
            assert row["parked_bytes"] == GB
            # The next heartbeat says so (every liveness timeout / 8: half a second).
            row = await _node_row(by_id[holder], node, lambda r: r["host_free_bytes"] == 5 * GB)
            assert row["host_emulated"] is True
            await b.yield_("g")
    finally:
        for w in workers:
            w.close()
