"""Test harness for the agent: the test plays the orchestrator, real processes play the rest.

- :class:`FakeHub` implements ``AgentHubBase`` on a real grpclib server over loopback TCP: the
  orchestrator side of the stream is the true boundary the agent talks to.
- :class:`AgentProcess` runs ``python -m timeslice_agent`` as a subprocess and follows its log.
- :class:`WorkerProcess` runs ``agent_worker.py`` (a real worker registering over the socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import aiohttp
from grpclib.server import Server
from prometheus_client.parser import text_string_to_metric_families

from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentHubBase,
    AgentMessage,
    Directive,
    DirectiveAck,
    DirectiveKind,
    OrchestratorMessage,
    Welcome,
    WorkersChanged,
    WorkersRecorded,
)

WORKER_SCRIPT = Path(__file__).with_name("agent_worker.py")
WAIT = 10.0


class FakeHub(AgentHubBase):
    """The orchestrator's side of ``AgentHub.Connect``, recording what the agent sends."""

    def __init__(self, replica_id: str = "test-hub", *, records_workers: bool = False) -> None:
        self.replica_id = replica_id
        # As a replica that confirms worker sets does (the test confirms with record()); an
        # older one does not.
        self.records_workers = records_workers
        self.hellos: asyncio.Queue[AgentHello] = asyncio.Queue()
        self.workers: asyncio.Queue[WorkersChanged] = asyncio.Queue()
        self._acks: asyncio.Queue[DirectiveAck] = asyncio.Queue()
        self._early_acks: dict[str, list[DirectiveAck]] = {}
        self._out: asyncio.Queue[OrchestratorMessage] = asyncio.Queue()
        self._closing = asyncio.Event()
        self.connections = 0
        self.active = 0

    async def connect(
        self, messages: AsyncIterator[AgentMessage]
    ) -> AsyncIterator[OrchestratorMessage]:
        self.connections += 1
        first = await anext(messages)
        assert first.hello is not None, f"first message was not a hello: {first}"
        self.hellos.put_nowait(first.hello)
        reader = asyncio.create_task(self._read(messages))
        closing = asyncio.create_task(self._closing.wait())
        get: asyncio.Future[OrchestratorMessage] | None = None
        self.active += 1
        try:
            welcome = Welcome(replica_id=self.replica_id, records_workers=self.records_workers)
            yield OrchestratorMessage(welcome=welcome)
            while True:
                get = asyncio.ensure_future(self._out.get())
                done, _ = await asyncio.wait(
                    {get, reader, closing}, return_when=asyncio.FIRST_COMPLETED
                )
                if get in done:
                    yield get.result()
                    continue
                return
        finally:
            self.active -= 1
            # A pending get must not outlive this stream, or it would steal the next directive.
            if get is not None and not get.done():
                get.cancel()
            closing.cancel()
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def _read(self, messages: AsyncIterator[AgentMessage]) -> None:
        async for message in messages:
            if message.ack is not None:
                self._acks.put_nowait(message.ack)
            elif message.workers is not None:
                self.workers.put_nowait(message.workers)

    async def end_streams(self, timeout: float = WAIT) -> None:
        """End every open stream from the orchestrator's side, as a replica shutting down does.

        (Closing a grpclib server only cancels its handlers; the client is not told.)
        """
        self._closing.set()

        async def idle() -> bool:
            return self.active == 0

        await eventually(idle, timeout, "the hub's streams to end")
        self._closing.clear()

    def record(self, seq: int) -> None:
        """Tell the agent the workers of its WorkersChanged ``seq`` are recorded."""
        recorded = WorkersRecorded(seq=seq, revision=seq)
        self._out.put_nowait(OrchestratorMessage(workers_recorded=recorded))

    def send(self, directive: Directive) -> None:
        self._out.put_nowait(OrchestratorMessage(directive=directive))

    async def ack_for(self, directive_id: str, timeout: float = WAIT) -> DirectiveAck:
        """The next ack carrying ``directive_id`` (acks of other ids are kept for later)."""
        early = self._early_acks.get(directive_id)
        if early:
            return early.pop(0)
        async with asyncio.timeout(timeout):
            while True:
                ack = await self._acks.get()
                if ack.directive_id == directive_id:
                    return ack
                self._early_acks.setdefault(ack.directive_id, []).append(ack)

    async def execute(self, directive: Directive, timeout: float = WAIT) -> DirectiveAck:
        self.send(directive)
        return await self.ack_for(directive.directive_id, timeout)

    async def next_hello(self, timeout: float = WAIT) -> AgentHello:
        async with asyncio.timeout(timeout):
            return await self.hellos.get()

    async def next_workers(self, timeout: float = WAIT) -> WorkersChanged:
        async with asyncio.timeout(timeout):
            return await self.workers.get()

    async def workers_until(self, predicate: Any, timeout: float = WAIT) -> WorkersChanged:
        """Skip WorkersChanged messages until one satisfies ``predicate``."""
        async with asyncio.timeout(timeout):
            while True:
                changed = await self.workers.get()
                if predicate(changed):
                    return changed


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = WAIT, what: str = "condition"
) -> None:
    """Poll ``check`` until it is true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def directive(
    did: str,
    kind: DirectiveKind,
    job: str,
    group: str,
    epoch: int,
    deadline_ms: int = 0,
) -> Directive:
    return Directive(
        directive_id=did,
        group_id=group,
        epoch=epoch,
        kind=kind,
        job_id=job,
        deadline_ms=deadline_ms,
    )


@contextlib.asynccontextmanager
async def running_hub(
    port: int = 0, *, records_workers: bool = False
) -> AsyncIterator[tuple[FakeHub, int]]:
    hub = FakeHub(records_workers=records_workers)
    server = Server([hub])
    await server.start("127.0.0.1", port)
    assert server._server is not None
    # grpclib types it as AbstractServer; loop.create_server made an asyncio.Server.
    bound = cast(asyncio.Server, server._server).sockets[0].getsockname()[1]
    try:
        yield hub, bound
    finally:
        await hub.end_streams()
        server.close()
        async with asyncio.timeout(WAIT):
            await server.wait_closed()


class AgentProcess:
    """``python -m timeslice_agent`` as a child process."""

    def __init__(
        self,
        workdir: Path,
        orchestrator: str,
        *,
        node: str = "node-a",
        backend: str = "sim",
        extra: Sequence[str] = (),
        socket: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.socket = socket or workdir / "agent.sock"
        self.state_file = workdir / f"agent-{node}.json"
        self.argv = [
            sys.executable, "-m", "timeslice_agent",
            "--orchestrator", orchestrator,
            "--node", node,
            "--backend", backend,
            "--worker-socket", str(self.socket),
            "--state-file", str(self.state_file),
            "--http", "127.0.0.1:0",
            "--hook-timeout", "2",
            "--insecure",
            *extra,
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._new_line = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None
        self.http_base = ""

    async def start(self, *, wait_ready: bool = True) -> AgentProcess:
        env = dict(os.environ)
        env.pop("TIMESLICE_AGENT_NODE", None)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        self._reader = asyncio.create_task(self._read())
        match = await self.wait_line(r"http listening on (\S+)")
        self.http_base = f"http://{match.group(1)}"
        if wait_ready:
            await self.wait_line(r"agent \S+ ready")
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            raw = await self.proc.stderr.readline()
            async with self._new_line:
                if raw:
                    self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._new_line.notify_all()
            if not raw:
                return

    async def run_to_exit(self, timeout: float = WAIT) -> tuple[int, str]:
        """Run the agent expecting it to exit by itself; returns (status, stderr)."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(timeout):
                _, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, err.decode(errors="replace")

    def log(self) -> str:
        return "\n".join(self.lines)

    async def wait_line(self, pattern: str, timeout: float = WAIT, start: int = 0) -> re.Match[str]:
        regex = re.compile(pattern)
        try:
            async with asyncio.timeout(timeout):
                async with self._new_line:
                    seen = start
                    while True:
                        for line in self.lines[seen:]:
                            match = regex.search(line)
                            if match:
                                return match
                        seen = len(self.lines)
                        if self._reader is not None and self._reader.done():
                            raise AssertionError(f"agent exited before {pattern!r}")
                        await self._new_line.wait()
        except TimeoutError:
            raise AssertionError(f"no log line {pattern!r} in {timeout} s:\n{self.log()}") from None

    async def http(self, path: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(self.http_base + path) as response:
                return response.status, await response.text()

    async def metric(self, name: str, **labels: str) -> float | None:
        """The value of sample ``name`` whose labels include ``labels``, or None."""
        _, text = await self.http("/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return None

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            if self._reader is not None:
                await self._reader
        return code

    async def ensure_stopped(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader


AgentFactory = Callable[..., AgentProcess]
"""What the ``agents`` fixture yields: make an AgentProcess (not yet started)."""


class WorkerProcess:
    """A real worker process (agent_worker.py) registered with the agent."""

    def __init__(self, socket: Path, job: str, group: str, *args: str) -> None:
        self.argv = [
            sys.executable, str(WORKER_SCRIPT),
            "--socket", str(socket), "--job", job, "--group", group, *args,
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, *, expect_registered: bool = True) -> WorkerProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
        )
        self._reader = asyncio.create_task(self._read())
        if expect_registered:
            event = await self.next_event()
            assert event["kind"] == "REGISTERED", event
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                return
            self.events.put_nowait(json.loads(raw))

    async def next_event(self, timeout: float = WAIT) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            return await self.events.get()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(WAIT):
                    await self._reader
