"""Who may act: a session only with its secret, operator RPCs only with the operator token.

The probe of issue 10, replayed on real replicas and a real etcd: another job that read a
session's id and its hold's epoch (status shows the epoch to anyone) tries to yield, keep
alive, acquire on and close that session, and the operator RPCs are called without the token.
Every attempt gets a typed refusal, changes nothing in etcd, is counted in the replica's
metrics, and is logged once, not once per try.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TypeVar, cast

import pytest
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from tests.integration.rawclient import opened, raw_stub
from timeslice.errors import ErrorKind, error_from_status
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    AcquireState,
    CloseSessionRequest,
    GetGroupStatusRequest,
    GroupEvent,
    KeepAliveRequest,
    ListGroupsRequest,
    OpenSessionRequest,
    SetGroupMembersRequest,
    TimeSliceStub,
    WatchGroupRequest,
    YieldRequest,
)
from timeslice_tools.dev import _procs
from timeslice_tools.dev.cluster import LocalCluster

T = TypeVar("T")


async def refused(kind: ErrorKind, call: Awaitable[object]) -> str:
    """Await ``call`` (draining a stream); it must fail with ``kind``. Returns the message."""
    with pytest.raises(GRPCError) as info:
        result = await call
        if hasattr(result, "__aiter__"):
            async for _ in cast(AsyncIterable[object], result):
                pass
    error = error_from_status(info.value.status, info.value.message, info.value.details)
    assert error.kind is kind, f"expected {kind}, got {error.kind}: {error}"
    return error.message


async def drain(stream: AsyncIterable[T]) -> list[T]:
    return [item async for item in stream]


async def metric(cluster: LocalCluster, pattern: str) -> float:
    """The sum of the replica's samples whose line matches ``pattern`` (0 when none)."""
    (address,) = cluster.replica_http
    answer = await asyncio.to_thread(_procs.http_status, f"http://{address}/metrics", 2.0)
    assert answer is not None and answer[0] == 200, "no metrics"
    total = 0.0
    for line in answer[1].decode().splitlines():
        if re.match(pattern, line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_lines(cluster: LocalCluster, needle: str) -> int:
    (replica,) = cluster.replica_ids
    return sum(needle in line for line in cluster.log_tail(replica, 100_000).splitlines())


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.1)


