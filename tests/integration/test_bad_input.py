"""Bad input gets a clear typed error, changes nothing in etcd, and the service stays up."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable
from typing import TypeVar, cast

import pytest
from google.rpc import error_details_pb2  # type: ignore[import-untyped]
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from tests.integration.rawclient import raw_stub
from timeslice.errors import ErrorKind, error_from_status
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    AcquireState,
    CloseSessionRequest,
    GetGroupStatusRequest,
    KeepAliveRequest,
    OpenSessionRequest,
    YieldRequest,
)

T = TypeVar("T")

BAD_IDS = ["", "x" * 254, "a/b", "..", "../etc", "tab\there", "nul\x00", "caf\u00e9", " lead"]


async def expect(kind: ErrorKind, coro: Awaitable[object]) -> str:
    with pytest.raises(GRPCError) as info:
        result = await coro
        if hasattr(result, "__aiter__"):
            async for _ in cast(AsyncIterable[object], result):
                pass
    err = error_from_status(info.value.status, info.value.message, info.value.details)
    assert err.kind is kind, f"expected {kind}, got {err.kind}: {err}"
    assert err.message, "the error must say why"
    return err.message


async def drain(stream: AsyncIterable[T]) -> list[T]:
    return [ev async for ev in stream]


async def test_bad_input_is_refused_and_changes_nothing(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    async with raw_stub(cluster.target) as stub:
        good = await stub.open_session(OpenSessionRequest(job_id="good", ttl_seconds=30))
        sid, sec = good.session_id, good.session_secret
        granted = (
            await drain(
                stub.acquire(
                    AcquireRequest(session_id=sid, session_secret=sec, job_id="good", group_id="g")
                )
            )
        )[-1]
        assert granted.state == AcquireState.GRANTED
        before = await snapshot(cluster)

        for bad in BAD_IDS:
            await expect(
                ErrorKind.INVALID_ARGUMENT, stub.open_session(OpenSessionRequest(job_id=bad))
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                drain(
                    stub.acquire(
                        AcquireRequest(session_id=sid, session_secret=sec, job_id=bad, group_id="g")
                    )
                ),
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                drain(
                    stub.acquire(
                        AcquireRequest(
                            session_id=sid, session_secret=sec, job_id="good", group_id=bad
                        )
                    )
                ),
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                stub.yield_(
                    YieldRequest(
                        session_id=sid,
                        session_secret=sec,
                        job_id=bad,
                        group_id="g",
                        epoch=granted.epoch,
                    )
                ),
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                stub.yield_(
                    YieldRequest(
                        session_id=sid,
                        session_secret=sec,
                        job_id="good",
                        group_id=bad,
                        epoch=granted.epoch,
                    )
                ),
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                stub.get_group_status(GetGroupStatusRequest(group_id=bad)),
            )

        # Unknown group, unknown or malformed session, out-of-range TTL.
        await expect(
            ErrorKind.NOT_FOUND, stub.get_group_status(GetGroupStatusRequest(group_id="nope"))
        )
        await expect(
            ErrorKind.NOT_FOUND,
            stub.yield_(
                YieldRequest(
                    session_id=sid, session_secret=sec, job_id="good", group_id="nope", epoch=1
                )
            ),
        )
        for malformed in ("not-hex", "+00000000000000f", "0x0000000000000f", "ffffffffffffffff"):
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                drain(
                    stub.acquire(AcquireRequest(session_id=malformed, job_id="good", group_id="g"))
                ),
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT, stub.keep_alive(KeepAliveRequest(session_id=malformed))
            )
            await expect(
                ErrorKind.INVALID_ARGUMENT,
                stub.close_session(CloseSessionRequest(session_id=malformed)),
            )
        await expect(
            ErrorKind.SESSION_EXPIRED,
            drain(
                stub.acquire(
                    AcquireRequest(session_id="00000000deadbeef", job_id="good", group_id="g")
                )
            ),
        )
        await expect(
            ErrorKind.INVALID_ARGUMENT,
            stub.open_session(OpenSessionRequest(job_id="good", ttl_seconds=100000)),
        )
        await expect(
            ErrorKind.PERMISSION_DENIED,
            drain(
                stub.acquire(
                    AcquireRequest(session_id=sid, session_secret=sec, job_id="other", group_id="g")
                )
            ),
        )

        # Acquire twice: the holder asks again.
        await expect(
            ErrorKind.ALREADY_EXISTS,
            drain(
                stub.acquire(
                    AcquireRequest(session_id=sid, session_secret=sec, job_id="good", group_id="g")
                )
            ),
        )
        # Yield with a stale or zero epoch, by a non-holder.
        await expect(
            ErrorKind.NOT_HOLDER,
            stub.yield_(
                YieldRequest(
                    session_id=sid,
                    session_secret=sec,
                    job_id="good",
                    group_id="g",
                    epoch=granted.epoch - 1,
                )
            ),
        )
        await expect(
            ErrorKind.INVALID_ARGUMENT,
            stub.yield_(
                YieldRequest(
                    session_id=sid, session_secret=sec, job_id="good", group_id="g", epoch=0
                )
            ),
        )
        await expect(
            ErrorKind.PERMISSION_DENIED,
            stub.yield_(
                YieldRequest(session_id="", job_id="intruder", group_id="g", epoch=granted.epoch)
            ),
        )

        after = await snapshot(cluster)
        assert after == before, "refused calls must not change etcd"

        # Yield twice: the first works, the second is a clear error.
        await stub.yield_(
            YieldRequest(
                session_id=sid, session_secret=sec, job_id="good", group_id="g", epoch=granted.epoch
            )
        )
        await expect(
            ErrorKind.NOT_HOLDER,
            stub.yield_(
                YieldRequest(
                    session_id=sid,
                    session_secret=sec,
                    job_id="good",
                    group_id="g",
                    epoch=granted.epoch,
                )
            ),
        )

        # The service is still up and serving.
        again = (
            await drain(
                stub.acquire(
                    AcquireRequest(session_id=sid, session_secret=sec, job_id="good", group_id="g")
                )
            )
        )[-1]
        assert again.state == AcquireState.GRANTED and again.epoch > granted.epoch
    assert cluster.exited() == {}


async def test_grpc_status_codes_are_meaningful_to_plain_clients(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0)
    async with raw_stub(cluster.target, plain=True) as stub:
        with pytest.raises(GRPCError) as info:
            await stub.get_group_status(GetGroupStatusRequest(group_id="missing"))
        assert info.value.status == Status.NOT_FOUND
        assert info.value.message and "missing" in info.value.message
        assert not info.value.message.startswith("["), "the message is plain human text"
        # The kind, in the standard rich error model: Google's own classes decode it.
        [detail] = info.value.details
        assert isinstance(detail, error_details_pb2.ErrorInfo), detail
        assert (detail.reason, detail.domain) == ("NOT_FOUND", "timeslice.dev")
