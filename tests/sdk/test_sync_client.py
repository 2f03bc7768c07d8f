"""TimeSliceOrchestratorClient (blocking API on a private loop thread) against the fake."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.sdk.fakes import FakeOrchestrator
from timeslice import (
    AsyncTimeSliceClient,
    Cancelled,
    InvalidArgument,
    NotHolder,
    Timeout,
    TimeSliceOrchestratorClient,
)

ANNOUNCEMENT = textwrap.dedent(
    """
    from timeslice import TimeSliceOrchestratorClient
    orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")
    @orchestrator.on_accelerators(group_id="trainer-group")
    def train_phase(model, trajectories):
        return model.update(trajectories)
    """
)


def test_announcement_snippet(orch: FakeOrchestrator, job_env: str) -> None:
    # The snippet verbatim; only the address points at the fake instead of a real deployment.
    source = ANNOUNCEMENT.replace("localhost:50051", orch.target)
    namespace: dict[str, object] = {}
    exec(compile(source, "announcement.py", "exec"), namespace)

    holders: list[str | None] = []

    class Model:
        def update(self, trajectories: list[int]) -> int:
            holders.append(orch.do(lambda s: s.holder_of("trainer-group")))
            return sum(trajectories)

    train_phase = namespace["train_phase"]
    assert callable(train_phase)
    assert train_phase.__name__ == "train_phase"  # type: ignore[attr-defined]
    for step in range(3):
        assert train_phase(Model(), [step, 1]) == step + 1
    assert holders == [job_env] * 3
    assert orch.do(lambda s: s.holder_of("trainer-group")) is None
    assert orch.do(lambda s: s.calls.count("Acquire")) == 3
    client = namespace["orchestrator"]
    assert isinstance(client, TimeSliceOrchestratorClient)
    client.close()


def test_with_block_and_explicit_calls(orch: FakeOrchestrator, job_env: str) -> None:
    with TimeSliceOrchestratorClient(orch.target) as client:
        assert client.job_id == job_env
        with client.on_accelerators("g1", timeout=5) as grant:
            assert grant.group_id == "g1"
            assert client.status("g1").holder_job_id == job_env
        assert client.status("g1").holder_job_id == ""

        grant = client.acquire("g1", timeout=5)
        assert client.grants() == {"g1": grant}
        assert [g.group_id for g in client.groups()] == ["g1"]
        client.yield_("g1")
        client.acquire("g1")
        client.release("g1")
        with pytest.raises(NotHolder):
            client.yield_("g1")
    assert client.closed
    assert orch.do(lambda s: s.calls.count("CloseSession")) == 1


def test_body_exception_propagates_from_sync_decorator(
    orch: FakeOrchestrator, job_env: str
) -> None:
    with TimeSliceOrchestratorClient(orch.target) as client:

        @client.on_accelerators("g1")
        def phase() -> None:
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            phase()
        assert orch.do(lambda s: s.holder_of("g1")) is None


async def test_sync_client_decorates_async_functions(orch: FakeOrchestrator, job_env: str) -> None:
    client = TimeSliceOrchestratorClient(orch.target)
    try:

        @client.on_accelerators(group_id="g1")
        async def phase(x: int) -> int:
            await asyncio.sleep(0.01)
            holder = await asyncio.to_thread(orch.do, lambda s: s.holder_of("g1"))
            assert holder == job_env
            return x + 1

        assert asyncio.iscoroutinefunction(phase)
        assert await phase(1) == 2
        async with client.on_accelerators("g1"):
            pass
        assert orch.do(lambda s: s.holder_of("g1")) is None
    finally:
        await asyncio.to_thread(client.close)


async def test_close_ends_a_watch_running_on_another_loop(
    orch: FakeOrchestrator, job_env: str
) -> None:
    client = TimeSliceOrchestratorClient(orch.target)
    async with AsyncTimeSliceClient(orch.target, job_id="holder") as holder:
        holders: list[str] = []
        watching = asyncio.Event()

        async def consume() -> None:
            # On this loop; close() runs on the client's own loop, in its thread.
            async for event in client.aio.watch("g1"):
                assert event.status is not None
                holders.append(event.status.holder_job_id)
                watching.set()

        watch = asyncio.create_task(consume())
        await asyncio.wait_for(watching.wait(), 5)
        await asyncio.to_thread(client.close)
        await holder.acquire("g1")
        with pytest.raises(Cancelled):
            await asyncio.wait_for(watch, 5)
        assert holders == [""], "an event after close() reached the consumer"
        await asyncio.to_thread(orch.wait_for, lambda s: s.watching == 0)
        await holder.yield_("g1")


def test_keepalive_runs_while_the_caller_computes(orch: FakeOrchestrator, job_env: str) -> None:
    with TimeSliceOrchestratorClient(orch.target, session_ttl=0.6) as client:
        client.acquire("g1")
        before = orch.do(lambda s: s.keepalives)
        time.sleep(1.5)  # a long "training step" holding the calling thread
        # One every 0.2 s would be 7; 3 leaves room for a loaded machine and still shows
        # the keepalive ran during the step, past the session's TTL.
        assert orch.do(lambda s: s.keepalives) - before >= 3
        client.yield_("g1")


def test_timeout_cancels_the_stream(orch: FakeOrchestrator, job_env: str) -> None:
    with (
        TimeSliceOrchestratorClient(orch.target, job_id="holder") as holder,
        TimeSliceOrchestratorClient(orch.target) as client,
    ):
        holder.acquire("g1")
        outcome: list[BaseException] = []

        def acquire() -> None:
            try:
                client.acquire("g1", timeout=2)
            except BaseException as exc:  # any outcome is looked at below
                outcome.append(exc)

        # The deadline is long enough for the request to reach the server on a loaded
        # machine: a stream that never got there has nothing on the server to cancel.
        caller = threading.Thread(target=acquire)
        caller.start()
        orch.wait_for(lambda s: s.queue_of("g1") == ["job-a"])
        caller.join(10)
        assert not caller.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], Timeout), outcome
        orch.wait_for(lambda s: s.cancelled_acquires == 1 and s.queue_of("g1") == [])
        holder.yield_("g1")


def test_keyboard_interrupt_cancels_a_blocking_acquire(
    orch: FakeOrchestrator, job_env: str
) -> None:
    assert threading.current_thread() is threading.main_thread()
    # interrupt_main() runs whatever SIGINT handler this worker process has; code an earlier
    # test ran in-process may have left its own. Ctrl-C's default is what is tested here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with (
        TimeSliceOrchestratorClient(orch.target, job_id="holder") as holder,
        TimeSliceOrchestratorClient(orch.target) as client,
        contextlib.ExitStack() as restore,
    ):
        restore.callback(signal.signal, signal.SIGINT, previous)
        holder.acquire("g1")
        interrupt = threading.Timer(0.3, _thread.interrupt_main)
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            client.acquire("g1")
        interrupt.join()
        # The stream was cancelled (the server dropped the entry) and the client is usable.
        orch.wait_for(lambda s: s.cancelled_acquires == 1 and s.queue_of("g1") == [])
        assert client.grants() == {}
        holder.yield_("g1")
        client.acquire("g1", timeout=5)
        client.yield_("g1")
        holder.acquire("g1")
        holder.yield_("g1")


def test_missing_job_id_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    threads = threading.active_count()
    with pytest.raises(InvalidArgument, match="TIMESLICE_JOB_ID"):
        TimeSliceOrchestratorClient(target="localhost:50051")
    assert threading.active_count() == threads


def test_close_is_idempotent_and_final(orch: FakeOrchestrator, job_env: str) -> None:
    client = TimeSliceOrchestratorClient(orch.target)
    client.acquire("g1")
    client.close()
    client.close()
    assert orch.do(lambda s: s.holder_of("g1")) is None
    assert not any(
        t.name.startswith("timeslice-client-") and t.is_alive() for t in threading.enumerate()
    )
    with pytest.raises(Cancelled):
        client.acquire("g1")
    with pytest.raises(Cancelled):
        client.status("g1")


def test_async_client_blocking_api_via_a_loop_in_another_thread(
    orch: FakeOrchestrator, job_env: str
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = AsyncTimeSliceClient(orch.target)
        asyncio.run_coroutine_threadsafe(client.status("g1"), loop).result(5)  # binds the loop
        with client.on_accelerators("g1") as grant:
            assert grant.job_id == job_env
            assert orch.do(lambda s: s.holder_of("g1")) == job_env
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


EXIT_WITHOUT_CLOSE = textwrap.dedent(
    """
    import sys
    from timeslice import TimeSliceOrchestratorClient
    client = TimeSliceOrchestratorClient(sys.argv[1], job_id="forgetful")
    client.acquire("g1", timeout=5)
    print("granted", flush=True)
    # no close(): the atexit hook must end the session
    """
)


def test_open_clients_are_closed_at_exit(orch: FakeOrchestrator) -> None:
    result = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, orch.target],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "granted"
    assert orch.do(lambda s: s.calls.count("CloseSession")) == 1
    assert orch.do(lambda s: s.holder_of("g1")) is None


def test_acquire_all_rolls_back_every_group_while_yields_hang(
    orch: FakeOrchestrator, job_env: str
) -> None:
    with (
        TimeSliceOrchestratorClient(orch.target, job_id="other") as other,
        TimeSliceOrchestratorClient(orch.target, call_timeout=3) as client,
    ):
        other.acquire("g5")
        # No Yield is answered: each yield of the rollback takes the whole call timeout.
        orch.do(lambda s: setattr(s, "yield_delay", 60.0))
        # The reason is the acquire's, not a yield's of the rollback, nor the loop's deadline.
        # 5 s: g1-g4 are surely granted by then on a loaded machine (first connection and all).
        with pytest.raises(Timeout, match="not granted group g5"):
            client.acquire_all(["g1", "g2", "g3", "g4", "g5"], timeout=5)
        # All or nothing: every group was yielded (its release goes on in the background).
        assert client.grants() == {}
        assert orch.do(lambda s: s.calls.count("Yield")) >= 4
