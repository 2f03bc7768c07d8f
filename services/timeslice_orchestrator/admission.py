"""Per-client admission: a flood from one client does not slow the other jobs.

A replica serves every client from one event loop, first come first served, so a client
that sends calls as fast as it can (16 callers opening sessions and groups, far past their
quotas: a quota refusal is cheap, but not free) fills the loop, and every other job's calls
queue behind its own. Quotas (:mod:`.limits`) bound what a client may *keep*; admission
bounds how fast it may *ask*.

Each client has a token bucket, filled at ``client_rate`` tokens a second up to
``client_burst``. With mutual TLS a client is its certificate's identity, whatever the
number of connections it opens: a job (``("job", id)``), an operator (by subject CN), a node,
or a certificate of no role (by subject CN). Without TLS it is a connection (its peer
address: one HTTP/2 connection; a job id is then only a claim, so it cannot choose the
bucket):

- A call is admitted, before its request is read or decoded, while the bucket is not in
  debt; it then pays its method's cost (:data:`COSTS`: 1, more for the calls that create a
  session or a group, or read every group). A call the handler refuses for the client's own
  fault (over quota, malformed, unauthenticated, ...) pays :data:`REFUSAL_COST` more, so a
  client that keeps asking for what it cannot have runs out first.
- A call that finds the bucket in debt waits, first in first out per client (no CPU
  spent on it while it waits, and its caller sends nothing more), at most
  ``client_max_wait`` seconds and never past its own deadline. Past that, it is refused
  RESOURCE_EXHAUSTED, typed, with how long to wait in the message. A call that finds
  ``client_max_waiting`` calls of its client already waiting takes no place in line and is
  refused so too, after as long as it could have waited: a client with more calls in flight
  than that gets refusals at the pace of its own concurrency, not as fast as it can ask.

Other clients have buckets of their own, so their calls are never delayed or refused by a
flood; a job doing a handful of calls per step never comes near the defaults. A client's
state is dropped once it is idle (no call running or waiting, its bucket full), so what is
kept is bounded by the clients that are busy right now. The agents' service is not
admitted here (one long stream per node).

Operators have no larger bucket: what they do (the CLI, ``timeslice top``, pinning members)
costs a few tokens a second, and one certificate on many connections (the dev cluster once
gave every client the operator's) must not get the loop to itself. Certificates sharing a
subject CN share a bucket.

Without client certificates, a client opening many connections gets a bucket on each: this
bounds a client library or a runaway loop, not a determined attacker (use client
certificates, and a limit on connections per source in front of the replicas).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from timeslice.errors import ResourceExhausted
from timeslice_orchestrator import identity

if TYPE_CHECKING:
    from timeslice_orchestrator.limits import Limits
    from timeslice_orchestrator.metrics import Metrics

SERVICE = "/timeslice.v1.TimeSlice/"
# Tokens a call pays when admitted, by method; others pay 1. Creating a session is a lease
# grant and a write; an Acquire may create a group; ListGroups reads every group.
COSTS = {"OpenSession": 10, "Acquire": 2, "SetGroupMembers": 10, "ListGroups": 10}
# Tokens a call pays more when it ends in a refusal that is the client's own doing.
REFUSAL_COST = 10
REFUSALS = frozenset(
    {
        Status.INVALID_ARGUMENT,
        Status.NOT_FOUND,
        Status.ALREADY_EXISTS,
        Status.PERMISSION_DENIED,
        Status.UNAUTHENTICATED,
        Status.RESOURCE_EXHAUSTED,
        Status.FAILED_PRECONDITION,
        Status.OUT_OF_RANGE,
        Status.UNIMPLEMENTED,
    }
)
SWEEP_INTERVAL = 1.0  # seconds between two sweeps of idle clients


class _Client:
    """One client's bucket, its waiting calls, and its calls running."""

    __slots__ = ("active", "stamp", "tokens", "waiters")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp
        self.active = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    def refill(self, now: float, rate: float, burst: float) -> None:
        self.tokens = min(burst, self.tokens + (now - self.stamp) * rate)
        self.stamp = now