async def test_a_session_id_and_epoch_are_not_enough_to_act(
    cluster_factory: ClusterFactory,
) -> None:
    # Plaintext on purpose: the session secret is what protects a session when no
    # certificate names the caller (with TLS, tests/e2e/test_tls.py: a job's certificate
    # acts as its job only).
    cluster = cluster_factory(agents=0, tls=False)
    async with raw_stub(cluster.target, insecure=True) as stub:
        victim, victim_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="victim", ttl_seconds=30))
        )
        thief, thief_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="thief", ttl_seconds=30))
        )
        assert victim_secret != thief_secret and len(victim_secret) >= 22  # >= 128 bits
        granted = (
            await drain(
                stub.acquire(
                    AcquireRequest(
                        session_id=victim,
                        session_secret=victim_secret,
                        job_id="victim",
                        group_id="g",
                    )
                )
            )
        )[-1]
        assert granted.state == AcquireState.GRANTED

        # What any caller can read: the holder's job and epoch.
        status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
        assert (status.holder_job_id, status.holder_epoch) == ("victim", granted.epoch)
        epoch = status.holder_epoch
        before = await snapshot(cluster)

        # Probe 1: Yield(session_id="", job=<holder>, epoch=<epoch>) released the hold.
        await refused(
            ErrorKind.PERMISSION_DENIED,
            stub.yield_(YieldRequest(session_id="", job_id="victim", group_id="g", epoch=epoch)),
        )
        # Probe 2: a known (guessed) session id, without its secret or with another one.
        for secret in ("", thief_secret, "x" * 43, "y" * 10_000):
            await refused(
                ErrorKind.UNAUTHENTICATED,
                stub.yield_(
                    YieldRequest(
                        session_id=victim,
                        session_secret=secret,
                        job_id="victim",
                        group_id="g",
                        epoch=epoch,
                    )
                ),
            )
            await refused(
                ErrorKind.UNAUTHENTICATED,
                stub.keep_alive(KeepAliveRequest(session_id=victim, session_secret=secret)),
            )
            await refused(
                ErrorKind.UNAUTHENTICATED,
                drain(
                    stub.acquire(
                        AcquireRequest(
                            session_id=victim,
                            session_secret=secret,
                            job_id="victim",
                            group_id="other",
                        )
                    )
                ),
            )
            await refused(
                ErrorKind.UNAUTHENTICATED,
                stub.close_session(CloseSessionRequest(session_id=victim, session_secret=secret)),
            )
        # The thief's own, valid session does not reach another job's hold either.
        await refused(
            ErrorKind.PERMISSION_DENIED,
            stub.yield_(
                YieldRequest(
                    session_id=thief,
                    session_secret=thief_secret,
                    job_id="victim",
                    group_id="g",
                    epoch=epoch,
                )
            ),
        )

        after = await snapshot(cluster)
        assert after == before, "refused calls must not change etcd"
        status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
        assert (status.holder_job_id, status.holder_epoch) == ("victim", epoch)

        # Counted every time; logged once per cause.
        assert await metric(cluster, r"timeslice_authz_refusals_total\{.*Yield") == 6
        assert await metric(cluster, r"timeslice_authz_refusals_total\{.*KeepAlive") == 4
        assert log_lines(cluster, "refused KeepAlive") == 1
        assert log_lines(cluster, "refused Yield") == 3  # operator, secret, another job

        # The owner, with its secret, still does everything.
        ttl = await stub.keep_alive(
            KeepAliveRequest(session_id=victim, session_secret=victim_secret)
        )
        assert ttl.ttl_seconds == 30
        await stub.yield_(
            YieldRequest(
                session_id=victim,
                session_secret=victim_secret,
                job_id="victim",
                group_id="g",
                epoch=epoch,
            )
        )
        await stub.close_session(
            CloseSessionRequest(session_id=victim, session_secret=victim_secret)
        )
    assert cluster.exited() == {}


async def test_no_secret_leaves_the_session_owner(cluster_factory: ClusterFactory) -> None:
    """Status, list and watch never carry a secret or a session id; etcd keeps only a hash."""
    cluster = cluster_factory(agents=0)
    async with raw_stub(cluster.target) as stub:
        sid, secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="a", ttl_seconds=30))
        )
        waiter, waiter_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="b", ttl_seconds=30))
        )
        await drain(
            stub.acquire(
                AcquireRequest(session_id=sid, session_secret=secret, job_id="a", group_id="g")
            )
        )
        waiting = asyncio.create_task(
            drain(
                stub.acquire(
                    AcquireRequest(
                        session_id=waiter, session_secret=waiter_secret, job_id="b", group_id="g"
                    )
                )
            )
        )
        try:
            await eventually(lambda: _queued(stub, "g"), timeout=10, what="the waiter in the queue")
            status = bytes(await stub.get_group_status(GetGroupStatusRequest(group_id="g")))
            groups = bytes(await stub.list_groups(ListGroupsRequest()))
            watch = stub.watch_group(WatchGroupRequest(group_id="g"))
            event = cast(GroupEvent, await anext(aiter(watch)))
            watched = bytes(event)
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        for shown in (status, groups, watched):
            for private in (secret, waiter_secret, sid, waiter):
                assert private.encode() not in shown
        stored = await snapshot(cluster)
        for value, _ in stored.values():
            assert secret.encode() not in value and waiter_secret.encode() not in value


async def _queued(stub: TimeSliceStub, group: str) -> bool:
    status = await stub.get_group_status(GetGroupStatusRequest(group_id=group))
    return bool(status.queue)


