"""AsyncTimeSliceClient against a fake orchestrator over loopback gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TypedDict, Unpack

import grpclib
import pytest
from grpclib.const import Status

from tests.sdk.fakes import (
    FakeOrchestrator,
    OrchestratorState,
    TcpProxy,
    free_port,
    wire_error,
)
from timeslice import (
    AcquireProgress,
    AcquireStage,
    AlreadyExists,
    AsyncTimeSliceClient,
    Cancelled,
    Grant,
    InvalidArgument,
    NotHolder,
    Timeout,
    Unavailable,
)
from timeslice.errors import (
    ErrorKind,
    FailedPrecondition,
    GroupFaulted,
    InternalError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SessionExpired,
    TimeSliceError,
    Unauthenticated,
)


class ClientOptions(TypedDict, total=False):
    session_ttl: float
    call_timeout: float


def client_for(
    orch: FakeOrchestrator, job: str = "job-a", **kwargs: Unpack[ClientOptions]
) -> AsyncTimeSliceClient:
    return AsyncTimeSliceClient(orch.target, job_id=job, **kwargs)


async def test_acquire_yield_and_release_alias(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        grant = await client.acquire("g1")
        assert isinstance(grant, Grant)
        assert (grant.group_id, grant.job_id) == ("g1", "job-a")
        assert grant.epoch > 0 and grant.ticket > 0
        assert grant.previous_job_id is None
        assert orch.do(lambda s: s.holder_of("g1")) == "job-a"
        assert client.grants() == {"g1": grant}
        await client.yield_("g1")
        assert orch.do(lambda s: s.holder_of("g1")) is None
        assert client.grants() == {}

        again = await client.acquire("g1")
        assert again.epoch > grant.epoch
        await client.release("g1")
        assert orch.do(lambda s: s.holder_of("g1")) is None
        calls = orch.do(lambda s: list(s.calls))
        assert calls.count("OpenSession") == 1, "one session serves every acquire"
        assert calls.count("Yield") == 2


@pytest.mark.parametrize("next_holder", [None, "job-b"], ids=["group-free", "handed-over"])
async def test_a_yield_whose_first_answer_was_lost_is_a_success(
    orch: FakeOrchestrator, next_holder: str | None
) -> None:
    # The release landed but its answer was lost; the retry then finds the group free (not
    # holder) or already another job's (permission denied): either way it was released.
    async with client_for(orch) as client:
        await client.acquire("g1")

        def lose_the_answer(s: OrchestratorState) -> None:
            s.yield_replies_lost = 1
            s.hand_over_to = next_holder

        orch.do(lose_the_answer)
        await client.yield_("g1")
        assert client.grants() == {}
        assert orch.do(lambda s: s.holder_of("g1")) == next_holder
        assert orch.do(lambda s: s.calls.count("Yield")) == 2


async def test_second_acquire_of_a_held_group_is_refused_locally(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        await client.acquire("g1")
        before = orch.do(lambda s: len(s.calls))
        with pytest.raises(AlreadyExists):
            await client.acquire("g1")
        assert orch.do(lambda s: len(s.calls)) == before
        await client.yield_("g1")


async def test_concurrent_acquires_of_one_group_in_one_client_are_refused(
    orch: FakeOrchestrator,
) -> None:
    async with client_for(orch, "holder") as holder, client_for(orch) as client:
        await holder.acquire("g1")
        waiting = asyncio.create_task(client.acquire("g1"))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        with pytest.raises(AlreadyExists, match="in progress"):
            await client.acquire("g1")
        await holder.yield_("g1")
        await waiting
        await client.yield_("g1")


async def test_yield_without_holding_raises_not_holder_without_a_call(
    orch: FakeOrchestrator,
) -> None:
    async with client_for(orch) as client:
        with pytest.raises(NotHolder):
            await client.yield_("g1")
        with pytest.raises(NotHolder):
            await client.release("g1")
    # Nothing went over the wire: no Yield, not even an OpenSession.
    assert orch.do(lambda s: list(s.calls)) == []


async def test_async_decorator(orch: FakeOrchestrator) -> None:
    client = client_for(orch)
    seen: list[str | None] = []

    @client.on_accelerators(group_id="trainer-group")
    async def train_phase(step: int) -> int:
        """Docstring survives."""
        seen.append(await asyncio.to_thread(orch.do, lambda s: s.holder_of("trainer-group")))
        return step * 2

    assert asyncio.iscoroutinefunction(train_phase)
    assert train_phase.__name__ == "train_phase"
    assert train_phase.__doc__ == "Docstring survives."
    assert await train_phase(3) == 6
    assert await train_phase(4) == 8
    assert seen == ["job-a", "job-a"]
    assert orch.do(lambda s: s.holder_of("trainer-group")) is None
    await client.close()


async def test_async_with_binds_the_grant(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        async with client.on_accelerators("g1", timeout=5) as grant:
            assert grant.group_id == "g1"
            assert orch.do(lambda s: s.holder_of("g1")) == "job-a"
        assert orch.do(lambda s: s.holder_of("g1")) is None


async def test_body_exception_is_not_masked_by_a_failing_yield(
    orch: FakeOrchestrator, caplog: pytest.LogCaptureFixture
) -> None:
    async with client_for(orch) as client:
        orch.do(lambda s: s.fail.__setitem__("Yield", InternalError("store exploded").to_grpc()))
        with caplog.at_level(logging.ERROR, logger="timeslice"):
            with pytest.raises(ValueError, match="body failed"):
                async with client.on_accelerators("g1"):
                    raise ValueError("body failed")
        assert any(
            "store exploded" in r.getMessage()
            or (r.exc_info and "store exploded" in str(r.exc_info[1]))
            for r in caplog.records
        )

        # Without a body exception the yield's own error is what the caller sees.
        orch.do(lambda s: s.fail.clear())
        await client.yield_("g1")  # the failed yield left the grant recorded: give it back
        orch.do(lambda s: s.fail.__setitem__("Yield", InternalError("store exploded").to_grpc()))
        with pytest.raises(InternalError, match="store exploded"):
            async with client.on_accelerators("g1"):
                pass
        orch.do(lambda s: s.fail.clear())


async def test_on_progress_reports_queue_positions(orch: FakeOrchestrator) -> None:
    reports: list[AcquireProgress] = []
    async with client_for(orch, "holder") as holder, client_for(orch) as client:
        await holder.acquire("g1")
        waiting = asyncio.create_task(client.acquire("g1", on_progress=reports.append))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        await holder.yield_("g1")
        grant = await waiting
        assert grant.waited_seconds >= 0
        assert reports[0] == AcquireProgress(AcquireStage.QUEUED, 0)
        assert reports[-1].state is AcquireStage.GRANTED
        await client.yield_("g1")


async def test_acquire_timeout_cancels_the_stream(orch: FakeOrchestrator) -> None:
    async with client_for(orch, "holder") as holder, client_for(orch) as client:
        await holder.acquire("g1")
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The deadline is long enough for the request to reach the server on a loaded
        # machine: a stream that never got there has nothing on the server to cancel.
        task = asyncio.create_task(client.acquire("g1", timeout=2))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        with pytest.raises(Timeout):
            await task
        assert 2 <= loop.time() - started < 6
        await orch.until(lambda s: s.cancelled_acquires == 1)
        assert orch.do(lambda s: s.queue_of("g1")) == []
        assert client.grants() == {}
        await holder.yield_("g1")


async def test_cancelling_the_awaiting_task_cancels_the_stream(orch: FakeOrchestrator) -> None:
    async with client_for(orch, "holder") as holder, client_for(orch) as client:
        await holder.acquire("g1")
        task = asyncio.create_task(client.acquire("g1"))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await orch.until(lambda s: s.cancelled_acquires == 1 and s.queue_of("g1") == [])
        # The client is still usable, and the group goes to the next waiter normally.
        await holder.yield_("g1")
        await client.acquire("g1", timeout=5)
        await client.yield_("g1")


async def test_a_grant_is_the_jobs_as_soon_as_it_arrives(orch: FakeOrchestrator) -> None:
    # The server sends GRANTED but never ends the stream (and, like a server that already
    # finished, does not release on a reset). The grant is committed and delivered: the
    # acquire returns it at once instead of waiting for the stream's end, which is read in
    # the background and reset after the call timeout, leaving the hold with the job.
    orch.do(lambda s: setattr(s, "hang_after_grant", True))
    orch.do(lambda s: setattr(s, "release_raced", False))
    async with client_for(orch, call_timeout=1.0) as client:
        started = time.monotonic()
        grant = await client.acquire("g1", timeout=5)
        assert time.monotonic() - started < 1.0
        assert client.grants() == {"g1": grant}
        assert orch.do(lambda s: s.holder_of("g1")) == "job-a"
        assert [t.get_name() for t in client._tasks.running("acquire end")] == [
            "timeslice-acquire-end-g1"
        ]
        deadline = time.monotonic() + 10
        while client._tasks.running("acquire end"):
            assert time.monotonic() < deadline, "the stream's tail was never closed"
            await asyncio.sleep(0.05)
        assert time.monotonic() - started >= 1.0
        # The reset of the tail took nothing back: the job still holds the group.
        assert orch.do(lambda s: s.holder_of("g1")) == "job-a"
        await client.yield_("g1")
        assert orch.do(lambda s: s.holder_of("g1")) is None
        assert orch.do(lambda s: s.calls.count("Yield")) == 1


async def test_the_stream_of_a_grant_is_read_to_its_end(orch: FakeOrchestrator) -> None:
    # Returning at GRANTED must not reset the stream: the server finishes it normally.
    async with client_for(orch) as client:
        await client.acquire("g1", timeout=5)
        await orch.until(lambda s: s.finished_acquires == 1)
        deadline = time.monotonic() + 10
        while client._tasks.running("acquire end"):
            assert time.monotonic() < deadline, "the stream's tail was never read"
            await asyncio.sleep(0.01)
        assert orch.do(lambda s: s.cancelled_acquires) == 0
        await client.yield_("g1")


async def test_grant_that_raced_a_cancel_is_given_back(orch: FakeOrchestrator) -> None:
    async with client_for(orch, "holder") as holder, client_for(orch) as client:
        await holder.acquire("g1")
        task = asyncio.create_task(client.acquire("g1"))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])

        def free(s: OrchestratorState) -> None:
            group = s.groups["g1"]
            group.holder = None
            group.notify()

        granted_before = orch.do(lambda s: s.finished_acquires)
        orch.do(free)
        # Keep our loop busy while the server grants and finishes the stream, then cancel:
        # the GRANTED event sits unread in the receive buffer when the cancel lands, and the
        # server, done with the stream, can no longer see the cancel.
        deadline = time.monotonic() + 10
        while orch.do(lambda s: s.finished_acquires) == granted_before:
            assert time.monotonic() < deadline, "the server never granted"
            time.sleep(0.01)  # blocking the loop is the point here
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert orch.do(lambda s: s.cancelled_acquires) == 0, "the server saw a finished stream"
        await orch.until(lambda s: s.calls.count("Yield") == 1)
        assert orch.do(lambda s: s.holder_of("g1")) is None
        assert client.grants() == {}


async def test_a_started_yield_completes_even_if_its_caller_is_cancelled(
    orch: FakeOrchestrator,
) -> None:
    orch.do(lambda s: setattr(s, "yield_delay", 0.2))
    async with client_for(orch) as client:

        @client.on_accelerators("g1")
        async def phase() -> None:
            await asyncio.sleep(3600)

        task = asyncio.create_task(phase())
        await orch.until(lambda s: s.holder_of("g1") == "job-a")
        task.cancel()  # the body is cancelled: the scope starts the yield
        await orch.until(lambda s: s.calls.count("Yield") == 1)
        task.cancel()  # and cancelled again while the yield is in flight
        with pytest.raises(asyncio.CancelledError):
            await task
        await orch.until(lambda s: s.holder_of("g1") is None)
        for _ in range(100):
            if not client.grants():
                break
            await asyncio.sleep(0.01)
        assert client.grants() == {}


async def test_failing_on_progress_after_grant_gives_it_back(orch: FakeOrchestrator) -> None:
    def explode(progress: AcquireProgress) -> None:
        if progress.state is AcquireStage.GRANTED:
            raise RuntimeError("callback bug")

    async with client_for(orch) as client:
        with pytest.raises(RuntimeError, match="callback bug"):
            await client.acquire("g1", on_progress=explode)
        assert orch.do(lambda s: s.holder_of("g1")) is None
        assert client.grants() == {}


async def test_keepalive_runs_every_third_of_the_ttl(orch: FakeOrchestrator) -> None:
    async with client_for(orch, session_ttl=0.6) as client:
        await client.acquire("g1")
        before = orch.do(lambda s: s.keepalives)
        await asyncio.sleep(1.0)
        count = orch.do(lambda s: s.keepalives) - before
        assert 2 <= count <= 7, count  # every 0.2 s: 5 in 1 s
        # The client counts a keepalive when its answer is back, a moment after the server.
        async with asyncio.timeout(5):
            while client.keepalives_sent < 3:
                await asyncio.sleep(0.02)
        await client.yield_("g1")


async def test_expired_session_forgets_grants_and_reopens(orch: FakeOrchestrator) -> None:
    async with client_for(orch, session_ttl=0.3) as client:
        await client.acquire("g1")
        first = client.session_id
        assert first is not None
        orch.do(lambda s: s.end_session(first))
        for _ in range(200):
            if client.session_id is None:
                break
            await asyncio.sleep(0.01)
        assert client.session_id is None, "the keepalive noticed the expiry"
        assert client.grants() == {}
        assert client.last_session_loss is not None and "expired" in client.last_session_loss
        calls = orch.do(lambda s: len(s.calls))
        with pytest.raises(NotHolder):
            await client.yield_("g1")
        assert orch.do(lambda s: len(s.calls)) == calls, "no call for a forgotten grant"
        grant = await client.acquire("g1", timeout=5)
        assert client.session_id not in (None, first)
        assert orch.do(lambda s: s.calls.count("OpenSession")) == 2
        await client.yield_("g1")
        assert grant.job_id == "job-a"


async def test_acquire_with_an_expired_session_requeues_under_a_new_one(
    orch: FakeOrchestrator,
) -> None:
    async with client_for(orch) as client:
        await client.acquire("warmup")
        await client.yield_("warmup")
        first = client.session_id
        assert first is not None
        # Expired on the server, not yet noticed by the client (keepalive every ~3 s).
        orch.do(lambda s: setattr(s.sessions[first], "expired", True))
        grant = await client.acquire("g1", timeout=5)
        assert client.session_id != first
        assert grant.group_id == "g1"
        await client.yield_("g1")


def test_missing_job_id_is_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    with pytest.raises(InvalidArgument, match="TIMESLICE_JOB_ID"):
        AsyncTimeSliceClient("127.0.0.1:1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": "127.0.0.1:1", "job_id": "../etc"}, "job_id"),
        ({"target": "127.0.0.1:99999", "job_id": "j"}, "port"),
        ({"target": "", "job_id": "j"}, "target"),
        ({"target": "::1:50051", "job_id": "j"}, "IPv6"),
        ({"target": "h:1", "job_id": "j", "session_ttl": 0}, "session_ttl"),
        ({"target": "h:1", "job_id": "j", "call_timeout": float("nan")}, "call_timeout"),
    ],
)
def test_bad_construction_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        AsyncTimeSliceClient(**kwargs)  # type: ignore[arg-type]


async def test_bad_call_arguments_change_nothing(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        with pytest.raises(InvalidArgument):
            await client.acquire("bad/group")
        with pytest.raises(InvalidArgument):
            await client.acquire("g1", timeout=-1)
        with pytest.raises(InvalidArgument):
            await client.acquire("g1", priority=2**40)
        with pytest.raises(InvalidArgument):
            client.on_accelerators("g/1")
        with pytest.raises(InvalidArgument):
            await client.status("")
    assert orch.do(lambda s: list(s.calls)) == []


def test_job_and_target_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_JOB_ID", "env-job")
    monkeypatch.setenv("TIMESLICE_TARGET", "a:1, [::1]:2,unix:///tmp/x.sock")
    client = AsyncTimeSliceClient()
    assert client.job_id == "env-job"
    assert client.targets == ["a:1", "[::1]:2", "unix:/tmp/x.sock"]
    monkeypatch.delenv("TIMESLICE_TARGET")
    assert AsyncTimeSliceClient().targets == ["localhost:50051"]
    assert AsyncTimeSliceClient(["h1:5", "h2"]).targets == ["h1:5", "h2:50051"]


ERROR_CASES = [
    (ErrorKind.INVALID_ARGUMENT, InvalidArgument),
    (ErrorKind.NOT_FOUND, NotFound),
    (ErrorKind.PERMISSION_DENIED, PermissionDenied),
    (ErrorKind.UNAUTHENTICATED, Unauthenticated),
    (ErrorKind.ALREADY_EXISTS, AlreadyExists),
    (ErrorKind.NOT_HOLDER, NotHolder),
    (ErrorKind.FAILED_PRECONDITION, FailedPrecondition),
    (ErrorKind.RESOURCE_EXHAUSTED, ResourceExhausted),
    (ErrorKind.SESSION_EXPIRED, SessionExpired),
    (ErrorKind.GROUP_FAULTED, GroupFaulted),
    (ErrorKind.TIMEOUT, Timeout),
    (ErrorKind.UNAVAILABLE, Unavailable),
    (ErrorKind.CANCELLED, Cancelled),
    (ErrorKind.INTERNAL, InternalError),
]


@pytest.mark.parametrize(("kind", "cls"), ERROR_CASES, ids=[k.value for k, _ in ERROR_CASES])
async def test_typed_error_mapping(
    orch: FakeOrchestrator, kind: ErrorKind, cls: type[TimeSliceError]
) -> None:
    error = cls(f"the {kind.value} case")
    orch.do(lambda s: s.fail.__setitem__("GetGroupStatus", wire_error(error)))
    async with client_for(orch, call_timeout=2.0) as client:
        await client.groups()  # connected: the 2 s are the failing call's alone
        with pytest.raises(cls, match=f"the {kind.value} case") as raised:
            await client.status("g1")
        assert raised.value.kind is kind


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (Status.NOT_FOUND, NotFound),
        (Status.ABORTED, GroupFaulted),
        (Status.UNKNOWN, InternalError),
    ],
)
async def test_untyped_status_maps_by_code(
    orch: FakeOrchestrator, status: Status, cls: type[TimeSliceError]
) -> None:
    orch.do(lambda s: s.fail.__setitem__("ListGroups", grpclib.GRPCError(status, "plain")))
    async with client_for(orch) as client:
        with pytest.raises(cls):
            await client.groups()


async def test_group_faulted_from_acquire(orch: FakeOrchestrator) -> None:
    orch.do(
        lambda s: s.fail.__setitem__(
            "Acquire", wire_error(GroupFaulted("restore of job-a failed on node-3"))
        )
    )
    async with client_for(orch) as client:
        with pytest.raises(GroupFaulted, match="node-3"):
            await client.acquire("g1", timeout=5)
        assert client.grants() == {}


async def test_unreachable_orchestrator_is_unavailable_within_call_timeout() -> None:
    client = AsyncTimeSliceClient(f"127.0.0.1:{free_port()}", job_id="j", call_timeout=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Unavailable):
        await client.status("g1")
    with pytest.raises(Unavailable):
        await client.acquire("g1")
    assert loop.time() - started < 2.5
    await client.close()


async def test_failover_to_the_next_target(orch: FakeOrchestrator) -> None:
    target = f"127.0.0.1:{free_port()},{orch.target}"
    async with AsyncTimeSliceClient(target, job_id="job-a", call_timeout=3) as client:
        status = await client.status("g1")
        assert status.group_id == "g1"
        grant = await client.acquire("g1", timeout=5)
        assert grant.group_id == "g1"
        assert [g.group_id for g in await client.groups()] == ["g1"]
        await client.yield_("g1")


async def test_acquire_reattaches_after_its_replica_dies(orch: FakeOrchestrator) -> None:
    # Replica A is reached through a proxy whose death cuts both directions, like a crash.
    orch.add_replica()
    replica_a = orch.frontends[0]
    proxy = TcpProxy(orch.ports[0])
    orch.thread.run(proxy.start())
    target = f"127.0.0.1:{proxy.port},127.0.0.1:{orch.ports[1]}"
    async with (
        AsyncTimeSliceClient(orch.target, job_id="holder") as holder,
        AsyncTimeSliceClient(target, job_id="job-a") as client,
        AsyncTimeSliceClient(f"127.0.0.1:{orch.ports[1]}", job_id="job-c") as later,
    ):
        await holder.acquire("g1")
        waiting = asyncio.create_task(client.acquire("g1", timeout=10))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        behind = asyncio.create_task(later.acquire("g1", timeout=10))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a", "job-c"])

        def crash() -> None:
            replica_a.dead = True
            proxy.kill()

        orch.do(lambda s: crash())
        await orch.until(lambda s: s.calls.count("Acquire") >= 4)
        assert orch.do(lambda s: s.queue_of("g1")) == ["job-a", "job-c"], "kept its place"
        await holder.yield_("g1")
        grant = await waiting
        assert grant.job_id == "job-a"
        assert not behind.done()
        await client.yield_("g1")
        await behind
        await later.yield_("g1")


async def test_watch_streams_status_changes(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        holders: list[str] = []
        async with contextlib.aclosing(client.watch("g1")) as events:
            async for event in events:
                assert event.status is not None
                holders.append(event.status.holder_job_id)
                if len(holders) == 1:
                    await client.acquire("g1")
                elif holders[-1] == "job-a":
                    break
        assert holders[0] == "" and holders[-1] == "job-a"
        await client.yield_("g1")


async def test_acquire_all_rolls_back_every_group_even_if_cancelled_meanwhile(
    orch: FakeOrchestrator,
) -> None:
    async with (
        client_for(orch, "other") as other,
        client_for(orch, call_timeout=3) as client,
    ):
        await other.acquire("g3")
        # No Yield is answered: each yield of the rollback takes the whole call timeout.
        orch.do(lambda s: setattr(s, "yield_delay", 60.0))
        # 3 s: g1 and g2 are surely granted by then on a loaded machine (first connection).
        task = asyncio.create_task(client.acquire_all(["g1", "g2", "g3"], timeout=3))
        await orch.until(lambda s: s.calls.count("Yield") >= 1, 20)  # the rollback started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)  # two yields of 3 s each at most
        assert client.grants() == {}, "the rollback stopped at the cancel"


async def test_close_ends_the_session_and_is_idempotent(orch: FakeOrchestrator) -> None:
    client = client_for(orch)
    await client.acquire("g1")
    await client.close()
    await client.close()
    assert orch.do(lambda s: s.calls.count("CloseSession")) == 1
    assert orch.do(lambda s: s.holder_of("g1")) is None
    assert client.closed and client.session_id is None
    with pytest.raises(Cancelled):
        await client.acquire("g1")


async def test_close_interrupts_a_waiting_acquire(orch: FakeOrchestrator) -> None:
    async with client_for(orch, "holder") as holder:
        await holder.acquire("g1")
        client = client_for(orch)
        waiting = asyncio.create_task(client.acquire("g1"))
        await orch.until(lambda s: s.queue_of("g1") == ["job-a"])
        await client.close()
        with pytest.raises(Cancelled):
            await asyncio.wait_for(waiting, 5)
        assert orch.do(lambda s: s.queue_of("g1")) == []
        await holder.yield_("g1")


async def test_close_ends_an_open_watch(orch: FakeOrchestrator) -> None:
    async with client_for(orch, "holder") as holder:
        client = client_for(orch)
        holders: list[str] = []
        watching = asyncio.Event()

        async def consume() -> None:
            async for event in client.watch("g1"):
                assert event.status is not None
                holders.append(event.status.holder_job_id)
                watching.set()

        watch = asyncio.create_task(consume())
        await asyncio.wait_for(watching.wait(), 5)
        await client.close()
        await holder.acquire("g1")
        with pytest.raises(Cancelled):
            await asyncio.wait_for(watch, 5)
        assert holders == [""], "an event after close() reached the consumer"
        # Its connection is closed too: the orchestrator's end of the stream is gone.
        await orch.until(lambda s: s.watching == 0)
        await holder.yield_("g1")


async def test_blocking_use_on_the_clients_own_loop_is_refused(orch: FakeOrchestrator) -> None:
    async with client_for(orch) as client:
        with pytest.raises(InvalidArgument, match="block"):
            with client.on_accelerators("g1"):
                pass
        await client.status("g1")  # bind the loop, then try again
        with pytest.raises(InvalidArgument, match="block"):
            with client.on_accelerators("g1"):
                pass
    assert orch.do(lambda s: s.holder_of("g1")) is None


def test_generators_cannot_be_decorated() -> None:
    client = AsyncTimeSliceClient("h:1", job_id="j")

    with pytest.raises(InvalidArgument, match="generator"):

        @client.on_accelerators("g1")
        def gen() -> object:
            yield 1


async def test_yields_are_yield_calls_on_a_server_without_yield_stream(
    orch: FakeOrchestrator,
) -> None:
    # The fake, like a replica older than YieldStream, answers it UNIMPLEMENTED: the first
    # yield falls back to a Yield call at once, and later ones do not try the stream again.
    async with client_for(orch) as client:
        for _ in range(3):
            await client.acquire("g1", timeout=5)
            await client.yield_("g1")
            assert orch.do(lambda s: s.holder_of("g1")) is None
        assert orch.do(lambda s: s.calls.count("Yield")) == 3
        assert client._yield_streams.open_streams == 0
        assert len(client._yield_streams._unsupported) == 1
