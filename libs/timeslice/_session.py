"""A client session: the lease on the orchestrator that owns a job's queue entries and holds.

Modelled on etcd's ``concurrency.Session``: :meth:`Session.open` grants the lease, a supervised
task keeps it alive every ttl/3, :attr:`Session.done` says when it is gone (expired on the
server, or closed), and :meth:`Session.close` ends it at once. Whoever owns the session learns
of a loss through ``on_lost``, once, and forgets what the session held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from grpclib.exceptions import StreamTerminatedError

from timeslice import _trace_context
from timeslice._transport import Transport
from timeslice.errors import InternalError, NotFound, SessionExpired, TimeSliceError
from timeslice_proto.timeslice.v1 import (
    CloseSessionRequest,
    CloseSessionResponse,
    KeepAliveRequest,
    KeepAliveResponse,
    OpenSessionRequest,
    OpenSessionResponse,
    TimeSliceStub,
)

log = logging.getLogger("timeslice")

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]
"""Starts a supervised background task (see :class:`timeslice.tasks.Supervisor`)."""


class Session:
    """One open session of a job; see the module docstring.

    Args:
        transport: the client's connections (calls fail over between replicas).
        session_id: the id the orchestrator gave the session.
        secret: the session's secret, from OpenSession: every call on the session carries
            it (the orchestrator refuses the id alone). Never logged or shown.
        ttl: seconds the keepalive cadence is based on.
        call_timeout: the bound on one KeepAlive, retries included (never above ttl/3).
        on_keepalive: called with every KeepAlive answer (it carries the yield requests).
        on_lost: called once when the orchestrator says the session is gone, or the
            keepalive task crashed, with the reason; not called by :meth:`close`.
    """

    def __init__(
        self,
        transport: Transport,
        session_id: str,
        ttl: float,
        *,
        secret: str,
        call_timeout: float,
        on_keepalive: Callable[[KeepAliveResponse], None],
        on_lost: Callable[[Session, str], None],
    ) -> None:
        self._transport = transport
        self.session_id = session_id
        self.secret = secret
        self.ttl = ttl
        self._call_timeout = call_timeout
        self._on_keepalive = on_keepalive
        self._on_lost = on_lost
        self._keepalive: asyncio.Task[None] | None = None
        self._done = False
        self.lost_reason: str | None = None
        """Why the session was lost, if it was."""

    @classmethod
    async def open(
        cls,
        transport: Transport,
        *,
        job_id: str,
        ttl: float,
        call_timeout: float,
        on_keepalive: Callable[[KeepAliveResponse], None],
        on_lost: Callable[[Session, str], None],
    ) -> Session:
        """Open a session (OpenSession) asking for ``ttl`` seconds; keepalives not started yet."""
        request = OpenSessionRequest(
            job_id=job_id,
            # The wire carries whole seconds; never round a short TTL down to 0 (= default).
            ttl_seconds=max(1, math.ceil(ttl)),
            client_host=socket.gethostname(),
            client_pid=os.getpid(),
        )

        async def call(stub: TimeSliceStub, timeout: float) -> OpenSessionResponse:
            return await stub.open_session(request, timeout=timeout)

        response = await transport.unary("OpenSession", call, budget=call_timeout)
        if not response.session_id:
            raise InternalError("OpenSession returned an empty session id")
        if not response.session_secret:
            # An orchestrator from before session secrets: its sessions cannot be proven ours.
            raise InternalError("OpenSession returned no session secret (orchestrator too old?)")
        granted_ttl = float(response.ttl_seconds) or ttl
        # Keep alive at the shorter of the two TTLs: more often than needed is harmless.
        return cls(
            transport,
            response.session_id,
            min(ttl, granted_ttl),
            secret=response.session_secret,
            call_timeout=call_timeout,
            on_keepalive=on_keepalive,
            on_lost=on_lost,
        )

    @property
    def done(self) -> bool:
        """True once the session was lost or closed; a done session never comes back."""
        return self._done

    def keep_alive(self, spawn: Spawn) -> None:
        """Start the keepalive task (with ``spawn``, so that a crash is logged)."""
        guard = _trace_context.detached(self._keepalive_guard())
        self._keepalive = spawn(guard, f"timeslice-keepalive-{self.session_id}")

    def lose(self, reason: str) -> None:
        """Mark the session lost (the orchestrator released what it held) and tell the owner.

        Idempotent: only the first loss counts.
        """
        if self._done:
            return
        self._done = True
        self.lost_reason = reason
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None and keepalive is not asyncio.current_task():
            keepalive.cancel()
        self._on_lost(self, reason)

    async def close(self, *, budget: float) -> None:
        """End the session now: stop the keepalive, then CloseSession within ``budget`` seconds.

        Best effort: if no replica answers, the lease expires on its own after its TTL.
        """
        self._done = True
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive
        request = CloseSessionRequest(session_id=self.session_id, session_secret=self.secret)

        async def call(stub: TimeSliceStub, timeout: float) -> CloseSessionResponse:
            return await stub.close_session(request, timeout=timeout)

        try:
            await self._transport.unary("CloseSession", call, budget=budget)
        except (TimeSliceError, StreamTerminatedError) as exc:
            log.warning(
                "CloseSession of %s failed (its lease will expire): %s", self.session_id, exc
            )

    async def _keepalive_guard(self) -> None:
        try:
            await self._keepalive_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Without keepalives the lease will expire: say so now instead of later.
            log.exception("keepalive of session %s crashed", self.session_id)
            self.lose(f"keepalive task crashed: {exc!r}")

    async def _keepalive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.ttl / 3
        next_at = loop.time() + interval
        request = KeepAliveRequest(session_id=self.session_id, session_secret=self.secret)

        async def call(stub: TimeSliceStub, timeout: float) -> KeepAliveResponse:
            return await stub.keep_alive(request, timeout=timeout)

        while not self._done:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            # A fixed cadence; after a stall, resume from now rather than firing a burst.
            next_at = max(next_at + interval, loop.time())
            if self._done:
                return
            try:
                reply = await self._transport.unary(
                    "KeepAlive", call, budget=min(self._call_timeout, interval)
                )
            except (SessionExpired, NotFound) as exc:
                self.lose(f"KeepAlive: {exc}")
                return
            except TimeSliceError as exc:
                if self._done:
                    return
                log.warning("keepalive of session %s failed, retrying: %s", self.session_id, exc)
                continue
            self._on_keepalive(reply)