async def test_operator_rpcs_need_the_operator_token(cluster_factory: ClusterFactory) -> None:
    # Plaintext on purpose: the token is the operator identity when no certificate gives one
    # (an operator certificate needs no token: tests/dev/test_dev_cli.py).
    cluster = cluster_factory(agents=1, tls=False)
    bearer = {"authorization": f"Bearer {cluster.operator_token}"}
    async with raw_stub(cluster.target, insecure=True) as stub:
        pin = SetGroupMembersRequest(group_id="g", nodes=["node-0"])
        for metadata in ({}, {"authorization": "Bearer wrong"}, {"authorization": "x"}):
            message = await refused(
                ErrorKind.PERMISSION_DENIED, stub.set_group_members(pin, metadata=metadata)
            )
            assert "operator identity" in message
        assert (
            await metric(
                cluster,
                r'timeslice_authz_refusals_total\{(?=.*rpc="SetGroupMembers")(?=.*operator)',
            )
            == 3
        )
        assert log_lines(cluster, "refused SetGroupMembers") == 1
        with pytest.raises(GRPCError):
            await stub.get_group_status(GetGroupStatusRequest(group_id="g"))  # not created

        status = await stub.set_group_members(pin, metadata=bearer)
        assert list(status.static_members) == ["node-0"]
        assert list(status.missing_members) == []

        # Pinning a node that never had an agent would block the group: refused, typed.
        before = await snapshot(cluster)
        message = await refused(
            ErrorKind.FAILED_PRECONDITION,
            stub.set_group_members(
                SetGroupMembersRequest(group_id="g", nodes=["node-0", "node-ghost"]),
                metadata=bearer,
            ),
        )
        assert "node-ghost" in message and "node-0" not in message
        # Far too many nodes: refused before any is looked up, with the limit in the message.
        message = await refused(
            ErrorKind.RESOURCE_EXHAUSTED,
            stub.set_group_members(
                SetGroupMembersRequest(group_id="g", nodes=[f"n{i}" for i in range(257)]),
                metadata=bearer,
            ),
        )
        assert "256" in message  # --max-members, default 256
        assert await snapshot(cluster) == before
        # Unpinning needs no known node.
        status = await stub.set_group_members(
            SetGroupMembersRequest(group_id="g", nodes=[]), metadata=bearer
        )
        assert list(status.static_members) == []


async def test_a_group_blocked_by_an_absent_pinned_node_says_so(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=1, orchestrator_args=["--agent-ttl", "1"])
    bearer = {"authorization": f"Bearer {cluster.operator_token}"}
    async with raw_stub(cluster.target) as stub:
        await stub.set_group_members(
            SetGroupMembersRequest(group_id="g", nodes=["node-0"]), metadata=bearer
        )
        cluster.stop_agent("node-0")

        async def node_gone() -> bool:
            status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
            return list(status.missing_members) == ["node-0"]

        await eventually(node_gone, timeout=15, what="node-0 missing from the group")
        sid, secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="a", ttl_seconds=30))
        )
        waiting = asyncio.create_task(
            drain(
                stub.acquire(
                    AcquireRequest(session_id=sid, session_secret=secret, job_id="a", group_id="g")
                )
            )
        )
        try:

            async def explained() -> bool:
                status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
                return "waiting for pinned node(s) node-0" in status.last_error

            await eventually(explained, timeout=10, what="last_error naming node-0")
            assert not waiting.done(), "nothing may be granted without the pinned node"
            # Said once in the log, although the driver comes back to the group many times.
            await asyncio.sleep(1.0)
            assert log_lines(cluster, "waiting for pinned node(s) node-0") == 1

            # The node comes back: the group is served.
            cluster.start_agent("node-0")
            async with asyncio.timeout(30):
                events = await waiting
            assert events[-1].state == AcquireState.GRANTED
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
        assert list(status.missing_members) == []
