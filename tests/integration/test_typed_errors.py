"""Error kinds travel typed, against a real replica: the SDK raises the class the server sent.

NOT_HOLDER and SESSION_EXPIRED share FAILED_PRECONDITION; only the status details
(``grpc-status-details-bin``, a ``google.rpc.ErrorInfo``) or a YieldStream reply's ``kind``
tell them apart. Messages are plain human text: no ``[kind]`` prefix left to parse.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register
from timeslice._transport import Transport
from timeslice.errors import ErrorKind, GroupFaulted, NotHolder, SessionExpired, TimeSliceError
from timeslice.targets import parse_targets
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    AcquireState,
    CloseSessionRequest,
    KeepAliveRequest,
    OpenSessionRequest,
    TimeSliceStub,
    YieldRequest,
)

T = TypeVar("T")


def plain(error: TimeSliceError) -> str:
    assert error.message and not error.message.startswith("["), error.message
    return error.message


async def test_kinds_sharing_a_status_code_arrive_as_their_own_class(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, tls=False)
    transport = Transport(parse_targets(cluster.targets), tls=None)

    async def call(what: str, rpc: Callable[[TimeSliceStub, float], Awaitable[T]]) -> T:
        return await transport.unary(what, rpc, budget=10)

    try:
        opened = await call(
            "OpenSession",
            lambda stub, t: stub.open_session(
                OpenSessionRequest(job_id="job-a", ttl_seconds=30), timeout=t
            ),
        )
        session, secret = opened.session_id, opened.session_secret
        _, stub = transport.stub()
        events = [
            e
            async for e in stub.acquire(
                AcquireRequest(
                    session_id=session, session_secret=secret, job_id="job-a", group_id="g"
                ),
                timeout=10,
            )
        ]
        assert events[-1].state == AcquireState.GRANTED
        stale = YieldRequest(
            session_id=session,
            session_secret=secret,
            job_id="job-a",
            group_id="g",
            epoch=events[-1].epoch + 1000,
        )
        with pytest.raises(TimeSliceError) as info:
            await call("Yield", lambda stub, t: stub.yield_(stale, timeout=t))
        assert type(info.value) is NotHolder, info.value
        assert f"epoch {stale.epoch} does not match" in plain(info.value)
        # On the wire: the kind in the status details, the message as the SDK shows it.
        with pytest.raises(GRPCError) as raw:
            await stub.yield_(stale, timeout=10)
        assert (raw.value.details, raw.value.message) == (ErrorKind.NOT_HOLDER, info.value.message)

        # The same refusal inside a YieldStream carries its kind in the reply.
        async def one(request: YieldRequest) -> AsyncIterator[YieldRequest]:
            yield request

        [reply] = [r async for r in stub.yield_stream(one(stale), timeout=10)]
        assert (reply.kind, reply.message) == ("NOT_HOLDER", info.value.message)

        await call(
            "CloseSession",
            lambda stub, t: stub.close_session(
                CloseSessionRequest(session_id=session, session_secret=secret), timeout=t
            ),
        )
        with pytest.raises(TimeSliceError) as info:
            await call(
                "KeepAlive",
                lambda stub, t: stub.keep_alive(
                    KeepAliveRequest(session_id=session, session_secret=secret), timeout=t
                ),
            )
        assert type(info.value) is SessionExpired, info.value
        assert session in plain(info.value)
        [reply] = [r async for r in stub.yield_stream(one(stale), timeout=10)]
        assert reply.kind == ErrorKind.SESSION_EXPIRED.name, reply
        assert reply.status == info.value.status.value == NotHolder("").status.value
        assert not reply.message.startswith("["), reply.message
    finally:
        transport.close()


async def test_a_failed_switch_arrives_as_group_faulted(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        agents=1,
        tls=False,
        agent_args=["--sim-state-gb", "0.1", "--sim-fault", "restore:fail:b"],
    )
    socket = str(cluster.agent_sockets[cluster.nodes[0]])
    workers = await asyncio.to_thread(
        lambda: [register("g", job_id=job, socket=socket) for job in ("a", "b")]
    )
    tls = cluster.client_tls
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a", **tls) as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b", **tls) as b,
        ):
            # b's state must be parked once so that its restore really runs.
            await b.acquire("g", timeout=20)
            await b.yield_("g")
            await a.acquire("g", timeout=20)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            async with asyncio.timeout(10):
                while not (await a.status("g")).queue:
                    await asyncio.sleep(0.05)
            await a.yield_("g")
            with pytest.raises(TimeSliceError) as info:
                await waiter
            assert type(info.value) is GroupFaulted, info.value
            assert "restore" in plain(info.value)
            # On the wire (the SDK keeps the status it mapped as the cause): typed, plain text.
            wire = info.value.__cause__
            assert isinstance(wire, GRPCError), repr(wire)
            assert (wire.details, wire.message) == (ErrorKind.GROUP_FAULTED, info.value.message)
    finally:
        for w in workers:
            w.close()
