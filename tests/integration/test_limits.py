"""Quotas and malformed input on real processes: typed refusals, nothing written, no traceback.

Each quota refusal is RESOURCE_EXHAUSTED with the limit in its message; each malformed
request (invalid UTF-8, a truncated field or frame, an out-of-range number, a non-canonical
session id) is INVALID_ARGUMENT; and etcd is unchanged by every refused call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from tests.integration.rawclient import opened, raw_stub
from tests.wirecalls import frame, raw_call, raw_channel, varint
from timeslice.errors import ErrorKind, error_from_status
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    AcquireState,
    GetGroupStatusRequest,
    OpenSessionRequest,
    SetGroupMembersRequest,
    WorkerInfo,
    YieldRequest,
)
from timeslice_tools.dev.cluster import LocalCluster

OPEN = "/timeslice.v1.TimeSlice/OpenSession"
ACQUIRE = "/timeslice.v1.TimeSlice/Acquire"
KEEPALIVE = "/timeslice.v1.TimeSlice/KeepAlive"
REGISTER = "/timeslice.v1.WorkerLink/Register"


def field(number: int, wire: int, body: bytes) -> bytes:
    return varint(number << 3 | wire) + body


def string(number: int, raw: bytes) -> bytes:
    return field(number, 2, varint(len(raw)) + raw)


def tracebacks(cluster: LocalCluster) -> list[str]:
    return [
        p.name
        for p in cluster.log_dir.glob("*.log")
        if "Traceback" in p.read_text(errors="replace")
    ]


async def drain(stream: AsyncIterable[AcquireEvent]) -> list[AcquireEvent]:
    return [ev async for ev in stream]


LIMITS = [
    "--max-groups=4",
    "--max-sessions-per-job=2",
    "--max-sessions=5",
    "--max-entries-per-session=2",
    "--max-id-length=16",
    "--max-members=2",
    "--max-message-bytes=4096",
]


async def test_quota_refusals_are_typed_and_write_nothing(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0, orchestrator_args=LIMITS)
    async with raw_stub(cluster.target) as stub:
        a1, a1_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="a", ttl_seconds=30))
        )
        await stub.open_session(OpenSessionRequest(job_id="a", ttl_seconds=30))
        b, b_secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="b", ttl_seconds=30))
        )
        for group in ("g1", "g2"):
            events = await drain(
                stub.acquire(AcquireRequest(a1, "a", group, session_secret=a1_secret))
            )
            assert events[-1].state == AcquireState.GRANTED
        await drain(stub.acquire(AcquireRequest(b, "b", "g3", session_secret=b_secret)))
        await drain(stub.acquire(AcquireRequest(b, "b", "g4", session_secret=b_secret)))
        operator = {"authorization": f"Bearer {cluster.operator_token}"}
        before = await snapshot(cluster)

        refusals = {
            "sessions per job": stub.open_session(OpenSessionRequest(job_id="a")),
            "entries per session": drain(
                stub.acquire(AcquireRequest(a1, "a", "g3", session_secret=a1_secret))
            ),
            "groups": drain(stub.acquire(AcquireRequest(b, "b", "g5", session_secret=b_secret))),
            "id length": stub.open_session(OpenSessionRequest(job_id="j" * 17)),
            "members": stub.set_group_members(
                SetGroupMembersRequest(group_id="g1", nodes=["n1", "n2", "n3"]),
                metadata=operator,
            ),
        }
        limits = {
            "sessions per job": "2",
            "entries per session": "2",
            "groups": "4",
            "id length": "16",
            "members": "2",
        }
        for what, call in refusals.items():
            with pytest.raises(GRPCError) as info:
                await call
            err = error_from_status(info.value.status, info.value.message, info.value.details)
            print(f"{what}: {err.kind.value}: {err.message}")
            assert err.kind is ErrorKind.RESOURCE_EXHAUSTED, (what, err)
            assert f"limit is {limits[what]}" in err.message, (what, err.message)
        # Three more sessions fill the deployment's 5; the sixth is refused.
        await stub.open_session(OpenSessionRequest(job_id="c", ttl_seconds=30))
        await stub.open_session(OpenSessionRequest(job_id="d", ttl_seconds=30))
        mid = await snapshot(cluster)
        with pytest.raises(GRPCError) as info:
            await stub.open_session(OpenSessionRequest(job_id="e"))
        err = error_from_status(info.value.status, info.value.message, info.value.details)
        assert err.kind is ErrorKind.RESOURCE_EXHAUSTED and "limit is 5" in err.message
        assert await snapshot(cluster) == mid

        # A holder re-acquiring what it has is not a new entry: ALREADY_EXISTS, not quota.
        with pytest.raises(GRPCError) as info:
            await drain(stub.acquire(AcquireRequest(a1, "a", "g1", session_secret=a1_secret)))
        assert info.value.status is Status.ALREADY_EXISTS
        # Yielding frees an entry of the session's quota.
        holder = await stub.get_group_status(GetGroupStatusRequest(group_id="g1"))
        await stub.yield_(
            YieldRequest(a1, "a", "g1", holder.holder_epoch, session_secret=a1_secret)
        )
        assert before != await snapshot(cluster)
    assert tracebacks(cluster) == []
    assert cluster.exited() == {}


async def test_malformed_requests_are_invalid_argument_and_write_nothing(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=1, orchestrator_args=["--max-message-bytes=65536"])
    sid = ""
    async with raw_stub(cluster.target) as stub:
        sid = (await stub.open_session(OpenSessionRequest(job_id="j", ttl_seconds=30))).session_id
    before = await snapshot(cluster)
    ok_job = string(1, b"j")
    cases: dict[str, tuple[str, bytes, Status]] = {
        "invalid UTF-8": (OPEN, frame(string(1, b"j\xff\xfe")), Status.INVALID_ARGUMENT),
        "truncated field": (
            OPEN,
            frame(ok_job + field(3, 2, varint(50) + b"host")),
            Status.INVALID_ARGUMENT,
        ),
        "truncated frame": (
            OPEN,
            frame(ok_job, declared=len(ok_job) + 10),
            Status.INVALID_ARGUMENT,
        ),
        "ttl 2^32+5": (
            OPEN,
            frame(ok_job + field(2, 0, varint(2**32 + 5))),
            Status.INVALID_ARGUMENT,
        ),
        "client_pid -1": (
            OPEN,
            frame(ok_job + field(4, 0, varint(2**64 - 1))),
            Status.INVALID_ARGUMENT,
        ),
        "varint past 64 bits": (
            OPEN,
            frame(ok_job + field(2, 0, b"\xff" * 10 + b"\x01")),
            Status.INVALID_ARGUMENT,
        ),
        "group wire type": (OPEN, frame(ok_job + varint(5 << 3 | 3)), Status.INVALID_ARGUMENT),
        "wrong wire type": (OPEN, frame(field(2, 2, varint(1) + b"x")), Status.INVALID_ARGUMENT),
        "compressed": (OPEN, frame(ok_job, compressed=True), Status.INVALID_ARGUMENT),
        "priority out of int32": (
            ACQUIRE,
            frame(
                string(1, sid.encode())
                + string(2, b"j")
                + string(3, b"g")
                + field(4, 0, varint(2**40))
            ),
            Status.INVALID_ARGUMENT,
        ),
        "session id +0..f": (
            KEEPALIVE,
            frame(string(1, b"+00000000000000f")),
            Status.INVALID_ARGUMENT,
        ),
        "session id 0x..f": (
            KEEPALIVE,
            frame(string(1, b"0x0000000000000f")),
            Status.INVALID_ARGUMENT,
        ),
        "session id ffff..": (KEEPALIVE, frame(string(1, b"f" * 16)), Status.INVALID_ARGUMENT),
        "session id upper": (
            KEEPALIVE,
            frame(string(1, sid.upper().encode())),
            Status.INVALID_ARGUMENT,
        ),
    }
    channel = raw_channel(cluster.targets[0])
    try:
        for name, (method, data, expected) in cases.items():
            outcome = await raw_call(channel, method, data)
            print(f"{name}: {outcome.status.name} {outcome.message}")
            assert outcome.status is expected, (name, outcome)
            assert outcome.kind is ErrorKind.INVALID_ARGUMENT, (name, outcome)
            assert not outcome.message.startswith("["), (name, outcome)
        # 64 MiB declared: refused on the header, before the body is sent or parsed.
        started = time.monotonic()
        outcome = await raw_call(
            channel, OPEN, frame(b"\x0a" + b"x" * 1000, declared=64 << 20), end=False
        )
        print(
            f"64 MiB field: {outcome.status.name} {outcome.message} "
            f"in {time.monotonic() - started:.3f} s"
        )
        assert outcome.status is Status.RESOURCE_EXHAUSTED and "limit is 65536" in outcome.message
        # The channel still works after all of that.
        good = await raw_call(channel, OPEN, frame(ok_job + field(2, 0, varint(30))))
        assert good.status is Status.OK and len(good.replies) == 1
    finally:
        channel.close()
    after = await snapshot(cluster)
    new = {k for k in after if k not in before}
    assert all(k.endswith(tuple("0123456789abcdef")) and "/sessions/" in k for k in new), new
    assert len(new) == 1 and {k: v for k, v in after.items() if k in before} == before

    # The agent's worker socket: same codec, its own limit (default 4 MiB).
    socket = f"unix:{cluster.agent_sockets['node-0']}"
    channel = raw_channel(socket)
    try:
        bad_utf8 = await raw_call(channel, REGISTER, frame(string(1, b"\xc3")))
        assert bad_utf8.status is Status.INVALID_ARGUMENT, bad_utf8
        pid = await raw_call(
            channel,
            REGISTER,
            frame(bytes(WorkerInfo(job_id="j", group_id="g")) + field(3, 0, varint(2**33))),
        )
        assert pid.status is Status.INVALID_ARGUMENT and "uint32" in pid.message, pid
        huge = await raw_call(channel, REGISTER, frame(b"", declared=64 << 20), end=False)
        assert huge.status is Status.RESOURCE_EXHAUSTED and str(4 << 20) in huge.message, huge
    finally:
        channel.close()
    assert tracebacks(cluster) == []
    assert cluster.exited() == {}
