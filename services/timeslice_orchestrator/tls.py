"""The replica's TLS listener: mutual TLS for the gRPC port, certificates that follow rotation,
and refused handshakes logged once.

grpclib would take one :class:`ssl.SSLContext` for the life of the server, and asyncio drops
a failed handshake silently (it logs only in debug mode). So the listener accepts plain TCP
and upgrades each connection itself with ``loop.start_tls``: every new connection gets the
*current* context (rebuilt when the files change, see :class:`timeslice.tls.ReloadingContext`;
connections already open keep theirs, so running holds and agent streams survive a rotation),
and a refused handshake is seen here: logged once per peer address and reason within
:data:`LOG_EVERY` (a client retrying every 100 ms does not fill the log) and always counted in
``timeslice_tls_refusals``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import cast

from grpclib.server import Server

from timeslice.tasks import Supervisor
from timeslice.tls import ReloadingContext, TlsFiles, server_context
from timeslice_orchestrator.metrics import Metrics

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# A refusal for the same peer and reason is logged at most this often (seconds).
LOG_EVERY = 300.0


class TlsListener:
    """Serves a grpclib :class:`Server` over mutual TLS with reloading certificates."""

    def __init__(self, files: TlsFiles, metrics: Metrics, tasks: Supervisor) -> None:
        self.context = ReloadingContext(files, server_context, name="orchestrator TLS")
        self._metrics = metrics
        self._tasks = tasks
        self._logged: dict[tuple[str, str], float] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self, server: Server, host: str, port: int) -> None:
        """Load the certificates (refusing bad files now) and listen on ``host:port``."""
        await asyncio.to_thread(self.context.load)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Handshake(self, server), host, port, reuse_address=True
        )
        # grpclib's close() and wait_closed() work on these; a listener made by its start()
        # would have set them the same way.
        server._server = self._server
        server._server_closed_fut = loop.create_future()

    def refused(self, peer: str, exc: BaseException) -> None:
        """Count a failed handshake; log it unless this peer's same failure was just logged."""
        reason = _reason(exc)
        self._metrics.tls_refusals.labels(reason=reason).inc()
        now = asyncio.get_running_loop().time()
        key = (peer, reason)
        last = self._logged.get(key)
        if last is not None and now - last < LOG_EVERY:
            return
        if len(self._logged) > 10_000:  # bounded: forget the oldest entries wholesale
            self._logged.clear()
        self._logged[key] = now
        log.warning(
            "TLS handshake from %s refused: %s (%s); the same refusal from this address is "
            "counted, not logged, for %g s",
            peer,
            reason,
            exc,
            LOG_EVERY,
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return exc.verify_message or "certificate verify failed"
    if isinstance(exc, ssl.SSLError):
        return (exc.reason or type(exc).__name__).lower()
    if isinstance(exc, TimeoutError):
        return "handshake timeout"
    return type(exc).__name__


class _Handshake(asyncio.Protocol):
    """A connection until its TLS handshake is done; then it hands over to grpclib."""

    def __init__(self, listener: TlsListener, server: Server) -> None:
        self._listener = listener
        self._server = server
        self._early = bytearray()
        self._peer = "?"
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but act as one.
        transport = cast(asyncio.Transport, transport)
        # Nothing is read before start_tls takes the transport over (it resumes reading):
        # finding the current context may await a reload after a rotation, and a ClientHello
        # read meanwhile would be lost to the handshake, which then waits for it forever.
        transport.pause_reading()
        peer = transport.get_extra_info("peername")
        name = peer[0] if isinstance(peer, tuple) else str(peer)
        self._peer = name
        # The client's hello must reach the TLS layer, not this protocol: nothing is read
        # until start_tls takes over (it resumes reading). Without this, a hello that arrives
        # while the context is being rebuilt after a rotation (a thread, so the loop runs)
        # lands in data_received, is lost, and the handshake hangs until the client gives up.
        transport.pause_reading()
        self._task = self._listener._tasks.spawn(
            self._upgrade(transport, name), f"tls-handshake-{name}", kind="tls-handshake"
        )

    def data_received(self, data: bytes) -> None:
        # Only after the handshake (reading is paused before it) and before the hand-over:
        # HTTP/2 bytes grpclib will get.
        self._early += data

    def connection_lost(self, exc: Exception | None) -> None:
        # Before the hand-over: the handshake failed. uvloop reports why only here (its
        # start_tls may never return), so the refusal is counted here and the wait ended.
        if self._task is not None and not self._task.done():
            self._listener.refused(self._peer, exc or ConnectionResetError("closed by peer"))
            self._task.cancel()

    async def _upgrade(self, transport: asyncio.Transport, peer: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            context = await self._listener.context.current()
            tls = await loop.start_tls(
                transport,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        except asyncio.CancelledError:
            transport.abort()
            raise
        except Exception as exc:  # a refused or broken handshake: never fatal to the server
            self._task = None  # counted here, not again in connection_lost
            self._listener.refused(peer, exc)
            transport.abort()
            return
        if tls is None or tls.is_closing():
            return
        protocol = self._server._protocol_factory()
        tls.set_protocol(protocol)
        protocol.connection_made(tls)
        if self._early:
            data, self._early = bytes(self._early), bytearray()
            protocol.data_received(data)
