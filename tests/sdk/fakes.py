"""The orchestrator's and the agent's side of the wire, played by the tests.

These are fakes at a true boundary: real grpclib servers over loopback TCP or unix sockets,
speaking the real protocol, with a small in-memory lock per group that honours the semantics
the SDK relies on (queue positions, re-attach by session, cancel-safety, typed errors).
Everything runs on one event loop in a background thread, so both the asyncio and the
blocking SDK clients can talk to it from a test.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpclib
from grpclib.server import Server

from timeslice.errors import (
    AlreadyExists,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    TimeSliceError,
    Unauthenticated,
    Unavailable,
)
from timeslice.status_details import KIND_CODEC
from timeslice.tls import TlsFiles, server_context
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    AcquireState,
    CloseSessionRequest,
    CloseSessionResponse,
    CommandResult,
    CommandResultAck,
    GetGroupStatusRequest,
    GroupEvent,
    GroupStatus,
    GroupSummary,
    HookKind,
    KeepAliveRequest,
    KeepAliveResponse,
    ListGroupsRequest,
    ListGroupsResponse,
    OpenSessionRequest,
    OpenSessionResponse,
    QueueEntry,
    TimeSliceBase,
    WatchGroupRequest,
    WorkerCommand,
    WorkerInfo,
    WorkerLinkBase,
    YieldRequest,
    YieldResponse,
)

T = TypeVar("T")


def wire_error(error: TimeSliceError) -> grpclib.GRPCError:
    """The gRPC status a real server sends for a typed error."""
    return error.to_grpc()


class LoopThread:
    """An event loop running in a daemon thread; tests submit work to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fake-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 5.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper(), timeout)

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --------------------------------------------------------------------------- orchestrator


@dataclass
class FakeSession:
    session_id: str
    job: str
    ttl: int
    secret: str = ""
    expired: bool = False


@dataclass(eq=False)
class Entry:
    job: str
    session_id: str
    priority: int
    enqueued_at: float
    ticket: int


@dataclass
class Hold:
    job: str
    session_id: str
    epoch: int


@dataclass
class FakeGroup:
    name: str
    holder: Hold | None = None
    queue: list[Entry] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    revision: int = 0

    def notify(self) -> None:
        self.revision += 1
        self.changed.set()
        self.changed = asyncio.Event()


