"""A connection grpclib closed itself (its keepalive gave up on the peer) is not reused.

Against a real grpclib server on loopback. grpclib's ping timeout closes the connection's
transport before the channel hears that the connection is lost; a call in that window failed
with AttributeError in a clean-clone run (tests/faults/test_replica_faults.py, a status call to
a replica just woken from SIGSTOP). The window is made here the way grpclib makes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pytest
from grpclib.client import Channel
from grpclib.health.service import Health
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.server import Server

from timeslice._channel import LiveChannel


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = Server([Health()])
    await server.start("127.0.0.1", 0)
    listening = cast(asyncio.Server, server._server)  # grpclib keeps asyncio's server there
    yield int(listening.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


async def _check(channel: Channel) -> int:
    reply = await HealthStub(channel).Check(HealthCheckRequest(), timeout=5)
    assert reply is not None
    return int(reply.status)


def _close_as_the_ping_timeout_does(channel: Channel) -> None:
    protocol = channel._protocol
    assert protocol is not None
    protocol.processor.connection.close()  # grpclib's keepalive timer calls exactly this


async def test_a_live_channel_connects_anew_after_grpclib_closed_its_connection(port: int) -> None:
    channel = LiveChannel("127.0.0.1", port)
    try:
        assert await _check(channel) == HealthCheckResponse.SERVING
        _close_as_the_ping_timeout_does(channel)
        assert await _check(channel) == HealthCheckResponse.SERVING
    finally:
        channel.close()


async def test_grpclib_alone_fails_in_that_window(port: int) -> None:
    """The condition the test above survives is real (grpclib 0.4.9)."""
    channel = Channel("127.0.0.1", port)
    try:
        await _check(channel)
        _close_as_the_ping_timeout_does(channel)
        with pytest.raises(AttributeError, match="_transport"):
            await _check(channel)
    finally:
        channel.close()
