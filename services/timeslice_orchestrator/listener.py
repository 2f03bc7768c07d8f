"""The replica's TLS listener: it accepts plain TCP itself, bounds what a peer costs until its
handshake is done (the caps on pending handshakes, in all and per address, and the hello and
handshake deadlines), and starts each handshake with the current context; see
:mod:`~timeslice_orchestrator.tls` for the whole story. Established connections are
:class:`~timeslice_orchestrator.connections.OpenConnections`'.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import struct
from typing import Any

from grpclib.server import Server

from timeslice.tasks import Supervisor
from timeslice.tls import ReloadingContext, TlsFiles, server_context
from timeslice_orchestrator.connections import OpenConnections
from timeslice_orchestrator.identity import IdentityRules
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.tls import (
    LOG_EVERY,
    SHUTDOWN_SECONDS,
    Conn,
    ConnectionLimits,
    HelloTimeout,
    Phase,
    Refusals,
    start_handshake,
)

log = logging.getLogger(__name__)

# Connections accepted per wake-up of the listening socket (asyncio's create_server: 100).
ACCEPT_BATCH = 64
# Kernel backlog of the listening socket (capped by net.core.somaxconn): where connections
# wait while accepting is paused.
BACKLOG = 1024
# Out of file descriptors with nothing to shed: accepting resumes after this many seconds.
ACCEPT_RETRY_SECONDS = 0.5
# With --max-pending-handshakes reached and no silent connection to drop, one whose peer has
# sent nothing in its handshake for this long may be dropped for a new one (a client answers
# within a round trip; one waiting for this replica's CPU is never dropped).
STALLED_SECONDS = 1.0
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, no TIME_WAIT here


class _Serving(asyncio.AbstractServer):
    """What grpclib's ``Server.close()`` and ``wait_closed()`` work on."""

    def __init__(self, listener: TlsListener) -> None:
        self._listener = listener
        self._closed = asyncio.Event()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()

    async def wait_closed(self) -> None:
        await self._listener.wait_closed()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def is_serving(self) -> bool:
        return bool(self._listener.sockets)

    async def start_serving(self) -> None:
        """Serving starts with the listener's start(): nothing to do."""

    async def serve_forever(self) -> None:
        """The listener serves from its start(); this waits until it is closed."""
        await self._closed.wait()
        await self.wait_closed()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._listener.sockets)