class OrchestratorState:
    """Shared by every frontend (replica) of one fake orchestrator."""

    def __init__(self) -> None:
        self.sessions: dict[str, FakeSession] = {}
        self.groups: dict[str, FakeGroup] = {}
        self.calls: list[str] = []
        self.keepalives = 0
        self.cancelled_acquires = 0
        # Acquire handlers that ran to their end (their grant sent).
        self.finished_acquires = 0
        # WatchGroup streams open now (a client that closes its connections ends its own).
        self.watching = 0
        self.released_unsent = 0
        # method name -> error to answer with (persistent until removed)
        self.fail: dict[str, grpclib.GRPCError] = {}
        # After sending GRANTED, keep the stream open (trailers never come).
        self.hang_after_grant = False
        # On a cancel after GRANTED was sent, give the grant back (the real server does when
        # it notices; turned off to test the client's own give-back).
        self.release_raced = True
        # Seconds Yield takes before answering.
        self.yield_delay = 0.0
        # Yields whose release lands but whose answer is lost (UNAVAILABLE, as when etcd's
        # leader dies after the commit), and the job the group then goes to at once.
        self.yield_replies_lost = 0
        self.hand_over_to: str | None = None
        self._revisions = itertools.count(100)
        self._sessions = itertools.count(1)

    def group(self, name: str) -> FakeGroup:
        if name not in self.groups:
            self.groups[name] = FakeGroup(name)
        return self.groups[name]

    def next_revision(self) -> int:
        return next(self._revisions)

    def new_session(self, job: str, ttl: int) -> FakeSession:
        sid = f"{next(self._sessions):016x}"
        session = FakeSession(sid, job, ttl, secret=secrets.token_urlsafe(16))
        self.sessions[sid] = session
        return session

    def live_session(self, session_id: str, secret: str) -> FakeSession:
        """The session, if it lives and ``secret`` is its secret (as the orchestrator checks:
        the SDK must send it on every call, through failovers and re-attaches)."""
        session = self.sessions.get(session_id)
        if session is None or session.expired:
            raise SessionExpired(f"session {session_id} expired").to_grpc()
        if secret != session.secret:
            raise Unauthenticated(f"session {session_id}: wrong secret").to_grpc()
        return session

    def end_session(self, session_id: str) -> None:
        """What the lease expiry does: the session's queue entries and holds go away."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.expired = True
        for group in self.groups.values():
            group.queue = [e for e in group.queue if e.session_id != session_id]
            if group.holder is not None and group.holder.session_id == session_id:
                group.holder = None
            group.notify()

    def holder_of(self, group: str) -> str | None:
        g = self.groups.get(group)
        return g.holder.job if g is not None and g.holder is not None else None

    def queue_of(self, group: str) -> list[str]:
        g = self.groups.get(group)
        return [e.job for e in g.queue] if g is not None else []

    def status(self, name: str) -> GroupStatus:
        g = self.group(name)
        status = GroupStatus(
            group_id=name,
            queue=[
                QueueEntry(
                    job_id=e.job, priority=e.priority, enqueued_at=e.enqueued_at, revision=e.ticket
                )
                for e in g.queue
            ],
        )
        if g.holder is not None:
            status.holder_job_id = g.holder.job
            status.holder_epoch = g.holder.epoch
        return status


class Frontend(TimeSliceBase):
    """One orchestrator replica over the shared state."""

    def __init__(self, state: OrchestratorState) -> None:
        self.state = state
        # A dead replica cannot clean up: what it held stays, as it would in etcd.
        self.dead = False

    def __mapping__(self) -> dict[str, Any]:
        # Like a replica older than YieldStream: the method is not there at all, so grpclib
        # answers it as a method not found (the SDK falls back to Yield calls).
        mapping = super().__mapping__()
        del mapping["/timeslice.v1.TimeSlice/YieldStream"]
        return mapping

    def _enter(self, method: str) -> None:
        self.state.calls.append(method)
        error = self.state.fail.get(method)
        if error is not None:
            raise error

    async def open_session(self, message: OpenSessionRequest) -> OpenSessionResponse:
        self._enter("OpenSession")
        ttl = message.ttl_seconds or 10
        session = self.state.new_session(message.job_id, ttl)
        return OpenSessionResponse(
            session_id=session.session_id, ttl_seconds=ttl, session_secret=session.secret
        )

    async def keep_alive(self, message: KeepAliveRequest) -> KeepAliveResponse:
        self._enter("KeepAlive")
        session = self.state.live_session(message.session_id, message.session_secret)
        self.state.keepalives += 1
        return KeepAliveResponse(ttl_seconds=session.ttl)

    async def close_session(self, message: CloseSessionRequest) -> CloseSessionResponse:
        self._enter("CloseSession")
        session = self.state.sessions.get(message.session_id)
        if session is not None and not session.expired:
            self.state.live_session(message.session_id, message.session_secret)
        self.state.end_session(message.session_id)
        return CloseSessionResponse()

    async def acquire(self, message: AcquireRequest) -> AsyncIterator[AcquireEvent]:
        self._enter("Acquire")
        state = self.state
        session = state.live_session(message.session_id, message.session_secret)
        g = state.group(message.group_id)
        if g.holder is not None and g.holder.job == message.job_id:
            raise AlreadyExists(f"{message.job_id} holds {g.name}").to_grpc()
        entry = next((e for e in g.queue if e.session_id == session.session_id), None)
        if entry is None:
            entry = Entry(
                message.job_id,
                session.session_id,
                message.priority,
                time.time(),
                state.next_revision(),
            )
            g.queue.append(entry)
            g.notify()
        started = time.monotonic()
        granted: Hold | None = None
        last_position: int | None = None
        try:
            while True:
                if session.expired:
                    raise SessionExpired(f"session {session.session_id} expired").to_grpc()
                if g.holder is None and g.queue and g.queue[0] is entry:
                    g.queue.pop(0)
                    granted = Hold(entry.job, entry.session_id, state.next_revision())
                    g.holder = granted
                    g.notify()
                    yield AcquireEvent(
                        state=AcquireState.GRANTED,
                        epoch=granted.epoch,
                        waited_seconds=time.monotonic() - started,
                        ticket=entry.ticket,
                    )
                    if state.hang_after_grant:
                        await asyncio.Event().wait()
                    state.finished_acquires += 1
                    return
                if entry in g.queue:
                    position = g.queue.index(entry)
                    if position != last_position:
                        last_position = position
                        yield AcquireEvent(state=AcquireState.QUEUED, queue_position=position)
                changed = g.changed
                await changed.wait()
        except (asyncio.CancelledError, GeneratorExit):
            if self.dead:
                raise
            state.cancelled_acquires += 1
            if entry in g.queue:
                g.queue.remove(entry)
            if granted is not None and g.holder is granted and state.release_raced:
                g.holder = None
                state.released_unsent += 1
            g.notify()
            raise

    async def yield_(self, message: YieldRequest) -> YieldResponse:
        self._enter("Yield")
        self.state.live_session(message.session_id, message.session_secret)
        if self.state.yield_delay:
            await asyncio.sleep(self.state.yield_delay)
        g = self.state.group(message.group_id)
        holder = g.holder
        if holder is not None and holder.job != message.job_id:
            raise PermissionDenied(f"{holder.job} holds {g.name}").to_grpc()
        if holder is None or holder.epoch != message.epoch:
            raise NotHolder(
                f"{message.job_id} does not hold {g.name} at epoch {message.epoch}"
            ).to_grpc()
        g.holder = None
        if self.state.yield_replies_lost > 0:
            self.state.yield_replies_lost -= 1
            if self.state.hand_over_to is not None:
                g.holder = Hold(self.state.hand_over_to, "other", self.state.next_revision())
            g.notify()
            raise Unavailable("etcd: leader changed").to_grpc()
        g.notify()
        return YieldResponse()

    async def list_groups(self, message: ListGroupsRequest) -> ListGroupsResponse:
        self._enter("ListGroups")
        return ListGroupsResponse(
            groups=[
                GroupSummary(
                    group_id=g.name,
                    holder_job_id=g.holder.job if g.holder else "",
                    queue_length=len(g.queue),
                )
                for g in self.state.groups.values()
            ]
        )

    async def get_group_status(self, message: GetGroupStatusRequest) -> GroupStatus:
        self._enter("GetGroupStatus")
        return self.state.status(message.group_id)

    async def watch_group(self, message: WatchGroupRequest) -> AsyncIterator[GroupEvent]:
        self._enter("WatchGroup")
        g = self.state.group(message.group_id)
        self.state.watching += 1
        try:
            while True:
                changed = g.changed
                yield GroupEvent(revision=g.revision, status=self.state.status(g.name))
                await changed.wait()
        finally:
            self.state.watching -= 1


class TcpProxy:
    """A loopback TCP proxy whose death looks to both ends like a replica crash."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def kill(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()


