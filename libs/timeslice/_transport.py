"""Connections to orchestrator replicas: channels, error mapping and unary failover.

Every orchestrator replica answers every call, so the SDK keeps one lazily opened grpclib
channel per configured target, sticks to the one that last worked, and moves on to the next
one when a replica cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from timeslice import _trace_context
from timeslice._channel import LiveChannel
from timeslice.backoff import Backoff
from timeslice.errors import (
    ConnectionFailed,
    InvalidArgument,
    Timeout,
    TimeSliceError,
    TlsRefused,
    Unavailable,
    error_from_status,
)
from timeslice.targets import Target, UnixSocket
from timeslice.tls import (
    ReloadingContext,
    TlsChannel,
    describe_tls_error,
    requires_certificate,
)
from timeslice_proto.timeslice.v1 import TimeSliceStub

log = logging.getLogger("timeslice.transport")

T = TypeVar("T")


# HTTP/2 pings find a replica that stopped answering (paused, partitioned) within a few seconds,
# so a waiting Acquire moves to another replica instead of waiting on a dead connection. A ping
# every keepalive period, for the connection's whole life: grpclib's defaults stop after two
# pings without data and then wait 300 s between pings, so a replica paused after a
# connection's first seconds held its waiters for minutes.
KEEPALIVE_SECONDS = 2.0
CHANNEL_CONFIG = Configuration(
    _keepalive_time=KEEPALIVE_SECONDS,
    _keepalive_timeout=3.0,
    _keepalive_permit_without_calls=True,
    _http2_max_pings_without_data=0,
    # Under the ping timer's period (asyncio may run a timer a little early): every tick pings.
    _http2_min_sent_ping_interval_without_data=KEEPALIVE_SECONDS * 0.75,
)


def open_channel(target: Target, tls: ReloadingContext | None = None) -> Channel:
    """Create a channel to ``target`` (call it inside the loop that will use the channel).

    With ``tls``, every connection of a TCP channel uses TLS with the context's current
    certificate; a unix socket stays plaintext (it is local, guarded by its file mode).
    """
    if isinstance(target, UnixSocket):
        return LiveChannel(path=target.path, config=CHANNEL_CONFIG)
    if tls is not None:
        return TlsChannel(target, tls, CHANNEL_CONFIG)
    return LiveChannel(host=target.host, port=target.port, config=CHANNEL_CONFIG)


def map_error(exc: BaseException, where: object) -> TimeSliceError | None:
    """Translate a transport-level exception into the SDK's typed errors.

    Returns ``None`` for anything that is not a transport failure (the caller re-raises it).
    """
    if isinstance(exc, TimeSliceError):
        return exc
    if isinstance(exc, GRPCError):
        return error_from_status(exc.status, exc.message, exc.details)
    # TimeoutError is an OSError subclass: test it before the connection errors.
    if isinstance(exc, TimeoutError):
        return Timeout(f"{where}: deadline exceeded")
    if isinstance(exc, ssl.SSLError):
        # A server that says it requires a certificate got none: retrying cannot help.
        return TlsRefused(f"{where}: {describe_tls_error(exc)}", final=requires_certificate(exc))
    if isinstance(exc, OSError | StreamTerminatedError | ProtocolError):
        detail = str(exc) or type(exc).__name__
        return Unavailable(f"{where}: {detail}")
    return None


# TlsRefused (timeslice.errors): still an outage to the retry loops (a rotation in progress
# heals by itself), but its message is kept as the reason when the budget ends, over any later
# timeout.


def is_final(error: TimeSliceError | None) -> bool:
    """A connection failure no retry can heal (the server requires a client certificate
    and none is configured): raise it now."""
    return isinstance(error, ConnectionFailed) and error.final


class ReplicasUnreachable(Unavailable):
    """:meth:`Transport.unary` tried the replicas and none of them answered.

    ``problems`` holds the last failure seen at each target that was tried, in the order
    they were tried, for callers that report every replica (the command line).
    """

    def __init__(self, message: str, problems: dict[str, TimeSliceError]) -> None:
        super().__init__(message)
        self.problems = problems


class _Announcement:
    """One failover, told to everyone waiting for it: the targets that failed before it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.failed: set[str] = set()

    def fire(self, failed: set[str]) -> None:
        self.failed = failed
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


