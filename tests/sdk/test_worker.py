"""timeslice.register() against a fake agent on a unix socket."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grpclib.server import Server

from tests.sdk.fakes import FakeAgent, LoopThread
from timeslice import (
    AsyncTimeSliceClient,
    FailedPrecondition,
    HookResult,
    InvalidArgument,
    TimeSliceOrchestratorClient,
    Unavailable,
    register,
)
from timeslice.status_details import KIND_CODEC
from timeslice.worker import check_can_enter
from timeslice_proto.timeslice.v1 import HookKind, WorkerCommand

REPO = Path(__file__).resolve().parents[2]


class AgentServer:
    """Serves a FakeAgent on a unix socket from the background loop thread."""

    def __init__(self, thread: LoopThread, path: Path) -> None:
        self.thread = thread
        self.path = path
        self.server: Server | None = None
        self.agent: FakeAgent | None = None

    def start(self, agent: FakeAgent) -> FakeAgent:
        async def start() -> Server:
            server = Server([agent], status_details_codec=KIND_CODEC)
            await server.start(path=str(self.path))
            return server

        self.agent = agent
        self.server = self.thread.run(start())
        return agent

    def stop(self) -> None:
        server = self.server
        if server is None:
            return
        self.server = None

        async def stop() -> None:
            server.close()
            await server.wait_closed()

        self.thread.run(stop())
        self.path.unlink(missing_ok=True)

    def wait_for(self, predicate: Callable[[FakeAgent], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        agent = self.agent
        assert agent is not None
        while True:
            if self.thread.call(lambda: predicate(agent)):
                return
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.01)


@pytest.fixture
def agent_server(loop_thread: LoopThread, short_dir: Path) -> Iterator[AgentServer]:
    server = AgentServer(loop_thread, short_dir / "agent.sock")
    try:
        yield server
    finally:
        server.stop()


def test_register_runs_hooks_and_reports_results(agent_server: AgentServer) -> None:
    agent = agent_server.start(
        FakeAgent(
            commands=[
                WorkerCommand(
                    command_id="c1", kind=HookKind.BEFORE_CHECKPOINT, job_id="j", group_id="g"
                ),
                WorkerCommand(
                    command_id="c2", kind=HookKind.AFTER_RESTORE, job_id="j", group_id="g"
                ),
            ]
        )
    )
    calls: list[str] = []

    def checkpoint() -> int:
        calls.append("checkpoint")
        return 1234

    def restore() -> None:
        calls.append("restore")
        raise RuntimeError("CUDA context lost")

    with register(
        "g",
        job_id="j",
        state_bytes=4096,
        socket=str(agent_server.path),
        on_checkpoint=checkpoint,
        on_restore=restore,
        timeout=5,
    ) as registration:
        assert registration.connected
        agent_server.wait_for(lambda a: len(a.results) == 2)
        assert calls == ["checkpoint", "restore"]
        info = agent.registered[0]
        assert (info.job_id, info.group_id, info.pid) == ("j", "g", os.getpid())
        assert info.state_bytes == 4096 and info.app_callbacks and not info.acquirer
        first, second = agent.results
        assert (first.command_id, first.ok, first.bytes_moved) == ("c1", True, 1234)
        assert first.error == ""
        assert (second.command_id, second.ok) == ("c2", False)
        assert "CUDA context lost" in second.error
        # The agent records a result when its CompleteCommand arrives; the worker counts it
        # when the answer comes back, a moment later on its own thread.
        wait_until(lambda: registration.commands_handled == 2, timeout=10)
    agent_server.wait_for(lambda a: a.streams_ended == 1)
    assert registration.closed and not registration.connected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (HookResult(bytes_moved=100, bytes_skipped=40), (True, 100, 40)),
        (HookResult(bytes_moved=7), (True, 7, 0)),
        (None, (True, 0, 0)),
        (HookResult(bytes_moved=10, bytes_skipped=20), (False, 0, 0)),
        (HookResult(bytes_moved=-1), (False, 0, 0)),
        ("12", (False, 0, 0)),
    ],
)
def test_hook_results_carry_skipped_bytes_and_bad_ones_fail(
    agent_server: AgentServer, answer: object, expected: tuple[bool, int, int]
) -> None:
    agent = agent_server.start(
        FakeAgent(commands=[WorkerCommand(command_id="c1", kind=HookKind.BEFORE_CHECKPOINT)])
    )
    with register(
        "g",
        job_id="j",
        socket=str(agent_server.path),
        on_checkpoint=lambda: answer,  # type: ignore[arg-type,return-value]
        timeout=5,
    ):
        agent_server.wait_for(lambda a: len(a.results) == 1)
    (result,) = agent.results
    assert (result.ok, result.bytes_moved, result.bytes_skipped) == expected
    if not result.ok:
        assert "expected a byte count" in result.error


def test_register_without_hooks(agent_server: AgentServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_JOB_ID", "env-job")
    monkeypatch.setenv("TIMESLICE_AGENT_SOCKET", str(agent_server.path))
    agent = agent_server.start(
        FakeAgent(
            commands=[
                WorkerCommand(command_id="c1", kind=HookKind.BEFORE_CHECKPOINT),
            ]
        )
    )
    registration = register("g", pid=4242, acquirer=True)
    try:
        agent_server.wait_for(lambda a: len(a.results) == 1)
        info = agent.registered[0]
        assert (info.job_id, info.pid, info.acquirer, info.app_callbacks) == (
            "env-job",
            4242,
            True,
            False,
        )
        assert agent.results[0].ok, "no hook of that kind: nothing to do"
    finally:
        registration.close()
        registration.close()


def start_agent_process(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sdk.agent_proc", str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_register_again_after_the_agent_restarts(short_dir: Path) -> None:
    path = short_dir / "agent.sock"
    first = start_agent_process(path)
    second: subprocess.Popen[str] | None = None
    try:
        with register("g", job_id="j", socket=str(path), timeout=5) as registration:
            assert first.stdout is not None
            assert first.stdout.readline() == "registered j\n"
            first.send_signal(signal.SIGKILL)  # the agent crashes
            first.wait(5)
            wait_until(lambda: not registration.connected)
            assert registration.last_error is not None
            second = start_agent_process(path)
            assert second.stdout is not None
            assert second.stdout.readline() == "registered j\n"
            wait_until(lambda: registration.connected)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait(5)


def test_unreachable_agent_is_unavailable(short_dir: Path) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match="could not register"):
        register("g", job_id="j", socket=str(short_dir / "nobody.sock"), timeout=0.5)
    assert time.monotonic() - started < 3


def test_agent_refusal_is_a_typed_error(agent_server: AgentServer) -> None:
    agent_server.start(FakeAgent(refuse=InvalidArgument("group g is not on this node").to_grpc()))
    with pytest.raises(InvalidArgument, match="not on this node"):
        register("g", job_id="j", socket=str(agent_server.path), timeout=5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_id": "a/b", "job_id": "j"}, "group_id"),
        ({"group_id": "g", "job_id": "j", "pid": 0}, "pid"),
        ({"group_id": "g", "job_id": "j", "state_bytes": -1}, "state_bytes"),
        ({"group_id": "g", "job_id": "j", "on_checkpoint": 3}, "on_checkpoint"),
        ({"group_id": "g", "job_id": "j", "timeout": -1}, "timeout"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        register(socket="/nonexistent/agent.sock", **kwargs)  # type: ignore[arg-type]


def test_missing_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    with pytest.raises(InvalidArgument, match="TIMESLICE_JOB_ID"):
        register("g", socket="/nonexistent/agent.sock")


async def test_async_hooks_are_refused() -> None:
    async def hook() -> int:
        return 0

    with pytest.raises(InvalidArgument, match="non-async"):
        register("g", job_id="j", socket="/nonexistent/agent.sock", on_restore=hook)  # type: ignore[arg-type]


def test_a_job_registered_in_one_group_may_not_enter_another(agent_server: AgentServer) -> None:
    # The job's state is offloaded by group A's switches: a phase of group B from this
    # process would run with it gone (a real GRPO job died so, "storage of size 0").
    agent_server.start(FakeAgent())
    client = TimeSliceOrchestratorClient("127.0.0.1:1", job_id="j", call_timeout=1)
    try:
        with register("g-a", job_id="j", socket=str(agent_server.path), timeout=5) as reg:
            with pytest.raises(FailedPrecondition) as refused:
                client.acquire("g-b", timeout=5)
            message = str(refused.value)
            assert "job j" in message and "group g-b" in message and "group g-a" in message
            assert "one group per node" in message
            with pytest.raises(FailedPrecondition, match="g-a"):
                with client.on_accelerators("g-b"):
                    pass
            # Its own group, and other jobs' groups, are not refused here.
            check_can_enter("j", "g-a")
            check_can_enter("other-job", "g-b")
            assert reg.live
        assert not reg.live
        check_can_enter("j", "g-b")  # closed: the process serves no group any more
    finally:
        client.close()


async def test_the_async_client_refuses_it_too(agent_server: AgentServer) -> None:
    agent_server.start(FakeAgent())
    registration = await asyncio.to_thread(
        register, "g-a", job_id="j", socket=str(agent_server.path), timeout=5
    )
    client = AsyncTimeSliceClient("127.0.0.1:1", job_id="j", call_timeout=1)
    try:
        with pytest.raises(FailedPrecondition, match="group g-a"):
            await client.acquire_all(["g-a", "g-b"], timeout=5)
        assert client.grants() == {}
    finally:
        await client.close()
        registration.close()
