"""The agent's link to the orchestrator: one ``AgentHub.Connect`` bidi stream at a time.

The agent dials out (so it works behind NAT, on bare metal and under Slurm). On every
connection it first sends ``AgentHello`` (node, backend, devices, workers, jobs, epochs), then
waits for ``Welcome`` (bounded by :data:`WELCOME_TIMEOUT_SECONDS`); only then is it ready. After
that a sender and a receiver run side by side: the receiver hands each directive to the
executor, the sender drains one outbox (acks, plus a full ``WorkersChanged`` whenever the set of
workers changed). Acks wait in the outbox across reconnects; a pending ``WorkersChanged`` does
not, because the next hello carries the full list.

When a stream fails or ends, the link reconnects with exponential backoff and jitter (0.05 s
doubling to 2 s), cycling through the configured targets; HTTP/2 keepalive pings detect a peer
that vanished without closing the connection.

Liveness and fencing (``docs/fencing.md``): the Welcome asks for a heartbeat every so often
and names the orchestrator's liveness timeout. The heartbeat ticker also watches this process:
when its own event loop was stalled for half the liveness timeout (SIGSTOP, a swap storm), the
orchestrator may have fenced the node out meanwhile, so the link reports the stall
(:meth:`OrchestratorLink.stalled`, which the executor checks before accepting a directive) and
drops the stream. Before each hello the link lets running directives finish (``settle``), so
the hello reports what is really on the devices; the Welcome's fence revision goes to
``on_welcome``.

A state file that cannot be written (:meth:`OrchestratorLink.state_unwritable`) is reported
on the stream (``StateUnwritable``: the orchestrator fences the node out), directives are
refused unanswered from then on, and no new stream is dialled until a write succeeds
(:meth:`OrchestratorLink.state_writable`); the stream it was reported on is then dropped, so
that the agent says hello again and learns its fence before it accepts any directive.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import grpclib.const
from grpclib.client import Channel, Stream
from grpclib.config import Configuration

from timeslice.backoff import Backoff
from timeslice.status_details import KIND_CODEC
from timeslice.targets import HostPort
from timeslice.tls import ReloadingContext, TlsChannel, TlsFiles, client_context
from timeslice_agent.config import Endpoint
from timeslice_agent.metrics import AgentMetrics
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentMessage,
    Directive,
    DirectiveAck,
    Heartbeat,
    OrchestratorMessage,
    StateUnwritable,
    Welcome,
    WorkerInfo,
    WorkersChanged,
)

log = logging.getLogger(__name__)

CONNECT_ROUTE = "/timeslice.v1.AgentHub/Connect"
CONNECT_TIMEOUT_SECONDS = 5.0
WELCOME_TIMEOUT_SECONDS = 10.0
BACKOFF_INITIAL_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0
MAX_PENDING_ACKS = 8192

_CHANNEL_CONFIG = Configuration(
    _keepalive_time=1.0,
    _keepalive_timeout=2.0,
    _keepalive_permit_without_calls=True,
    _http2_max_pings_without_data=0,
    _http2_min_sent_ping_interval_without_data=5.0,
)

_AgentStream = Stream[AgentMessage, OrchestratorMessage]


class StreamProtocolError(Exception):
    """The orchestrator broke the stream contract (for example no Welcome first)."""


class StreamClosed(Exception):
    """The orchestrator ended the stream."""


class OrchestratorLink:
    """Keeps one stream to an orchestrator replica up; see the module docstring.

    ``hello`` builds the current AgentHello, ``workers`` the current worker list,
    ``host_available`` the host memory free each heartbeat carries (None: not said),
    ``on_directive`` takes each directive (it must not block).
    """

    def __init__(
        self,
        *,
        node: str,
        targets: Sequence[Endpoint],
        hello: Callable[[], AgentHello],
        workers: Callable[[], list[WorkerInfo]],
        on_directive: Callable[[Directive], None],
        metrics: AgentMetrics,
        welcome_timeout: float = WELCOME_TIMEOUT_SECONDS,
        backoff: Backoff | None = None,
        on_welcome: Callable[[Welcome], None] | None = None,
        settle: Callable[[], Awaitable[None]] | None = None,
        tls: TlsFiles | None = None,
        host_available: Callable[[], int | None] | None = None,
    ) -> None:
        if not targets:
            raise ValueError("at least one orchestrator target is needed")
        self._node = node
        self._targets = list(targets)
        self._hello = hello
        self._workers = workers
        self._host_available = host_available or (lambda: None)
        self._on_directive = on_directive
        self._metrics = metrics
        self._welcome_timeout = welcome_timeout
        self._backoff = backoff or Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_MAX_SECONDS)
        self._acks: deque[DirectiveAck] = deque()
        self._workers_dirty = False
        self._wake = asyncio.Event()
        self._ready = False
        self.replica_id = ""
        self._on_welcome = on_welcome
        self._settle = settle
        # Files are read (in a thread) at the first connect, and again when they change.
        self._tls = (
            ReloadingContext(tls, client_context, name="agent TLS") if tls is not None else None
        )
        # Asked for by the current stream's Welcome (0: no heartbeats, no stall detection).
        self._heartbeat_interval = 0.0
        self._liveness_timeout = 0.0
        self._heartbeat_due = False
        self._heartbeat_seq = 0
        self._last_tick = 0.0  # loop time the heartbeat ticker last ran
        self._stall = ""  # why the current stream is not trusted with directives ("" if it is)
        # Versions of the worker set: the latest, and the latest the orchestrator recorded in
        # etcd (only a Welcome with records_workers confirms; older replicas never do).
        self._workers_version = 0
        self._recorded_version = 0
        self._records_workers = False
        self._recorded_changed = asyncio.Event()
        # Why the state file cannot be written ("" while it can): no stream is dialled then.
        self._unwritable = ""
        self._unwritable_due = False  # to be reported on the current (or next) stream
        self._writable = asyncio.Event()
        self._writable.set()
        # Set when the state file became unwritable during the current stream.
        self._reported = asyncio.Event()

    @property
    def ready(self) -> bool:
        """True while a stream is up and its Welcome was received."""
        return self._ready

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        self._metrics.stream_connected.set(1 if ready else 0)
        self._notify_recorded()

    def _notify_recorded(self) -> None:
        changed, self._recorded_changed = self._recorded_changed, asyncio.Event()
        changed.set()

    @property
    def records_workers(self) -> bool:
        """Whether the current stream's orchestrator confirms recorded worker sets."""
        return self._records_workers

    @property
    def workers_version(self) -> int:
        """The version of the worker set: it counts up at each :meth:`workers_changed`."""
        return self._workers_version

    async def workers_recorded(self, version: int, timeout: float) -> bool:
        """Wait until the orchestrator has the worker set of ``version`` in etcd.

        True once it has. False at once when no stream is up or its orchestrator does not
        confirm (a replica older than WorkersRecorded), and False when the stream ends or
        ``timeout`` passes first: the workers then reach the orchestrator with the next
        WorkersChanged or hello, unconfirmed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._recorded_version < version:
            remaining = deadline - loop.time()
            if not self._ready or not self._records_workers or remaining <= 0:
                return False
            changed = self._recorded_changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return False
        return True

    def send_ack(self, ack: DirectiveAck) -> None:
        """Queue an ack; it is sent on the current stream or the next one."""
        if len(self._acks) >= MAX_PENDING_ACKS:
            dropped = self._acks.popleft()
            log.error(
                "ack outbox full (%d): dropped the ack of directive %s; the orchestrator gets "
                "it again by re-sending the directive",
                MAX_PENDING_ACKS,
                dropped.directive_id,
            )
        self._acks.append(ack)
        self._wake.set()

    def state_unwritable(self, reason: str) -> None:
        """The state file cannot be written: tell the orchestrator, which fences the node out;
        answer no directive, and dial no new stream, until :meth:`state_writable`."""
        if self._unwritable:
            return
        self._unwritable = reason
        self._unwritable_due = True
        self._writable.clear()
        self._reported.set()
        self._wake.set()

    def state_writable(self) -> None:
        """The state file can be written again: say hello again (ending a stream on which the
        node was reported unwritable: it may have been fenced meanwhile, and only the next
        Welcome says so; directives wait for it)."""
        if not self._unwritable:
            return
        self._unwritable = ""
        self._unwritable_due = False
        if self._ready and not self._stall:
            self._stall = "the state file was unwritable on this stream: saying hello again"
        self._writable.set()

    def _stall_threshold(self) -> float:
        return self._heartbeat_interval + self._liveness_timeout / 2

    def stalled(self) -> str | None:
        """Why directives must not run now: this process stalled long enough to be fenced.

        Either the ticker saw the stall (then the stream is being dropped), or it has not run
        for that long (the loop is only now waking, and a directive that waited in a socket
        buffer is being read before the ticker's turn).
        """
        if self._unwritable:
            return f"the state file cannot be written ({self._unwritable})"
        if self._stall:
            return self._stall
        if self._liveness_timeout <= 0 or not self._ready:
            return None
        late = asyncio.get_running_loop().time() - self._last_tick
        if late > self._stall_threshold():
            return f"event loop stalled for {late:.1f} s: the node may have been fenced out"
        return None

    def workers_changed(self) -> None:
        """Note that the worker set changed; a full WorkersChanged goes out on the stream."""
        self._workers_version += 1
        self._workers_dirty = True
        self._wake.set()

    async def run_forever(self) -> None:
        """Connect, serve, reconnect; returns only by cancellation."""
        attempt = 0
        while True:
            if not self._writable.is_set():
                log.warning(
                    "agent %s: not connecting to an orchestrator until the state file can be "
                    "written",
                    self._node,
                )
                await self._writable.wait()
            target = self._targets[attempt % len(self._targets)]
            attempt += 1
            try:
                await self._session(target)
                raise StreamClosed("the orchestrator ended the stream")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._metrics.reconnects.inc()
                delay = self._backoff.next_delay()
                log.warning(
                    "orchestrator stream to %s failed (%s: %s); retrying in %.2f s",
                    target,
                    type(exc).__name__,
                    exc,
                    delay,
                )
            finally:
                self._set_ready(False)
            await asyncio.sleep(delay)

    async def _session(self, target: Endpoint) -> None:
        channel = (
            Channel(
                target.host, target.port, config=_CHANNEL_CONFIG, status_details_codec=KIND_CODEC
            )
            if self._tls is None
            else TlsChannel(HostPort(target.host, target.port), self._tls, _CHANNEL_CONFIG)
        )
        try:
            async with channel.request(
                CONNECT_ROUTE,
                grpclib.const.Cardinality.STREAM_STREAM,
                AgentMessage,
                OrchestratorMessage,
            ) as stream:
                async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                    await stream.send_request()
                if self._settle is not None:
                    # Directives begun on an earlier stream finish first: the hello must say
                    # what they left on the devices (a fenced node's reconciliation reads it).
                    await self._settle()
                # The hello carries the full worker list, so a pending change is covered by it.
                self._workers_dirty = False
                covered = self._workers_version
                await stream.send_message(AgentMessage(hello=self._hello()))
                welcome = await self._await_welcome(stream, target)
                self._records_workers = welcome.records_workers
                if welcome.records_workers:
                    # Such a replica records the hello's workers before it welcomes.
                    self._workers_recorded_up_to(covered)
                self._backoff.reset()
                await self._serve(stream)
        finally:
            channel.close()

    def _workers_recorded_up_to(self, version: int) -> None:
        if version > self._recorded_version:
            self._recorded_version = version
            self._notify_recorded()

    async def _await_welcome(self, stream: _AgentStream, target: Endpoint) -> Welcome:
        try:
            async with asyncio.timeout(self._welcome_timeout):
                first = await stream.recv_message()
        except TimeoutError:
            raise StreamProtocolError(
                f"no Welcome within {self._welcome_timeout:g} s of the hello"
            ) from None
        if first is None:
            raise StreamClosed("the orchestrator ended the stream before its Welcome")
        if first.welcome is None:
            raise StreamProtocolError("the orchestrator's first message was not a Welcome")
        welcome = first.welcome
        self.replica_id = welcome.replica_id
        if self._on_welcome is not None:
            self._on_welcome(welcome)  # the fence revision: adopted before any directive
        self._heartbeat_interval = welcome.heartbeat_interval_ms / 1000
        self._liveness_timeout = welcome.liveness_timeout_ms / 1000
        self._last_tick = asyncio.get_running_loop().time()
        self._stall = ""
        self._set_ready(True)
        log.info(
            "agent %s ready (orchestrator %s, replica %s)",
            self._node,
            target,
            self.replica_id or "?",
        )
        return welcome

    async def _serve(self, stream: _AgentStream) -> None:
        # Acks queued while no stream was up go out first.
        self._wake.set()
        self._reported = asyncio.Event()
        if self._unwritable:
            self._reported.set()
        tasks = {
            asyncio.create_task(self._send_loop(stream), name="stream-send"),
            asyncio.create_task(self._recv_loop(stream), name="stream-recv"),
            asyncio.create_task(self._end_when_writable(), name="stream-rewritable"),
        }
        if self._heartbeat_interval > 0:
            tasks.add(asyncio.create_task(self._tick(), name="stream-heartbeat"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            exc = task.exception()
            if exc is not None:
                raise exc

    async def _tick(self) -> None:
        """Ask for a heartbeat every interval; end the stream if this process was stalled."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            now = loop.time()
            late = now - self._last_tick - self._heartbeat_interval
            if self._liveness_timeout > 0 and late > self._liveness_timeout / 2:
                # Set before _last_tick moves: stalled() never reports a woken loop as fine.
                self._stall = (
                    f"event loop stalled for {late:.1f} s: the node may have been fenced out"
                )
                log.warning("agent %s: %s; saying hello again", self._node, self._stall)
                raise StreamProtocolError(self._stall)
            self._last_tick = now
            self._heartbeat_due = True
            self._wake.set()

    async def _end_when_writable(self) -> None:
        """End the stream on which the node was reported unwritable, once it is writable."""
        await self._reported.wait()
        await self._writable.wait()
        log.info("agent %s: the state file can be written again; saying hello again", self._node)
        raise StreamProtocolError("the state file can be written again: saying hello again")

    async def _send_loop(self, stream: _AgentStream) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._unwritable_due:
                self._unwritable_due = False
                report = StateUnwritable(reason=self._unwritable)
                await stream.send_message(AgentMessage(state_unwritable=report))
            if self._heartbeat_due:
                self._heartbeat_due = False
                self._heartbeat_seq += 1
                # Host memory free rides along (a small read of /proc/meminfo): the
                # dashboard's nodes view shows the latest the orchestrator heard.
                beat = Heartbeat(
                    seq=self._heartbeat_seq, host_available_bytes=self._host_available()
                )
                await stream.send_message(AgentMessage(heartbeat=beat))
            if self._workers_dirty:
                self._workers_dirty = False
                changed = WorkersChanged(workers=self._workers(), seq=self._workers_version)
                message = AgentMessage(workers=changed)
                await stream.send_message(message)
            while self._acks:
                await stream.send_message(AgentMessage(ack=self._acks[0]))
                # Dropped from the outbox only once handed to the transport.
                self._acks.popleft()

    async def _recv_loop(self, stream: _AgentStream) -> None:
        while True:
            message = await stream.recv_message()
            if message is None:
                raise StreamClosed("the orchestrator ended the stream")
            if message.directive is not None:
                self._on_directive(message.directive)
            elif message.workers_recorded is not None:
                self._workers_recorded_up_to(message.workers_recorded.seq)
            elif message.welcome is not None:
                self.replica_id = message.welcome.replica_id
                self._records_workers = message.welcome.records_workers
                self._notify_recorded()
                if self._on_welcome is not None:
                    self._on_welcome(message.welcome)
                log.info("orchestrator replica is now %s", self.replica_id)
            else:
                log.warning("ignoring an orchestrator message with no known body")
