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
from timeslice_proto.timeslice.v1 import (
    GetNodeOperationRequest,
    GroupStatus,
    NodeOperationsStub,
    OperationKind,
    OperationState,
    StartOperationRequest,
)
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


async def _yielded_on_device(client: AsyncTimeSliceClient, job: str) -> None:
    """Until the replica shows the group free with ``job``'s state still on NODE: its mirror
    follows etcd by watch, and an operation is decided on what the mirror shows (an operation
    started right after the yield was once refused "not on node-0's devices")."""
    deadline = time.monotonic() + 15
    while True:
        status = await client.status(GROUP)
        if not status.holder_job_id and job in _resident(status).get(NODE, []):
            return
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.02)


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


async def _one_way_proxy(target: str) -> asyncio.Server:
    """A TCP proxy to ``target`` that passes requests on and drops every answer: a call
    through it reaches the orchestrator, which acts on it, and its caller times out."""
    host, port = target.rsplit(":", 1)

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, int(port))

        async def drain_answers() -> None:
            while await server_r.read(65536):
                pass

        answers = asyncio.ensure_future(drain_answers())
        try:
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()
        except ConnectionError:
            pass
        finally:
            answers.cancel()
            server_w.close()
            client_w.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_start_retried_after_its_answer_was_lost_is_recorded_once(
    cluster_factory: ClusterFactory,
) -> None:
    """The agent's first StartOperation reaches a replica, which records the operation, but
    the answer never comes back; the agent asks the next orchestrator with the same request
    id and gets that same operation, not a second one (a second snapshot would fail: the
    first one took the state off the devices)."""
    cluster = cluster_factory(tls=False, agent_args=SIM)
    sock = str(cluster.agent_sockets[NODE])
    worker = register(GROUP, job_id="a", socket=sock)
    proxy = await _one_way_proxy(cluster.targets[0])
    try:
        async with AsyncTimeSliceClient(cluster.targets, job_id="a", insecure=True) as a:
            await a.acquire(GROUP, timeout=30)
            await a.yield_(GROUP)  # lazily: a's state stays on the devices
            await _yielded_on_device(a, "a")
            proxied = Endpoint("127.0.0.1", proxy.sockets[0].getsockname()[1])
            host, port = cluster.targets[0].rsplit(":", 1)
            # The first try waits out all of it (its answer is lost); the retry and each
            # poll after it must fit in it on a loaded machine too.
            operations = OrchestratorOperations(
                NODE, [proxied, Endpoint(host, int(port))], None, timeout=5.0
            )
            started = time.time()
            op = await operations.start(OperationKind.SNAPSHOT, "a", GROUP)
            keys = [k for k in await snapshot(cluster) if "/operations/" in k]
            assert keys == [f"{cluster.prefix}/groups/{GROUP}/operations/{op.operation_id}"]
            deadline = time.monotonic() + 15
            while (done := await operations.get(op.operation_id)).state in (
                OperationState.PENDING,
                OperationState.RUNNING,
            ):
                assert time.monotonic() < deadline, done
                await asyncio.sleep(0.02)
            assert done.state is OperationState.SUCCEEDED, done
            checkpoints = [
                e for e in journals(cluster) if e.kind == "checkpoint" and e.started_at >= started
            ]
            assert [(e.job, e.status) for e in checkpoints] == [("a", "ok")], checkpoints
            status = await a.status(GROUP)
            assert _resident(status) == {}, status
    finally:
        proxy.close()
        worker.close()


async def test_a_request_id_reused_for_another_job_is_refused(
    cluster_factory: ClusterFactory,
) -> None:
    """A request id names one request: reused for something else it is refused, typed, and
    nothing is written; a key too long for one is refused the same way."""
    cluster = cluster_factory(tls=False, agent_args=SIM)
    sock = str(cluster.agent_sockets[NODE])
    workers = [register(GROUP, job_id=j, socket=sock) for j in ("a", "b")]
    host, port = cluster.targets[0].rsplit(":", 1)
    channel = Channel(host, int(port))
    stub = NodeOperationsStub(channel)
    try:
        async with AsyncTimeSliceClient(cluster.targets, job_id="a", insecure=True) as a:
            await a.acquire(GROUP, timeout=30)
            ask = StartOperationRequest(
                node=NODE, job_id="a", group_id=GROUP, kind=OperationKind.SNAPSHOT, request_id="r-1"
            )
            # Refused (a holds): nothing is recorded under the id, a later attempt is decided anew.
            assert (await _code(stub.start_operation(ask)))[0] is Status.FAILED_PRECONDITION
            await a.yield_(GROUP)
            await _yielded_on_device(a, "a")
            first = await stub.start_operation(ask)
            deadline = time.monotonic() + 15
            get = GetNodeOperationRequest(node=NODE, operation_id=first.operation_id)
            while (done := await stub.get_operation(get)).state is not OperationState.SUCCEEDED:
                assert time.monotonic() < deadline and done.state is not OperationState.FAILED, done
                await asyncio.sleep(0.02)
            before = await snapshot(cluster)
            # Once done, a retry gets the outcome (a second snapshot would be refused: a's
            # state is off the devices now).
            again = await stub.start_operation(ask)
            assert again.operation_id == first.operation_id
            assert again.state is OperationState.SUCCEEDED
            ask.job_id = "b"
            code, message = await _code(stub.start_operation(ask))
            assert code is Status.INVALID_ARGUMENT and "r-1" in message, message
            ask.request_id = "r" * 65
            assert (await _code(stub.start_operation(ask)))[0] is Status.INVALID_ARGUMENT
            assert await snapshot(cluster) == before
    finally:
        channel.close()
        for w in workers:
            w.close()