class FakeOrchestrator:
    """Replicas of one fake orchestrator, served from a background loop thread."""

    def __init__(self, thread: LoopThread, *, tls: TlsFiles | None = None) -> None:
        """``tls``: serve mutual TLS with these files (the server's certificate and the CA
        of its clients); None: plaintext."""
        self.thread = thread
        self._ssl = None if tls is None else server_context(tls)
        self.state = thread.call(OrchestratorState)
        self.frontends: list[Frontend] = []
        self.ports: list[int] = []
        self._servers: list[Server] = []

    def add_replica(self) -> Frontend:
        frontend = Frontend(self.state)

        async def start() -> int:
            server = Server([frontend], status_details_codec=KIND_CODEC)
            # proto must say TCP, or neither asyncio nor grpclib sets TCP_NODELAY on accepted
            # connections (and every call then waits out a 40 ms delayed ACK).
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            await server.start(sock=sock, ssl=self._ssl)
            self._servers.append(server)
            return port

        self.ports.append(self.thread.run(start()))
        self.frontends.append(frontend)
        return frontend

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def do(self, fn: Callable[[OrchestratorState], T]) -> T:
        """Run ``fn(state)`` on the server loop (the state is not thread-safe)."""
        return self.thread.call(lambda: fn(self.state))

    def wait_for(
        self, predicate: Callable[[OrchestratorState], bool], timeout: float = 5.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while not self.do(predicate):
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.01)

    async def until(
        self, predicate: Callable[[OrchestratorState], bool], timeout: float = 5.0
    ) -> None:
        """Like :meth:`wait_for`, for async tests (polls without blocking their loop)."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self.do, predicate):
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.01)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for server in self._servers:
                await server.wait_closed()

        self.thread.run(stop())


# ---------------------------------------------------------------------------------- agent


class FakeAgent(WorkerLinkBase):
    """The node agent's worker socket: accepts a worker, then sends scripted hook commands."""

    def __init__(
        self, commands: list[WorkerCommand] | None = None, refuse: grpclib.GRPCError | None = None
    ) -> None:
        self.commands = commands or []
        self.refuse = refuse
        self.registered: list[WorkerInfo] = []
        self.results: list[CommandResult] = []
        self.streams_ended = 0
        self.results_changed = asyncio.Event()

    async def register(self, message: WorkerInfo) -> AsyncIterator[WorkerCommand]:
        if self.refuse is not None:
            raise self.refuse
        self.registered.append(message)
        try:
            yield WorkerCommand(
                command_id="reg",
                kind=HookKind.REGISTERED,
                job_id=message.job_id,
                group_id=message.group_id,
            )
            for command in self.commands:
                yield command
            await asyncio.Event().wait()  # the registration lasts as long as the stream
        finally:
            self.streams_ended += 1

    async def complete_command(self, message: CommandResult) -> CommandResultAck:
        self.results.append(message)
        return CommandResultAck()
