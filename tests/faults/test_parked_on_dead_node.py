"""A job whose worker is parked on a node whose agent died is not granted until it is restored
there (issue 37, 8).

Real processes: etcd, one replica and two ``freeze`` agents, each job with a real worker
process on each node (SIGSTOP / SIGCONT of those processes is how the backend parks a job).
Node-1's agent is killed (SIGKILL) while a is parked there, its worker stopped. Before the fix
a was granted on node-0 alone, told it held the group while its worker on node-1 stayed
stopped until the agent came back. Now a's grant waits, with the reason in the group's
``last_error``, and is faulted with that reason once the wait passes its deadline (the
directive timeout); b, whose worker on node-1 kept running, is still served; once node-1's
agent is back, a is restored there before it is granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import describe, wait_for_status
from timeslice import AsyncTimeSliceClient, Grant, WorkerRegistration, register
from timeslice.errors import GroupFaulted
from timeslice_agent.procs import process_state
from timeslice_tools.dev.cluster import LocalCluster

pytestmark = pytest.mark.slow

NODES = ("node-0", "node-1")
JOBS = ("a", "b")
AGENT_TTL = 2  # node-1's record goes this long after its agent dies
# A worker: does nothing, but is a process of its own that the freeze backend can stop.
WORKER = "import time\nwhile True:\n    time.sleep(0.05)\n"


def _state(pid: int) -> str:
    state = process_state(pid)
    assert state is not None, f"worker {pid} is gone"
    return state


def _stopped(pid: int) -> bool:
    return _state(pid) in ("T", "t")


class _Workers:
    """One worker process per job and node, registered with that node's agent."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.registrations: list[WorkerRegistration] = []
        for job in JOBS:
            for node in NODES:
                proc = subprocess.Popen(
                    [sys.executable, "-c", WORKER], env={**os.environ, "TIMESLICE_JOB_ID": job}
                )
                self.procs[job, node] = proc
                self.registrations.append(
                    register("g", job_id=job, pid=proc.pid, socket=str(cluster.agent_sockets[node]))
                )

    def pid(self, job: str, node: str) -> int:
        return self.procs[job, node].pid

    def states(self) -> dict[str, str]:
        return {f"{j}@{n}": _state(p.pid) for (j, n), p in self.procs.items()}

    def close(self) -> None:
        for registration in self.registrations:
            registration.close()
        for proc in self.procs.values():
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait()


def _freeze_cluster(cluster_factory: ClusterFactory, directive_timeout: float) -> LocalCluster:
    return cluster_factory(
        replicas=1,
        agents=2,
        backend="freeze",
        orchestrator_args=[
            "--agent-ttl",
            str(AGENT_TTL),
            # Also how long a held-back grant waits before it is faulted.
            "--directive-timeout",
            str(directive_timeout),
        ],
    )


@contextlib.contextmanager
def _workers(cluster: LocalCluster) -> Iterator[_Workers]:
    made = _Workers(cluster)
    try:
        yield made
    finally:
        made.close()


async def _a_parked_then_node1_agent_killed(
    cluster: LocalCluster,
    workers: _Workers,
    a: AsyncTimeSliceClient,
    b: AsyncTimeSliceClient,
) -> asyncio.Task[Grant]:
    """a, then b: a's workers are stopped (parked) on both nodes, b's run. Node-1's agent is
    killed (a's worker there stays stopped: nothing can resume it), b yields, a asks. Returns
    a's acquire."""
    await a.acquire("g", timeout=30)
    await a.yield_("g")
    await b.acquire("g", timeout=30)
    assert all(_stopped(workers.pid("a", n)) for n in NODES), workers.states()
    assert not any(_stopped(workers.pid("b", n)) for n in NODES), workers.states()
    cluster.kill_agent("node-1")
    await b.yield_("g")
    return asyncio.create_task(a.acquire("g", timeout=60))


def _granted(task: asyncio.Task[Grant]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def test_a_job_parked_on_a_node_whose_agent_died_waits_until_restored_there(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = _freeze_cluster(cluster_factory, directive_timeout=30)
    with _workers(cluster) as workers:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
            AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer,
        ):
            acquiring = await _a_parked_then_node1_agent_killed(cluster, workers, a, b)
            # a is held back, and the group says why (node-1's record expires after the agent
            # TTL, and the switch towards a goes on without node-1, ending without a grant).
            try:
                held = await wait_for_status(
                    observer, "g", lambda s: "parked on node-1" in s.last_error, AGENT_TTL + 8
                )
            except AssertionError:
                if _granted(acquiring):
                    raise AssertionError(
                        f"a was granted while its worker on node-1 was stopped: {workers.states()}"
                    ) from None
                raise AssertionError(await describe(cluster, "g")) from None
            assert "a waits" in held.last_error and held.holder_job_id == "", held
            assert not _granted(acquiring), "a was granted while its worker on node-1 was stopped"
            assert _stopped(workers.pid("a", "node-1"))

            # b's worker on node-1 kept running: b is served without node-1 meanwhile.
            await b.acquire("g", timeout=15)
            assert not any(_stopped(workers.pid("b", n)) for n in NODES), workers.states()
            await b.yield_("g")
            assert not acquiring.done(), "a was granted while its worker on node-1 was stopped"

            # Node-1's agent comes back: a is restored there before it is granted.
            await asyncio.to_thread(cluster.start_agent, "node-1")
            grant = await asyncio.wait_for(acquiring, 30)
            # Read at once: nothing would resume a's workers after the grant.
            running = {n: _state(workers.pid("a", n)) for n in NODES}
            assert not any(s in ("T", "t") for s in running.values()), (running, workers.states())
            # b's worker on node-1, running when the agent died, was stopped by the switch.
            assert all(_stopped(workers.pid("b", n)) for n in NODES), workers.states()
            status = await observer.status("g")
            assert status.holder_job_id == "a" and status.holder_epoch == grant.epoch
            assert {n.node: n.resident_job_id for n in status.nodes} == {
                "node-0": "a",
                "node-1": "a",
            }
            await a.yield_("g")


async def test_a_job_held_back_for_a_node_that_does_not_come_back_is_told_why(
    cluster_factory: ClusterFactory,
) -> None:
    deadline = 3.0
    cluster = _freeze_cluster(cluster_factory, directive_timeout=deadline)
    with _workers(cluster) as workers:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
            AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer,
        ):
            acquiring = await _a_parked_then_node1_agent_killed(cluster, workers, a, b)
            # The wait has a deadline (the directive timeout): a's acquire fails, saying why.
            try:
                await asyncio.wait_for(acquiring, AGENT_TTL + deadline + 10)
            except GroupFaulted as exc:
                assert "a is parked on node-1" in str(exc), exc
            else:
                raise AssertionError(
                    f"a was granted while its worker on node-1 was stopped: {workers.states()}"
                )
            assert _stopped(workers.pid("a", "node-1"))
            status = await observer.status("g")
            assert "a is parked on node-1" in status.last_error, status
            assert status.holder_job_id == "" and [f.job_id for f in status.faulted] == ["a"], (
                status
            )