class Admission:
    """The buckets of every busy client of one replica."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_waiting: int,
        max_wait: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate < 0 or burst < 1 or max_waiting < 0 or max_wait < 0:
            raise ValueError("admission: rate, max_waiting and max_wait >= 0, burst >= 1")
        self.rate, self.burst = rate, float(burst)
        self.max_waiting, self.max_wait = max_waiting, max_wait
        self._metrics = metrics
        self._clock = clock
        self._clients: dict[Hashable, _Client] = {}
        self._next_sweep = 0.0

    @classmethod
    def from_limits(cls, limits: Limits, metrics: Metrics | None = None) -> Admission:
        return cls(
            limits.client_rate,
            limits.client_burst,
            limits.client_max_waiting,
            limits.client_max_wait,
            metrics,
        )

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def tracked(self) -> int:
        """Clients with state kept (busy ones, and idle ones until the next sweep)."""
        return len(self._clients)

    def _client(self, key: Hashable, now: float) -> _Client:
        if now >= self._next_sweep:
            self._sweep(now)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Client(self.burst, now)
        else:
            client.refill(now, self.rate, self.burst)
        return client

    def _sweep(self, now: float) -> None:
        """Forget idle clients: a full bucket is what a new one starts with."""
        self._next_sweep = now + SWEEP_INTERVAL
        for key, client in list(self._clients.items()):
            client.refill(now, self.rate, self.burst)
            if not client.active and not client.waiters and client.tokens >= self.burst:
                del self._clients[key]

    async def admit(self, key: Hashable, method: str, timeout: float | None = None) -> _Client:
        """Wait for the client's turn; its caller must :meth:`done` the returned ticket.

        Raises :class:`~timeslice.errors.ResourceExhausted` when the call cannot be admitted
        within ``client_max_wait`` (nor within ``timeout``, the call's own deadline).
        """
        now = self._clock()
        client = self._client(key, now)
        cost = COSTS.get(method, 1)
        if not client.waiters and client.tokens > 0:
            client.tokens -= cost
            client.active += 1
            return client
        wait = self.max_wait if timeout is None else max(0.0, min(self.max_wait, timeout))
        if wait <= 0:
            self._refused(client, method, "waiting")
        if len(client.waiters) >= self.max_waiting:
            # Refused, but only once it could have waited: a client that keeps more calls in
            # flight than it may queue (many connections of one certificate, say) then gets
            # its refusals at the pace of its own concurrency, not as fast as the replica can
            # write them (a refusal costs the loop about what a cheap call does). Nothing is
            # kept for the call but its sleep; its stream holds as much anyway.
            waiting = len(client.waiters)
            await asyncio.sleep(wait)
            self._refused(client, method, "waiting", waiting)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not client.waiters:
            turn.set_result(None)
        client.waiters.append(turn)
        try:
            async with asyncio.timeout(wait):
                await turn  # first in line
                while True:
                    client.refill(self._clock(), self.rate, self.burst)
                    if client.tokens > 0:
                        break
                    await asyncio.sleep(-client.tokens / self.rate + 1e-4)
        except TimeoutError:
            self._refused(client, method, "timeout")
        finally:
            was_first = client.waiters[0] is turn
            client.waiters.remove(turn)
            if was_first and client.waiters and not client.waiters[0].done():
                # (done: that waiter is being cancelled, and hands on in its own finally)
                client.waiters[0].set_result(None)
        client.tokens -= cost
        client.active += 1
        if self._metrics is not None:
            self._metrics.admission.labels(outcome="waited").inc()
        return client

    async def admit_message(self, peer_addr: Any, method: str) -> _Client:
        """Admit one request that a long-lived stream carries (a YieldStream's yield) as the
        call it stands for: it pays that call's cost from the caller's bucket. Run it in the
        stream's handler (the caller's identity is known there); :meth:`done` the ticket."""
        return await self.admit(_client_key(peer_addr), method)

    def done(self, client: _Client, status: Status | None) -> None:
        """A call admitted on ``client`` ended, with this status (None: OK)."""
        client.active -= 1
        if status in REFUSALS:
            # A debt at most one burst deep: a client refused for a while waits at most
            # burst / rate seconds once it stops.
            client.tokens = max(-self.burst, client.tokens - REFUSAL_COST)

    def _refused(self, client: _Client, method: str, why: str, waiting: int | None = None) -> None:
        if self._metrics is not None:
            self._metrics.admission.labels(outcome=f"refused_{why}").inc()
        retry = max(0.05, -client.tokens / self.rate if self.rate else 1.0)
        waiting = len(client.waiters) if waiting is None else waiting
        raise ResourceExhausted(
            f"{method}: this client sends calls faster than this replica admits "
            f"({self.rate:g} tokens/s, burst {self.burst:g}, --client-rate/--client-burst; "
            f"{waiting} calls already waiting); retry in {retry:.2f} s"
        )


def _client_key(peer_addr: Any) -> Hashable:
    """Whose bucket a call spends: with a client certificate, its identity's (all the
    connections of one job, operator, node or other certificate share one bucket), else
    its connection's."""
    who = identity.current()  # set by identity's listener, before the handler runs
    if who is not None:
        if who.operator:
            return ("operator", who.subject)
        if who.job is not None:
            return ("job", who.job)
        if who.node is not None:
            return ("node", who.node)
        return ("subject", who.subject)
    # Plaintext: TCP (host, port), one per connection. A unix socket has no peer name: all
    # its connections share one bucket.
    return ("peer", tuple(peer_addr) if isinstance(peer_addr, (tuple, list)) else peer_addr)


def install(server: Server, admission: Admission, service: str = SERVICE) -> None:
    """Admit every call of ``service`` on ``server`` through ``admission``, before its
    request is read (listeners installed earlier, such as the frame bound, run inside)."""
    if not admission.enabled:
        return

    async def on_request(event: RecvRequest) -> None:
        if not event.method_name.startswith(service):
            return
        handler = event.method_func
        method = event.method_name[len(service) :]
        addr = event.peer.addr()
        deadline = event.deadline

        async def admitted(stream: Any) -> None:
            key = _client_key(addr)
            timeout = None if deadline is None else deadline.time_remaining()
            try:
                ticket = await admission.admit(key, method, timeout)
            except ResourceExhausted as exc:
                raise exc.to_grpc() from None
            status: Status | None = Status.UNKNOWN
            try:
                await handler(stream)
                status = None
            except GRPCError as exc:
                status = exc.status
                raise
            finally:
                admission.done(ticket, status)

        event.method_func = admitted

    listen(server, RecvRequest, on_request)