class Transport:
    """Channels to every target, bound to the event loop that first uses them."""

    def __init__(self, targets: Sequence[Target], tls: ReloadingContext | None = None) -> None:
        if not targets:
            raise InvalidArgument("no orchestrator target given")
        self.targets = list(targets)
        self._tls = tls
        self._channels: dict[int, Channel] = {}
        self._current = 0
        self._closed = False
        # Woken when a call failed on some targets and then worked on another (see
        # failed_over_from); replaced at each announcement.
        self._failover = _Announcement()
        # Targets whose last call failed, and where no call has worked since.
        self._failing: set[str] = set()
        # The last connection failure at each target since a call last worked anywhere.
        self._outage: dict[str, TimeSliceError] = {}

    @property
    def current(self) -> Target:
        """The target calls go to now: the one that last worked."""
        return self.targets[self._current]

    def rotate(self, failed: Target) -> None:
        """Move on from ``failed`` to the next target, if calls still go to ``failed``.

        Several loops share a transport (the session's keepalive, an Acquire stream). Each
        moves away from the target that failed it, not from whatever is current: two loops
        that both saw one replica fail would otherwise take turns moving the other back to it.
        """
        if self.current == failed:
            self._current = (self._current + 1) % len(self.targets)

    async def failed_over_from(self, target: Target) -> None:
        """Until a call works on another target while ``target`` is failing (its last call
        failed, and none has worked there since).

        A stream that sits on ``target`` (a waiting Acquire) hears nothing when that replica
        can no longer follow etcd yet still answers the connection's pings: cut off from etcd,
        it cannot tell the waiter of a grant another replica made. Unary calls (the session's
        keepalive) that fail there and work elsewhere show it; the stream then moves. While
        calls fail everywhere (etcd itself away) nothing moves: no replica could do better.
        """
        while True:
            announcement = self._failover
            await announcement.wait()
            if str(target) in announcement.failed:
                return

    def worked(self, target: Target) -> None:
        """``target`` answered (a stream's message): it is not failing."""
        self._failing.discard(str(target))
        self._outage.clear()

    def _announce_failover(self, failed: set[str]) -> None:
        announcement, self._failover = self._failover, _Announcement()
        announcement.fire(failed)

    def stub(self) -> tuple[Target, TimeSliceStub]:
        """The current target and a stub for it (opening its channel if needed)."""
        if self._closed:
            raise Unavailable("the client's connections were closed")
        channel = self._channels.get(self._current)
        if channel is None:
            channel = _trace_context.install(open_channel(self.current, self._tls))
            self._channels[self._current] = channel
        return self.current, TimeSliceStub(channel)

    def map_error(self, exc: BaseException, where: object) -> TimeSliceError | None:
        """:func:`map_error`, naming the cause behind a lost connection if the channel saw it.

        A server that refuses our certificate (TLS 1.3) does so after our handshake ended,
        and a TLS server hangs up on a plaintext client before answering: grpclib only sees
        the connection drop ("Connection lost"); the channel kept why. A connection failure
        is remembered (:meth:`outage`) until a call works again.
        """
        error = map_error(exc, where)
        channel = self._channels.get(self._current)
        if (
            isinstance(error, Unavailable)
            and not isinstance(error, ConnectionFailed)
            and not isinstance(exc, ssl.SSLError)
            and isinstance(channel, LiveChannel)
            and channel.problem is not None
        ):
            error = channel.problem
        if isinstance(error, Unavailable) and not isinstance(exc, GRPCError):
            # Not a replica's answer (UNAVAILABLE from one cut off from etcd is an answer).
            self._outage[str(self.current)] = error
        return error

    def outage(self, what: str, waited: float) -> Unavailable | None:
        """The unreachable error for ``what`` if no call has worked since the last connection
        failure (every target tried failed): a deadline that passed meanwhile passed because
        nothing answered, and this says so. ``None`` while any replica answers."""
        if not self._outage:
            return None
        return self._unreachable(what, dict(self._outage), waited)

    def close(self) -> None:
        """Close every open channel; later calls raise :class:`Unavailable`."""
        self._closed = True
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def unary(
        self,
        what: str,
        call: Callable[[TimeSliceStub, float], Awaitable[T]],
        *,
        budget: float,
        attempts: int | None = None,
    ) -> T:
        """Run one unary call, failing over to the next target on :class:`Unavailable`.

        ``call(stub, timeout)`` must pass ``timeout`` to the RPC. The whole call, retries and
        backoff included, takes at most ``budget`` seconds. ``attempts`` bounds the number of
        tries instead of retrying until the budget ends: ``len(targets)`` asks every replica
        once, each with an equal share of the budget (interactive tools that should fail
        fast). Raises :class:`ReplicasUnreachable` when no replica answered, or the one
        :class:`~timeslice.errors.ConnectionFailed` subclass every target failed with.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        backoff = Backoff()
        problems: dict[str, TimeSliceError] = {}
        failures = 0
        if attempts is not None:
            share = budget / max(1, attempts)
        elif len(self.targets) < 2:
            share = budget
        else:
            # With several replicas, one attempt may use only part of the budget: a replica
            # that hangs (paused, partitioned) must not eat all of it before we try the next.
            share = max(budget / 2, 0.2)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                # Only after a failed attempt and its backoff (a sleep may overshoot the
                # deadline under load): report the outage if that is what it was.
                if problems and (
                    isinstance(list(problems.values())[-1], Unavailable)
                    or _refusal(problems) is not None
                ):
                    raise self._unreachable(what, problems, budget)
                raise Timeout(f"{what}: no answer within {budget:g}s")
            target, stub = self.stub()
            timeout = min(remaining, share)
            try:
                result = await call(stub, timeout)
            except Exception as exc:
                error = self.map_error(exc, f"{what} via {target}")
                if error is None:
                    raise
                # Our own per-attempt deadline passed (not a typed timeout the server sent).
                timed_out = isinstance(exc, TimeoutError)
                if is_final(error) or not (isinstance(error, Unavailable) or timed_out):
                    raise error from exc
                earlier = problems.pop(str(target), None)
                if timed_out and (
                    isinstance(earlier, TlsRefused)
                    or (isinstance(earlier, Unavailable) and timeout < share)
                ):
                    # An attempt cut short by the budget says less than the refusal, or the
                    # UNAVAILABLE answer, that this replica gave before: that is the reason.
                    error = earlier
                problems[str(target)] = error
                self._failing.add(str(target))
                failures += 1
                if attempts is not None and failures >= attempts:
                    raise self._unreachable(what, problems, None) from exc
                if timed_out and deadline - loop.time() <= 0.05 and error is not earlier:
                    # The budget itself ran out: that is a timeout, not an outage, unless a
                    # replica refused us at the TLS level (the real reason: name it).
                    if _refusal(problems) is not None:
                        raise self._unreachable(what, problems, budget) from exc
                    raise error from exc
                log.debug("%s", error)
                self.rotate(target)
                delay = backoff.next_delay()
                if loop.time() + delay >= deadline:
                    raise self._unreachable(what, problems, budget) from exc
                await asyncio.sleep(delay)
                continue
            self._failing.discard(str(target))
            self._outage.clear()
            if self._failing:
                self._announce_failover(set(self._failing))
            return result

    def _unreachable(
        self, what: str, problems: dict[str, TimeSliceError], budget: float | None
    ) -> Unavailable:
        """The error of a call no replica answered: the one cause, as its own type, when
        every target failed the same way (a misconfiguration, typically: nothing listens,
        a name that does not resolve, TLS on one side only), else :class:`ReplicasUnreachable`
        naming the telling one."""
        within = "" if budget is None else f" within {budget:g}s"
        # A TLS refusal says more than a later timeout or reset at another replica.
        last = _refusal(problems) or list(problems.values())[-1]
        if isinstance(last, ConnectionFailed) and {type(e) for e in problems.values()} == {
            type(last)
        }:
            # Each message names its own address.
            causes = "; ".join(str(e) for e in problems.values())
            several = "no orchestrator replica reachable: " if len(problems) > 1 else ""
            return type(last)(f"{what}: {several}{causes}", final=last.final)
        return ReplicasUnreachable(
            f"{what}: no orchestrator replica reachable{within} "
            f"(targets {', '.join(str(t) for t in self.targets)}; last error: {last})",
            problems,
        )


def _refusal(problems: dict[str, TimeSliceError]) -> TlsRefused | None:
    """The latest TLS refusal among ``problems``, if any."""
    for error in reversed(list(problems.values())):
        if isinstance(error, TlsRefused):
            return error
    return None
