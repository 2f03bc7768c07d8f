"""The replica's established TLS connections: how many one client identity holds (capped at
``max_per_identity``: the next one is sent an HTTP/2 GOAWAY and closed), and the sweep that
closes those idle for ``idle_timeout`` (see :mod:`~timeslice_orchestrator.tls`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.errors
from grpclib.protocol import H2Protocol

from timeslice_orchestrator.identity import Identity, IdentityRules, identity_of
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.tls import LOG_EVERY, Conn, ConnectionLimits, Phase, Refusals

log = logging.getLogger(__name__)

# Sweeps for idle connections happen at most this far apart (and at a quarter of the timeout).
IDLE_SWEEP_MAX = 15.0


class OpenConnections:
    """The connections whose handshake is done, by identity; the idle ones closed by
    :meth:`sweep_idle`."""

    def __init__(
        self, limits: ConnectionLimits, rules: IdentityRules, metrics: Metrics, refusals: Refusals
    ) -> None:
        self.limits = limits
        self._rules = rules
        self._metrics = metrics
        self._refusals = refusals
        self._open: dict[Conn, None] = {}
        self._by_identity: dict[str, int] = {}
        metrics.tls_connections.set_function(lambda: len(self._open))

    def admit(
        self,
        conn: Conn,
        transport: asyncio.Transport,
        protocol_factory: Callable[[], H2Protocol],
    ) -> None:
        """Hand a connection whose handshake is done to gRPC (``protocol_factory``'s), or
        refuse it when its identity holds its cap already."""
        who = identity_of(transport.get_extra_info("peercert"), self._rules)
        key = _identity_key(who)
        if key is not None:
            held = self._by_identity.get(key, 0)
            if held >= self.limits.max_per_identity:
                self._refuse_identity(conn, who, held, transport)
                return
            self._by_identity[key] = held + 1
            conn.identity = key
        protocol = protocol_factory()
        conn.phase = Phase.OPEN
        conn.h2 = protocol
        conn.opened_at = time.monotonic()
        self._open[conn] = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def _refuse_identity(
        self, conn: Conn, who: Identity | None, held: int, transport: asyncio.Transport
    ) -> None:
        """Over its identity's cap: a GOAWAY that says why, then close."""
        self._refusals.shed(
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

    def lost(self, conn: Conn) -> None:
        """A connection past its handshake ended (or was refused at its identity's cap)."""
        if conn in self._open:
            del self._open[conn]
            key = conn.identity
            if key is not None:
                left = self._by_identity[key] - 1
                if left:
                    self._by_identity[key] = left
                else:
                    del self._by_identity[key]
        conn.phase = Phase.CLOSED
        conn.h2 = None

    async def sweep_idle(self) -> None:
        """Close, every so often, the connections idle for ``limits.idle_timeout`` (not 0)."""
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