class TlsListener:
    """Serves a grpclib :class:`Server` over mutual TLS with reloading certificates, with the
    cost of each peer bounded by :class:`ConnectionLimits`."""

    def __init__(
        self,
        files: TlsFiles,
        metrics: Metrics,
        tasks: Supervisor,
        limits: ConnectionLimits | None = None,
        rules: IdentityRules | None = None,
    ) -> None:
        self.context = ReloadingContext(files, server_context, name="orchestrator TLS")
        self.limits = limits if limits is not None else ConnectionLimits()
        self._metrics = metrics
        self._tasks = tasks
        self._refusals = Refusals(metrics)
        self._connections = OpenConnections(
            self.limits, rules if rules is not None else IdentityRules(), metrics, self._refusals
        )
        self.sockets: list[socket.socket] = []
        self._server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._by_source: dict[str, int] = {}
        # Insertion-ordered: the first is the oldest connection that has sent nothing.
        self._silent: dict[Conn, None] = {}
        self._awaiting_context: list[Conn] = []
        # In their handshake, the one whose peer sent bytes least recently first.
        self._handshaking: dict[Conn, None] = {}
        self._starter: asyncio.Task[None] | None = None
        self._paused = True  # until start()
        self._retry: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._no_waiter: asyncio.Future[None]  # set in start()
        metrics.pending_handshakes.set_function(lambda: self._pending)

    async def start(self, server: Server, host: str, port: int) -> None:
        """Load the certificates (refusing bad files now) and listen on ``host:port``."""
        await asyncio.to_thread(self.context.load)
        loop = self._loop = asyncio.get_running_loop()
        # The TLS protocol wants a future to report its handshake to; ours is reported to
        # the listener directly, so every connection shares one that takes nothing.
        self._no_waiter = loop.create_future()
        self._no_waiter.cancel()
        self._server = server
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            self._close_sockets()
            raise
        self._resume_accepting()
        if self.limits.idle_timeout > 0:
            self._sweeper = self._tasks.spawn(
                self._connections.sweep_idle(), "tls-idle-connections", kind="tls-idle"
            )
        # grpclib's close() and wait_closed() work on these; a listener made by its start()
        # would have set them the same way.
        server._server = _Serving(self)
        server._server_closed_fut = loop.create_future()

    def close(self) -> None:
        """Stop accepting and drop every connection whose handshake is not done (open
        connections are grpclib's to close, as with any asyncio server)."""
        if self._closed:
            return
        self._closed = True
        self._pause_accepting()
        self._close_sockets()
        if self._retry is not None:
            self._retry.cancel()
        for conn in [*self._silent, *self._awaiting_context]:
            self._drop(conn)
        for task in (self._starter, self._sweeper):
            if task is not None:
                task.cancel()

    async def wait_closed(self) -> None:
        tasks = {t for t in (self._starter, self._sweeper) if t is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_SECONDS)

    def refused(self, peer: str, exc: BaseException) -> None:
        """Count a failed handshake; log it unless this peer's same failure was just logged."""
        self._refusals.refused(peer, exc)

    # -- accepting --------------------------------------------------------------------------

    def _resume_accepting(self) -> None:
        assert self._loop is not None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._closed or not self._paused:
            return
        self._paused = False
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._on_acceptable, sock)

    def _pause_accepting(self, retry_at: float | None = None) -> None:
        """Stop accepting: until a pending slot frees, or ``retry_at`` (loop time)."""
        if self._loop is None or self._paused:
            return
        self._paused = True
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
        if retry_at is not None:
            self._retry = self._loop.call_at(retry_at, self._resume_accepting)

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []

    def _on_acceptable(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            if self._pending >= self.limits.max_pending and not self._evict():
                # Every pending connection is in its handshake, moving: the kernel's backlog
                # holds the next ones until one ends, or until the one that moved least
                # long ago may be dropped as stalled.
                self._metrics.accept_pauses.inc()
                self._pause_accepting(self._stall_retry())
                return
            try:
                sock, address = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._evict():
                        continue
                    self._out_of_resources(exc)
                    return
                log.warning("accepting a connection failed: %s", exc)
                return
            self._accepted(sock, address)

    def _out_of_resources(self, exc: OSError) -> None:
        assert self._loop is not None
        self._refusals.note(
            "*", "accept", "accepting connections failed (%s): trying again in %g s",
            exc, ACCEPT_RETRY_SECONDS,
        )  # fmt: skip
        self._metrics.accept_pauses.inc()
        self._pause_accepting(self._now() + ACCEPT_RETRY_SECONDS)

    def _stall_retry(self) -> float:
        """When the first pending handshake may count as stalled (see :meth:`_evict`)."""
        now = self._now()
        if not self._handshaking:
            return now + ACCEPT_RETRY_SECONDS
        oldest = next(iter(self._handshaking))
        return max(oldest.progress_at + STALLED_SECONDS, now + 0.05)

    def _accepted(self, sock: socket.socket, address: Any) -> None:
        assert self._loop is not None
        sock.setblocking(False)
        peer = str(address[0]) if isinstance(address, tuple) else str(address)
        source = _source_of(peer)
        waiting = self._by_source.get(source, 0)
        if waiting >= self.limits.max_pending_per_address:
            _reset(sock)
            self._refusals.shed(
                peer,
                "address_cap",
                "connection from %s closed at once: %d connections from that address are "
                "still in their TLS handshake (--max-pending-per-address); logged once per "
                "%g s",
                peer,
                waiting,
                LOG_EVERY,
            )
            return
        conn = Conn(sock, peer, source, self._loop.time())
        self._by_source[source] = waiting + 1
        self._pending += 1
        self._silent[conn] = None
        conn.timer = self._loop.call_later(self.limits.hello_timeout, self._expired, conn)
        self._loop.add_reader(sock.fileno(), self._on_first_bytes, conn)

    def _evict(self) -> bool:
        """Make room for a new connection: drop the oldest that has sent nothing, else the
        one whose peer has sent nothing in its handshake for longest, if that is at least
        :data:`STALLED_SECONDS`. False: none may go (every pending handshake is moving)."""
        while self._silent:
            conn = next(iter(self._silent))
            # Its hello may be waiting, unread (the listening socket's turn came first):
            # then it is not silent. Read so, it moves on (or, closed, frees its slot).
            self._on_first_bytes(conn)
            if conn.phase is Phase.CLOSED:
                return True
            if conn.phase is Phase.SILENT:
                self._evicted(conn, "had sent nothing")
                return True
        if not self._handshaking:
            return False
        conn = next(iter(self._handshaking))
        if self._now() - conn.progress_at < STALLED_SECONDS or _has_unread(conn.sock):
            # Moving, or waiting for this replica (bytes unread): it is the replica that is
            # behind, and accepting more would only make it more so.
            return False
        self._evicted(conn, "had stalled in its handshake")
        return True

    def _evicted(self, conn: Conn, why: str) -> None:
        silent = conn.phase is Phase.SILENT
        since = self._now() - (conn.accepted_at if silent else conn.progress_at)
        self._drop(conn)
        self._refusals.shed(
            conn.peer,
            "evicted",
            "connection from %s dropped: %d connections were waiting for their TLS "
            "handshake (--max-pending-handshakes) and it %s for %.1f s; logged once per %g s",
            conn.peer,
            self.limits.max_pending,
            why,
            since,
            LOG_EVERY,
        )

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    # -- before the handshake ---------------------------------------------------------------

    def _on_first_bytes(self, conn: Conn) -> None:
        assert self._loop is not None
        try:
            head = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return  # spurious wake-up: still waiting
        except OSError as exc:
            self.refused(conn.peer, exc)
            self._drop(conn)
            return
        if not head:
            self.refused(conn.peer, ConnectionResetError("closed by peer before its TLS hello"))
            self._drop(conn)
            return
        self._loop.remove_reader(conn.sock.fileno())
        del self._silent[conn]
        conn.phase = Phase.CONTEXT
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self._loop.call_at(
            conn.accepted_at + self.limits.handshake_timeout, self._expired, conn
        )
        self._awaiting_context.append(conn)
        if self._starter is None or self._starter.done():
            self._starter = self._tasks.spawn(
                self._start_handshakes(), "tls-handshakes", kind="tls-handshake"
            )

    async def _start_handshakes(self) -> None:
        """Start the handshakes of the connections whose hello came, with the current context
        (one task for all of them: a rebuild after a rotation is awaited once)."""
        loop = asyncio.get_running_loop()
        while self._awaiting_context:
            try:
                context = await self.context.current()
            except Exception as exc:  # no context at all (never after start's load)
                batch, self._awaiting_context = self._awaiting_context, []
                for conn in batch:
                    if conn.phase is Phase.CONTEXT:
                        self.refused(conn.peer, exc)
                        self._drop(conn)
                raise
            batch, self._awaiting_context = self._awaiting_context, []
            started: list[Conn] = []
            starts = []
            for conn in batch:
                if conn.phase is not Phase.CONTEXT:
                    continue  # dropped meanwhile (its deadline, the listener closed)
                conn.phase = Phase.HANDSHAKE
                conn.progress_at = loop.time()
                self._handshaking[conn] = None
                started.append(conn)
                starts.append(
                    start_handshake(
                        self, conn, context, self._no_waiter, self.limits.handshake_timeout
                    )
                )
            outcomes = await asyncio.gather(*starts, return_exceptions=True)
            for conn, outcome in zip(started, outcomes, strict=True):
                if isinstance(outcome, BaseException) and conn.transport is None:
                    # No transport was made: the socket is still ours to close.
                    if conn.phase is Phase.HANDSHAKE:
                        self.refused(conn.peer, outcome)
                        self._release(conn)
                    conn.sock.close()

    def _expired(self, conn: Conn) -> None:
        if conn.phase is Phase.SILENT:
            self.refused(
                conn.peer, HelloTimeout(f"nothing sent in {self.limits.hello_timeout:g} s")
            )
        else:
            self.refused(
                conn.peer,
                TimeoutError(f"handshake not done in {self.limits.handshake_timeout:g} s"),
            )
        self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        """Close a connection whose handshake is not done (counted by the caller)."""
        phase = conn.phase
        if phase in (Phase.OPEN, Phase.CLOSED):
            return
        self._release(conn)
        if phase is Phase.SILENT:
            assert self._loop is not None
            self._loop.remove_reader(conn.sock.fileno())
            _reset(conn.sock)
        elif phase is Phase.CONTEXT:
            _reset(conn.sock)
        elif conn.transport is not None:  # HANDSHAKE
            conn.transport.abort()
        # else: its transport is being made; the TLS protocol (tls.py) aborts it when made

    def _release(self, conn: Conn) -> None:
        """Its handshake is over (done, refused or dropped): free its pending slot."""
        if conn.phase is Phase.SILENT:
            self._silent.pop(conn, None)
        elif conn.phase is Phase.HANDSHAKE:
            self._handshaking.pop(conn, None)
        conn.phase = Phase.CLOSED
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        self._pending -= 1
        left = self._by_source[conn.source] - 1
        if left:
            self._by_source[conn.source] = left
        else:
            del self._by_source[conn.source]
        if self._paused and self._pending < self.limits.max_pending:
            self._resume_accepting()

    # -- the handshake's end (HandshakeEvents) ----------------------------------------------

    def on_progress(self, conn: Conn) -> None:
        """Its peer sent handshake bytes: it goes to the end of the eviction order."""
        conn.progress_at = self._now()
        del self._handshaking[conn]
        self._handshaking[conn] = None

    def on_handshake_done(self, conn: Conn, transport: asyncio.Transport) -> None:
        self._release(conn)
        assert self._server is not None
        self._connections.admit(conn, transport, self._server._protocol_factory)

    def on_tls_lost(self, conn: Conn, exc: BaseException | None) -> None:
        if conn.phase is Phase.HANDSHAKE:
            self.refused(conn.peer, exc or ConnectionResetError("closed by peer"))
            self._release(conn)
            return
        self._connections.lost(conn)


def _source_of(peer: str) -> str:
    """The source a per-address cap counts: the address, or its /64 for IPv6 (one host
    usually holds a whole /64); an IPv4-mapped address is its IPv4 one."""
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return peer


def _has_unread(sock: socket.socket) -> bool:
    """Whether bytes (or an end) wait in ``sock`` for this process to read."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # an error waiting counts: reading it ends the connection
    return True


def _reset(sock: socket.socket) -> None:
    """Close with a reset: a connection shed before TLS leaves no TIME_WAIT behind."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    except OSError:
        pass
    sock.close()
