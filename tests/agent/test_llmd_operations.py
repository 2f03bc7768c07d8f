"""Operator Snapshot / Restore / GetOperation on the agent's llm-d port, run by the orchestrator.

A real TLS cluster (etcd, one orchestrator, one sim agent whose node certificate asks the
orchestrator's NodeOperations for its own node) and in-process calls over real gRPC on
loopback: the llm-d port (plaintext, as the reference's) with the generated stubs, and the
timeslice client for acquire / yield / status. The sim node fits one job's state at a time
(0.6 GB of 1 GB), so a restore never fits beside another job's hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.faults.harness import journals
from tests.integration.etcdview import snapshot
from timeslice import AsyncTimeSliceClient, register
from timeslice.tls import TlsFiles
from timeslice_agent.config import Endpoint
from timeslice_agent.operations import OrchestratorOperations
from timeslice_proto.snapshot_agent.v1alpha1 import (
    GetOperationRequest,
    GetOperationResponse,
    OperationStatus,
    RestoreRequest,
    SnapshotAgentServiceStub,
    SnapshotRequest,
    StatusRequest,
)
from timeslice_proto.snapshot_agent.v1alpha1 import JobState as LlmdJobState
from timeslice_proto.timeslice.v1 import GroupStatus, OperationKind, OperationState
from timeslice_tools.dev import _procs
from timeslice_tools.dev.certs import CertPair, Pki
from timeslice_tools.dev.cluster import LocalCluster

GROUP = "g-ops"
NODE = "node-0"
# 0.3 s per move: an operation is seen PENDING before it completes.
SIM = ["--sim-capacity-gb", "1", "--sim-state-gb", "0.6", "--sim-bandwidth-gbps", "2"]


@pytest.fixture
async def llmd(cluster_factory: ClusterFactory) -> AsyncIterator[tuple[LocalCluster, Channel]]:
    (port,) = _procs.free_ports(1)
    cluster = cluster_factory(agent_args=[*SIM, "--llmd-port", str(port)])
    channel = Channel("127.0.0.1", port)
    try:
        yield cluster, channel
    finally:
        channel.close()


def _resident(status: GroupStatus) -> dict[str, list[str]]:
    return {n.node: list(n.resident_jobs) for n in status.nodes if n.resident_jobs}


async def _code(call: Awaitable[object]) -> tuple[Status, str]:
    try:
        await call
    except GRPCError as exc:
        return exc.status, exc.message or ""
    raise AssertionError("the call was not refused")


async def _until_done(agent: SnapshotAgentServiceStub, op: str) -> list[GetOperationResponse]:
    """GetOperation until the operation ends; every answer, in order."""
    seen: list[GetOperationResponse] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        answer = await agent.get_operation(GetOperationRequest(operation_id=op))
        seen.append(answer)
        if answer.status is not OperationStatus.PENDING:
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"operation {op} never ended: {seen[-1]}")


async def _job_states(agent: SnapshotAgentServiceStub) -> dict[str, LlmdJobState]:
    status = await agent.status(StatusRequest())
    return {j.job_id: j.state for j in status.job_statuses}


def _as(cluster: LocalCluster, node: str, pair: CertPair, ca: Path) -> OrchestratorOperations:
    """The agent's orchestrator client asking for ``node`` with ``pair``'s certificate."""
    targets = [
        Endpoint(host, int(port)) for host, port in (t.rsplit(":", 1) for t in cluster.targets)
    ]
    return OrchestratorOperations(node, targets, TlsFiles(str(ca), str(pair.cert), str(pair.key)))


async def test_operator_snapshot_and_restore_go_through_the_orchestrator(
    llmd: tuple[LocalCluster, Channel], session_pki: Pki
) -> None:
    cluster, channel = llmd
    agent = SnapshotAgentServiceStub(channel)
    sock = str(cluster.agent_sockets[NODE])
    workers = [register(GROUP, job_id=j, socket=sock) for j in ("a", "b")]
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
        ):
            # a, b, a, b: each has been checkpointed and restored once (a job never moved is
            # IDLE, not RUNNING); b holds, a is SAVED.
            for client in (a, b, a):
                await client.acquire(GROUP, timeout=30)
                await client.yield_(GROUP)
            await b.acquire(GROUP, timeout=30)
            assert await _job_states(agent) == {"a": LlmdJobState.SAVED, "b": LlmdJobState.RUNNING}

            # Refused while b holds: typed, and etcd does not change.
            before = await snapshot(cluster)
            code, message = await _code(agent.snapshot(SnapshotRequest(job_id="b", group=GROUP)))
            assert code is Status.FAILED_PRECONDITION and "yield first" in message, message
            code, message = await _code(agent.restore(RestoreRequest(job_id="a", group=GROUP)))
            assert code is Status.FAILED_PRECONDITION and "held by b" in message, message
            bad = [
                agent.snapshot(SnapshotRequest(job_id="")),
                agent.snapshot(SnapshotRequest(job_id="b/../x")),
                agent.restore(RestoreRequest(job_id="a", group="../g")),
                agent.get_operation(GetOperationRequest(operation_id="")),
                agent.get_operation(GetOperationRequest(operation_id="o" * 300)),
            ]
            for call in bad:
                assert (await _code(call))[0] is Status.INVALID_ARGUMENT
            unknown = await _code(agent.get_operation(GetOperationRequest(operation_id="op-x")))
            assert unknown[0] is Status.NOT_FOUND, unknown
            assert await snapshot(cluster) == before
            status = await b.status(GROUP)
            assert status.holder_job_id == "b" and _resident(status) == {NODE: ["b"]}

            # b yields (lazily: its state stays on the devices); a snapshot parks it.
            await b.yield_(GROUP)
            op = (await agent.snapshot(SnapshotRequest(job_id="b", group=GROUP))).operation_id
            seen = await _until_done(agent, op)
            assert seen[0].status is OperationStatus.PENDING, seen
            done = seen[-1]
            assert done.status is OperationStatus.COMPLETE, done
            # The operator snapshot's checkpoint: b's last one.
            moved = max(
                (e for e in journals(cluster) if e.kind == "checkpoint" and e.job == "b"),
                key=lambda e: e.started_at,
            )
            assert moved.status == "ok" and moved.bytes_moved > 0
            assert done.storage_bytes == done.snapshot_device_bytes == moved.bytes_moved
            assert done.elapsed_ms > 0
            status = await a.status(GROUP)
            assert status.holder_job_id == "" and status.switch is None
            assert _resident(status) == {}, status
            assert (await _job_states(agent))["b"] is LlmdJobState.SAVED

            # NodeOperations itself: a node certificate asks only for its own node; a job's
            # never. Refused, and nothing written.
            before = await snapshot(cluster)
            node1 = _as(cluster, NODE, session_pki.node("node-1"), session_pki.ca)
            job = _as(cluster, NODE, session_pki.job("a"), session_pki.ca)
            for call in (
                node1.start(OperationKind.RESTORE, "b", GROUP),
                node1.get(op),
                job.start(OperationKind.RESTORE, "b", GROUP),
            ):
                assert (await _code(call))[0] is Status.PERMISSION_DENIED
            # Another node's operation is not found from its own identity.
            other = _as(cluster, "node-1", session_pki.node("node-1"), session_pki.ca)
            assert (await _code(other.get(op)))[0] is Status.NOT_FOUND
            mine = await _as(cluster, NODE, session_pki.node(NODE), session_pki.ca).get(op)
            assert mine.state is OperationState.SUCCEEDED and mine.job_id == "b"
            assert await snapshot(cluster) == before

            # a's state goes back on the free group without a grant; its acquire then moves
            # nothing.
            op = (await agent.restore(RestoreRequest(job_id="a"))).operation_id
            done = (await _until_done(agent, op))[-1]
            assert done.status is OperationStatus.COMPLETE, done
            assert done.storage_bytes == moved.bytes_moved  # the same job size, back
            status = await a.status(GROUP)
            assert status.holder_job_id == "" and _resident(status) == {NODE: ["a"]}
            grant = await a.acquire(GROUP, timeout=30)
            assert not grant.restored
            await a.yield_(GROUP)

            # b, parked by the operator snapshot, is restored by its next grant.
            grant = await b.acquire(GROUP, timeout=30)
            assert grant.restored
            await b.yield_(GROUP)
    finally:
        for w in workers:
            w.close()
