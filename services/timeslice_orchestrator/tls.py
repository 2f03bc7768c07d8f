"""The replica's TLS listener: mutual TLS for the gRPC port, certificates that follow rotation,
refused handshakes logged once, and a bounded cost for every peer that has not (yet) proven
who it is.

grpclib would take one :class:`ssl.SSLContext` for the life of the server, and asyncio drops
a failed handshake silently (it logs only in debug mode). So the listener accepts plain TCP
itself and runs each connection's handshake: every new connection gets the *current* context
(rebuilt when the files change, see :class:`timeslice.tls.ReloadingContext`; connections
already open keep theirs, so running holds and agent streams survive a rotation), and a
refused handshake is seen here: logged once per peer address and reason within
:data:`LOG_EVERY` (a client retrying every 100 ms does not fill the log) and always counted in
``timeslice_tls_refusals``.

What one peer may cost before its certificate is verified is bounded (:class:`ConnectionLimits`,
docs/security.md). A security probe held 11,000 TCP connections that never started TLS and
took a replica from 128 MB to 1.33 GB in 25 s: ``loop.start_tls`` gives every connection a
256 KiB read buffer and a task at once. Here:

- a connection costs a socket and a timer until its first bytes (the ClientHello) arrive; only
  then are its TLS state and its read buffer (:data:`READ_BUFFER`, not 256 KiB) made;
- a connection has ``hello_timeout`` seconds for its first bytes and ``handshake_timeout``
  from accept for the whole handshake;
- at most ``max_pending`` connections are between accept and a finished handshake, at most
  ``max_pending_per_address`` of them from one address (an IPv6 /64): past that a source's new
  connection is closed at once; past the global cap the oldest connection that has sent
  nothing is dropped for the new one (a client sends its hello within a round trip of its
  connect, so that one is the likeliest to be an attack), else the one whose peer has sent
  nothing in its handshake for :data:`STALLED_SECONDS`; when every pending handshake is
  moving, accepting pauses (back-pressure: the kernel's backlog holds the rest);
- after the handshake, one identity (a job, a node, an operator certificate) keeps at most
  ``max_per_identity`` connections; the next one is sent an HTTP/2 GOAWAY
  (ENHANCE_YOUR_CALM) and closed;
- a connection with no call open and no traffic for ``idle_timeout`` seconds is sent a GOAWAY
  and closed (a client connects again at its next call); an open stream (an agent's, a
  YieldStream, a WatchGroup) keeps its connection however quiet it is.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import ipaddress
import logging
import math
import socket
import ssl
import struct
import time
from asyncio.sslproto import SSLProtocol
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from timeslice.tasks import Supervisor
from timeslice.tls import ReloadingContext, TlsFiles, server_context
from timeslice_orchestrator.identity import Identity, IdentityRules, identity_of
from timeslice_orchestrator.metrics import Metrics

log = logging.getLogger(__name__)

# A refusal for the same peer and reason is logged at most this often (seconds).
LOG_EVERY = 300.0
# At most this many refusal lines per LOG_EVERY over all peers (a flood from many addresses
# is counted in the metrics, not logged line by line).
LOG_BURST = 100
# Read buffer of a TLS connection (asyncio's: 256 KiB each). One TLS record is 16 KiB.
READ_BUFFER = 32 * 1024
# How long closing a TLS connection waits for the peer's close_notify (asyncio: 30 s).
SHUTDOWN_SECONDS = 5.0
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
# Sweeps for idle connections happen at most this far apart (and at a quarter of the timeout).
IDLE_SWEEP_MAX = 15.0
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, no TIME_WAIT here


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one peer may hold on the gRPC port (flags ``--max-pending-handshakes`` ...)."""

    max_pending: int = 1024
    """Connections between accept and a finished TLS handshake, over every peer."""
    max_pending_per_address: int = 64
    """Of those, from one source address (IPv6: one /64)."""
    hello_timeout: float = 5.0
    """Seconds a new connection has to send its first bytes (the TLS ClientHello)."""
    handshake_timeout: float = 10.0
    """Seconds from accept to a finished TLS handshake."""
    max_per_identity: int = 256
    """Established connections of one client identity (one job, node or operator)."""
    idle_timeout: float = 300.0
    """Seconds a connection with no open call and no traffic stays open; 0: forever."""

    def __post_init__(self) -> None:
        for name in ("max_pending", "max_pending_per_address", "max_per_identity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0 < self.handshake_timeout <= 300:
            raise ValueError("handshake_timeout must be between 0 and 300 seconds")
        if not 0 < self.hello_timeout <= self.handshake_timeout:
            raise ValueError("hello_timeout must be above 0 and at most handshake_timeout")
        if self.idle_timeout < 0:
            raise ValueError("idle_timeout must not be negative")


class HelloTimeout(TimeoutError):
    """A connection sent nothing within the hello deadline."""


class _Phase(enum.Enum):
    SILENT = "silent"  # accepted, nothing received yet: a socket and a timer
    CONTEXT = "context"  # its hello is waiting in the socket; the TLS context is being read
    HANDSHAKE = "handshake"  # TLS state made, handshake running
    OPEN = "open"  # handed to grpclib
    CLOSED = "closed"  # refused, dropped or ended


class _Conn:
    """One accepted connection, through its phases (the listener's bookkeeping)."""

    __slots__ = (
        "accepted_at", "busy_at", "h2", "identity", "opened_at", "peer", "phase",
        "progress_at", "sock", "source", "timer", "transport",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str, source: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.source = source
        self.accepted_at = now
        self.progress_at = now  # loop time of the peer's last bytes during the handshake
        self.phase = _Phase.SILENT
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.h2: H2Protocol | None = None
        self.identity: str | None = None
        self.opened_at = 0.0  # time.monotonic(), as grpclib's own activity stamps
        self.busy_at = 0.0


class _TlsProtocol(SSLProtocol):
    """asyncio's TLS protocol with a small read buffer, reporting its end to the listener."""

    max_size = READ_BUFFER

    def __init__(self, listener: TlsListener, conn: _Conn, context: ssl.SSLContext) -> None:
        super().__init__(
            asyncio.get_running_loop(),
            _HandOver(listener, conn),
            context,
            listener._no_waiter,
            server_side=True,
            # Ours (the listener's deadline) runs first; this one only backs it up.
            ssl_handshake_timeout=math.ceil(listener.limits.handshake_timeout) + 1,
            ssl_shutdown_timeout=SHUTDOWN_SECONDS,
        )
        self._listener = listener
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn.transport = cast(asyncio.Transport, transport)
        if self._conn.phase is _Phase.CLOSED:  # its deadline passed while it was set up
            self._conn.transport.abort()
            return
        super().connection_made(transport)

    def buffer_updated(self, nbytes: int) -> None:
        if self._conn.phase is _Phase.HANDSHAKE:
            self._listener._progress(self._conn)
        super().buffer_updated(nbytes)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._listener._tls_lost(self._conn, exc)


class _HandOver(asyncio.Protocol):
    """The application side of a handshake: when it is done, grpclib takes the connection
    (in the same call, so HTTP/2 bytes that came with the last handshake flight reach it)."""

    __slots__ = ("_conn", "_listener")

    def __init__(self, listener: TlsListener, conn: _Conn) -> None:
        self._listener = listener
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        try:
            self._listener._handshake_done(self._conn, cast(asyncio.Transport, transport))
        except Exception:  # never fatal to the server: this connection only
            log.exception("handing a TLS connection from %s to gRPC failed", self._conn.peer)
            cast(asyncio.Transport, transport).abort()


class _Serving(asyncio.AbstractServer):
    """What grpclib's ``Server.close()`` and ``wait_closed()`` work on."""

    def __init__(self, listener: TlsListener) -> None:
        self._listener = listener

    def close(self) -> None:
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
        raise NotImplementedError("the replica runs its listener itself")

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._listener.sockets)


@dataclass(slots=True)
class _LogBudget:
    """Refusal lines: once per (peer, reason) per LOG_EVERY, LOG_BURST in all per LOG_EVERY."""

    logged: dict[tuple[str, str], float] = field(default_factory=dict)
    window_start: float = -math.inf
    in_window: int = 0

    def allow(self, now: float, key: tuple[str, str]) -> bool | None:
        """True: log it; False: not now; None: the budget just ran out (say so once)."""
        last = self.logged.get(key)
        if last is not None and now - last < LOG_EVERY:
            return False
        if now - self.window_start >= LOG_EVERY:
            self.window_start, self.in_window = now, 0
        self.in_window += 1
        if self.in_window > LOG_BURST:
            return None if self.in_window == LOG_BURST + 1 else False
        if len(self.logged) > 10_000:  # bounded: forget the oldest entries wholesale
            self.logged.clear()
        self.logged[key] = now
        return True


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
        self._rules = rules if rules is not None else IdentityRules()
        self._metrics = metrics
        self._tasks = tasks
        self._log = _LogBudget()
        self.sockets: list[socket.socket] = []
        self._server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._by_source: dict[str, int] = {}
        # Insertion-ordered: the first is the oldest connection that has sent nothing.
        self._silent: dict[_Conn, None] = {}
        self._awaiting_context: list[_Conn] = []
        # In their handshake, the one whose peer sent bytes least recently first.
        self._handshaking: dict[_Conn, None] = {}
        self._starter: asyncio.Task[None] | None = None
        self._open: dict[_Conn, None] = {}
        self._by_identity: dict[str, int] = {}
        self._paused = True  # until start()
        self._retry: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._no_waiter: asyncio.Future[None]  # set in start()
        metrics.pending_handshakes.set_function(lambda: self._pending)
        metrics.tls_connections.set_function(lambda: len(self._open))

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
                self._sweep_idle(), "tls-idle-connections", kind="tls-idle"
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

    # -- refusals ---------------------------------------------------------------------------

    def refused(self, peer: str, exc: BaseException) -> None:
        """Count a failed handshake; log it unless this peer's same failure was just logged."""
        reason = _reason(exc)
        self._metrics.tls_refusals.labels(reason=reason).inc()
        self._note(
            peer,
            reason,
            "TLS handshake from %s refused: %s (%s); the same refusal from this address is "
            "counted, not logged, for %g s",
            peer,
            reason,
            exc,
            LOG_EVERY,
        )

    def _shed(self, peer: str, reason: str, message: str, *args: object) -> None:
        """Count a connection closed for a limit (``timeslice_connections_closed``)."""
        self._metrics.connections_closed.labels(reason=reason).inc()
        self._note(peer, reason, message, *args)

    def _note(self, peer: str, reason: str, message: str, *args: object) -> None:
        verdict = self._log.allow(time.monotonic(), (peer, reason))
        if verdict:
            log.warning(message, *args)
        elif verdict is None:
            log.warning(
                "more than %d refused or dropped connections in %g s: the rest are counted "
                "(timeslice_tls_refusals, timeslice_connections_closed), not logged",
                LOG_BURST,
                LOG_EVERY,
            )

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
        self._note(
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
            self._shed(
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
        conn = _Conn(sock, peer, source, self._loop.time())
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
            if conn.phase is _Phase.CLOSED:
                return True
            if conn.phase is _Phase.SILENT:
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

    def _evicted(self, conn: _Conn, why: str) -> None:
        silent = conn.phase is _Phase.SILENT
        since = self._now() - (conn.accepted_at if silent else conn.progress_at)
        self._drop(conn)
        self._shed(
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

    def _on_first_bytes(self, conn: _Conn) -> None:
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
        conn.phase = _Phase.CONTEXT
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
                    if conn.phase is _Phase.CONTEXT:
                        self.refused(conn.peer, exc)
                        self._drop(conn)
                raise
            batch, self._awaiting_context = self._awaiting_context, []
            started: list[_Conn] = []
            starts = []
            for conn in batch:
                if conn.phase is not _Phase.CONTEXT:
                    continue  # dropped meanwhile (its deadline, the listener closed)
                conn.phase = _Phase.HANDSHAKE
                conn.progress_at = loop.time()
                self._handshaking[conn] = None
                started.append(conn)
                protocol = _TlsProtocol(self, conn, context)
                starts.append(loop.connect_accepted_socket(_factory(protocol), conn.sock))
            outcomes = await asyncio.gather(*starts, return_exceptions=True)
            for conn, outcome in zip(started, outcomes, strict=True):
                if isinstance(outcome, BaseException) and conn.transport is None:
                    # No transport was made: the socket is still ours to close.
                    if conn.phase is _Phase.HANDSHAKE:
                        self.refused(conn.peer, outcome)
                        self._release(conn)
                    conn.sock.close()

    def _expired(self, conn: _Conn) -> None:
        if conn.phase is _Phase.SILENT:
            self.refused(
                conn.peer, HelloTimeout(f"nothing sent in {self.limits.hello_timeout:g} s")
            )
        else:
            self.refused(
                conn.peer,
                TimeoutError(f"handshake not done in {self.limits.handshake_timeout:g} s"),
            )
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """Close a connection whose handshake is not done (counted by the caller)."""
        phase = conn.phase
        if phase in (_Phase.OPEN, _Phase.CLOSED):
            return
        self._release(conn)
        if phase is _Phase.SILENT:
            assert self._loop is not None
            self._loop.remove_reader(conn.sock.fileno())
            _reset(conn.sock)
        elif phase is _Phase.CONTEXT:
            _reset(conn.sock)
        elif conn.transport is not None:  # HANDSHAKE
            conn.transport.abort()
        # else: its transport is being made; _TlsProtocol.connection_made aborts it

    def _release(self, conn: _Conn) -> None:
        """Its handshake is over (done, refused or dropped): free its pending slot."""
        if conn.phase is _Phase.SILENT:
            self._silent.pop(conn, None)
        elif conn.phase is _Phase.HANDSHAKE:
            self._handshaking.pop(conn, None)
        conn.phase = _Phase.CLOSED
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

    def _progress(self, conn: _Conn) -> None:
        """Its peer sent handshake bytes: it goes to the end of the eviction order."""
        conn.progress_at = self._now()
        del self._handshaking[conn]
        self._handshaking[conn] = None

    # -- the handshake's end ----------------------------------------------------------------

    def _handshake_done(self, conn: _Conn, transport: asyncio.Transport) -> None:
        self._release(conn)
        who = identity_of(transport.get_extra_info("peercert"), self._rules)
        key = _identity_key(who)
        if key is not None:
            held = self._by_identity.get(key, 0)
            if held >= self.limits.max_per_identity:
                self._refuse_identity(conn, who, held, transport)
                return
            self._by_identity[key] = held + 1
            conn.identity = key
        assert self._server is not None
        protocol = self._server._protocol_factory()
        conn.phase = _Phase.OPEN
        conn.h2 = protocol
        conn.opened_at = time.monotonic()
        self._open[conn] = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def _refuse_identity(
        self, conn: _Conn, who: Identity | None, held: int, transport: asyncio.Transport
    ) -> None:
        """Over its identity's cap: a GOAWAY that says why, then close."""
        self._shed(
            str(who),
            "identity_cap",
            "connection from %s (%s) closed: that identity already has %d connections to "
            "this replica (--max-connections-per-identity); logged once per %g s",
            conn.peer,
            who,
            held,
            LOG_EVERY,
        )
        goaway = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        goaway.initiate_connection()
        goaway.close_connection(
            error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
            additional_data=(
                f"too many connections: this identity already has {held} "
                "(--max-connections-per-identity)"
            ).encode(),
        )
        transport.write(goaway.data_to_send())
        transport.close()

    def _tls_lost(self, conn: _Conn, exc: BaseException | None) -> None:
        if conn.phase is _Phase.HANDSHAKE:
            self.refused(conn.peer, exc or ConnectionResetError("closed by peer"))
            self._release(conn)
            return
        if conn in self._open:
            del self._open[conn]
            key = conn.identity
            if key is not None:
                left = self._by_identity[key] - 1
                if left:
                    self._by_identity[key] = left
                else:
                    del self._by_identity[key]
        conn.phase = _Phase.CLOSED
        conn.h2 = None

    # -- idle connections -------------------------------------------------------------------

    async def _sweep_idle(self) -> None:
        timeout = self.limits.idle_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, IDLE_SWEEP_MAX))
            try:
                self._close_idle(timeout)
            except Exception:  # a bug here must not end the sweeps: log, sweep again
                log.exception("closing idle connections failed")

    def _close_idle(self, timeout: float) -> None:
        now = time.monotonic()
        closed = 0
        for conn in list(self._open):
            protocol = conn.h2
            if protocol is None:
                continue
            connection = protocol.connection
            if connection.is_closing():
                continue
            if protocol.processor.streams:
                # A call is open: not idle. Seen here, so its end (which grpclib does not
                # stamp) starts the idle time no earlier than this sweep.
                conn.busy_at = now
                continue
            last = max(
                conn.opened_at,
                conn.busy_at,
                connection.last_stream_created or 0.0,
                connection.last_data_received or 0.0,
                connection.last_data_sent or 0.0,
            )
            if now - last < timeout:
                continue
            # GOAWAY (no error, every stream so far processed), then close: the client
            # connects anew at its next call.
            try:
                connection._connection.close_connection()
                connection.flush()
            except Exception:  # the h2 state may already be closed: closing is what matters
                log.debug("GOAWAY to an idle connection failed", exc_info=True)
            protocol.processor.close("idle connection closed by the server")
            self._metrics.connections_closed.labels(reason="idle").inc()
            closed += 1
        if closed:
            log.info("closed %d connections idle for %g s or more", closed, timeout)


def _factory(protocol: _TlsProtocol) -> Callable[[], _TlsProtocol]:
    return lambda: protocol


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return exc.verify_message or "certificate verify failed"
    if isinstance(exc, ssl.SSLError):
        return (exc.reason or type(exc).__name__).lower()
    if isinstance(exc, HelloTimeout):
        return "hello timeout"
    if isinstance(exc, TimeoutError):
        return "handshake timeout"
    return type(exc).__name__


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


def _identity_key(who: Identity | None) -> str | None:
    """What the per-identity cap counts: the job, the node, an operator's or a role-less
    certificate's subject (a job's several certificates are one job)."""
    if who is None:
        return None
    if who.reserved is not None:
        return f"reserved:{who.subject}"
    if who.job is not None:
        return f"job:{who.job}"
    if who.node is not None:
        return f"node:{who.node}"
    if who.operator:
        return f"operator:{who.subject}"
    return f"subject:{who.subject}"


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
