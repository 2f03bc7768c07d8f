"""A bare gRPC client for tests that must see the wire exactly (no SDK behaviour in between)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from grpclib.client import Channel

from tests.tlsenv import env_context
from timeslice.status_details import KIND_CODEC
from timeslice_proto.timeslice.v1 import OpenSessionResponse, TimeSliceStub


@asynccontextmanager
async def raw_stub(
    target: str, *, insecure: bool = False, plain: bool = False
) -> AsyncIterator[TimeSliceStub]:
    """A stub on the first of ``target``'s replicas: TLS as the environment says (the
    session's certificates), plaintext with ``insecure``. Errors carry the kind decoded from
    the status details (``GRPCError.details``); with ``plain``, grpclib's own decoding of them
    (Google's protobuf classes), as any client that knows nothing of timeslice gets them."""
    host, _, port = target.split(",")[0].rpartition(":")
    context = None if insecure else await asyncio.to_thread(env_context)
    codec = None if plain else KIND_CODEC
    channel = Channel(host, int(port), ssl=context, status_details_codec=codec)
    try:
        yield TimeSliceStub(channel, timeout=10)
    finally:
        channel.close()


def opened(response: OpenSessionResponse) -> tuple[str, str]:
    """A session's id and its secret (every call on the session must carry the secret)."""
    assert response.session_secret, "OpenSession must return the session's secret"
    return response.session_id, response.session_secret
