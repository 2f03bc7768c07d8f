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

The listener is cut in three: this module holds the limits, the TLS handshake protocol and
the refusal logging; :mod:`~timeslice_orchestrator.listener` the accept loop and the caps on
pending handshakes (:class:`~timeslice_orchestrator.listener.TlsListener`);
:mod:`~timeslice_orchestrator.connections` the established connections (the per-identity cap
and the idle sweep).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import socket
import ssl
import time
from asyncio.sslproto import SSLProtocol
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol, cast

from grpclib.protocol import H2Protocol

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


class Phase(enum.Enum):
    SILENT = "silent"  # accepted, nothing received yet: a socket and a timer
    CONTEXT = "context"  # its hello is waiting in the socket; the TLS context is being read
    HANDSHAKE = "handshake"  # TLS state made, handshake running
    OPEN = "open"  # handed to grpclib
    CLOSED = "closed"  # refused, dropped or ended


class Conn:
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
        self.phase = Phase.SILENT
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.h2: H2Protocol | None = None
        self.identity: str | None = None
        self.opened_at = 0.0  # time.monotonic(), as grpclib's own activity stamps
        self.busy_at = 0.0


class HandshakeEvents(Protocol):
    """What a connection's TLS protocol tells the listener."""

    def on_progress(self, conn: Conn) -> None:
        """Its peer sent handshake bytes."""

    def on_handshake_done(self, conn: Conn, transport: asyncio.Transport) -> None:
        """The handshake succeeded: the connection is the listener's to hand on."""

    def on_tls_lost(self, conn: Conn, exc: BaseException | None) -> None:
        """The TLS connection ended (in its handshake or after)."""


def start_handshake(
    events: HandshakeEvents,
    conn: Conn,
    context: ssl.SSLContext,
    no_waiter: asyncio.Future[None],
    handshake_timeout: float,
) -> Awaitable[tuple[asyncio.Transport, asyncio.BaseProtocol]]:
    """Start ``conn``'s TLS handshake with ``context`` (its hello is waiting in its socket)."""
    protocol = _TlsProtocol(events, conn, context, no_waiter, handshake_timeout)
    return asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, conn.sock)


class _TlsProtocol(SSLProtocol):
    """asyncio's TLS protocol with a small read buffer, reporting its end to the listener."""

    max_size = READ_BUFFER

    def __init__(
        self,
        events: HandshakeEvents,
        conn: Conn,
        context: ssl.SSLContext,
        no_waiter: asyncio.Future[None],
        handshake_timeout: float,
    ) -> None:
        super().__init__(
            asyncio.get_running_loop(),
            _HandOver(events, conn),
            context,
            no_waiter,
            server_side=True,
            # Ours (the listener's deadline) runs first; this one only backs it up.
            ssl_handshake_timeout=math.ceil(handshake_timeout) + 1,
            ssl_shutdown_timeout=SHUTDOWN_SECONDS,
        )
        self._events = events
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn.transport = cast(asyncio.Transport, transport)
        if self._conn.phase is Phase.CLOSED:  # its deadline passed while it was set up
            self._conn.transport.abort()
            return
        super().connection_made(transport)

    def buffer_updated(self, nbytes: int) -> None:
        if self._conn.phase is Phase.HANDSHAKE:
            self._events.on_progress(self._conn)
        super().buffer_updated(nbytes)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._events.on_tls_lost(self._conn, exc)


class _HandOver(asyncio.Protocol):
    """The application side of a handshake: when it is done, grpclib takes the connection
    (in the same call, so HTTP/2 bytes that came with the last handshake flight reach it)."""

    __slots__ = ("_conn", "_events")

    def __init__(self, events: HandshakeEvents, conn: Conn) -> None:
        self._events = events
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        try:
            self._events.on_handshake_done(self._conn, cast(asyncio.Transport, transport))
        except Exception:  # never fatal to the server: this connection only
            log.exception("handing a TLS connection from %s to gRPC failed", self._conn.peer)
            cast(asyncio.Transport, transport).abort()


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


class Refusals:
    """Counts refused handshakes and connections closed for a limit, and logs them within
    a budget (:data:`LOG_EVERY`, :data:`LOG_BURST`)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._log = _LogBudget()

    def refused(self, peer: str, exc: BaseException) -> None:
        """Count a failed handshake; log it unless this peer's same failure was just logged."""
        reason = _reason(exc)
        self._metrics.tls_refusals.labels(reason=reason).inc()
        self.note(
            peer,
            reason,
            "TLS handshake from %s refused: %s (%s); the same refusal from this address is "
            "counted, not logged, for %g s",
            peer,
            reason,
            exc,
            LOG_EVERY,
        )

    def shed(self, peer: str, reason: str, message: str, *args: object) -> None:
        """Count a connection closed for a limit (``timeslice_connections_closed``)."""
        self._metrics.connections_closed.labels(reason=reason).inc()
        self.note(peer, reason, message, *args)

    def note(self, peer: str, reason: str, message: str, *args: object) -> None:
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
