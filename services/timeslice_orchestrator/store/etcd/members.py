"""etcd's members as the client sees them: one channel per member, a current member that
calls go to, members passed over when they fail, and the member probe that finds a member
that stopped answering (or lost its leader) while calls wait on it.

:class:`Members` is the base of :class:`~.client.EtcdClient`: the unary calls with their
failover rules (:meth:`Members._attempts`) and the probe live here; the key-value calls,
leases and watches are built on them (``client``, ``leases``, ``watch``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

from timeslice.errors import InvalidArgument
from timeslice.targets import parse_targets
from timeslice.tasks import Supervisor
from timeslice.tls import TlsFiles
from timeslice_orchestrator.store.etcd.errors import (
    Compacted,
    LeaseExpired,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# The largest message accepted from etcd (gRPC's default is 4 MiB). Range reads are paged,
# but one watch response carries every event of a revision (a delete of a whole prefix: some
# 60 bytes per key) or of a catch-up over up to 1,000 revisions: 400,000 keys deleted at once
# are about 25 MiB. etcd could split such a response (WatchCreateRequest.fragment), but it
# sizes each fragment by re-measuring it after every event it adds, which is quadratic: the
# same delete then took etcd minutes. A response larger still ends the watch (WatchTooLarge)
# and the mirror re-lists, in pages, past it; a page that does not fit is read again in
# smaller pages.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024


_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    # A member that stops answering (a paused process keeps its TCP connection open) is found
    # by these pings: its connection closes within about 8 s and the streams on it fail over.
    # etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time).
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# After a certificate rotation the previous channel keeps serving the streams it carries
# (watches, lease keepalives) this long; then it closes and they resume on the new channel.
OLD_CHANNEL_GRACE = 30.0
# Sent with every call and stream: a member without a leader (cut off from the others)
# refuses calls at once and cancels its watches, instead of serving stale reads or silence.
REQUIRE_LEADER: tuple[tuple[str, str], ...] = (("hasleader", "true"),)
# How long a member that failed is passed over while another one is available.
MEMBER_PENALTY = 5.0
# How long one that answered it has no leader, or that the leader changed, is passed over: it
# is alive and serves again once the election ends. Shorter than MEMBER_PENALTY so that when
# every member failed lately (a paused leader, then the election) the next try goes to a live
# one, not back to the one that did not answer at all.
ELECTION_PENALTY = 1.0
# A call that may be retried on another member gives its first try this share of its deadline.
FIRST_TRY_SHARE = 0.6
# Pause before trying again when every member failed a moment ago (an election, say).
ALL_FAILED_PAUSE = 0.1
# How often a member with calls still unanswered is asked for its status again.
PROBE_EVERY = 0.1
# How long a call in flight across a change of leader still gets to be answered: a write the
# new leader inherited is applied a heartbeat or two into its term (etcd's default heartbeat
# is 100 ms), one lost with the old leader is never answered.
TERM_GRACE = 0.2

# Failures of one member rather than of the request: the call is sent elsewhere next time.
_MEMBER_FAULTS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# UNAVAILABLE details meaning the request was never carried out: safe to send again even when
# it writes. Anything else (a timeout, a connection lost mid-call) may have been applied.
_NOT_APPLIED = (
    "no leader",  # the hasleader check, before the request is looked at
    "failed to connect",
    "connection refused",
    "connect failed",
    "dns resolution failed",
    "name resolution",
)


def _credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Channel credentials from PEM files (reads them: call off the event loop)."""
    with open(tls.ca, "rb") as f:
        ca = f.read()
    key = cert = None
    if tls.cert is not None and tls.key is not None:
        with open(tls.cert, "rb") as f:
            cert = f.read()
        with open(tls.key, "rb") as f:
            key = f.read()
    return grpc.ssl_channel_credentials(ca, key, cert)


def parse_endpoints(endpoints: Sequence[str]) -> list[str]:
    """``HOST:PORT`` targets from ``--etcd`` values: each item may hold several, comma-separated,
    with or without ``http://`` / ``https://`` (etcd's URL form); hosts are IP addresses or DNS
    names (``[::1]:2379`` for IPv6), parsed by the project's one address parser.

    Raises:
        InvalidArgument (a ValueError): naming what is wrong.
    """
    items = [
        part.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        for item in endpoints
        for part in item.split(",")
    ]
    addresses = parse_targets(
        [i for i in items if i], default_port=None, unix=False, what="etcd endpoint"
    )
    return [str(a) for a in addresses]


def _server_timeout(exc: grpc.aio.AioRpcError) -> bool:
    """A member's own timeout (UNKNOWN "context deadline exceeded", as during an election):
    a member fault like UNAVAILABLE; a read goes to the next member, a write is not resent."""
    return exc.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in (exc.details() or "")


def _in_election(exc: grpc.aio.AioRpcError) -> bool:
    """The member answered, refusing for want of a leader (an election is under way)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (
        "leader changed" in details or "no leader" in details
    )


def _not_applied(exc: grpc.aio.AioRpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _NOT_APPLIED)


@dataclass(frozen=True, slots=True)
class MemberProbe:
    """When a member with calls in flight is asked whether it still serves them.

    A call's deadline is no way to find a member that stopped answering: a paused process
    keeps its connections open, and a follower that forwarded a write to a leader that then
    died holds the write until etcd's own request timeout (5 s and more), longer than any
    deadline short enough to keep grants flowing. So once a call has waited ``after`` seconds,
    its member is asked for its status (etcd's Maintenance Status: no raft round, no key
    read), and again every :data:`PROBE_EVERY` while calls wait. The calls that were waiting
    when it asked are ended, UNAVAILABLE, when the member

    - does not answer within ``timeout`` (paused, overloaded past use): it is passed over for
      :data:`MEMBER_PENALTY`;
    - has no leader (it noticed the leader's loss and an election is under way);
    - answers with a raft term past the call's, and still does :data:`TERM_GRACE` after the
      first such answer, with the call unanswered (a new leader was elected while the call was
      in flight: a write forwarded to the old leader that the new one did not inherit is
      lost, and etcd would answer it only at its request timeout).

    A read ended so goes to the next member within its deadline. A write may or may not have
    been applied (as after any lost answer): it is not sent again here; its caller gets
    StoreUnavailable and, as ever, retries behind compares. ``after`` 0 turns probing off.
    """

    after: float = 0.5
    timeout: float = 0.5

    def __post_init__(self) -> None:
        if self.after < 0 or self.timeout <= 0:
            raise InvalidArgument(
                f"etcd member probe: after must be 0 or more and timeout positive, "
                f"got after={self.after:g} timeout={self.timeout:g}"
            )

    @property
    def enabled(self) -> bool:
        return self.after > 0


class _Abandoned(grpc.aio.AioRpcError):  # type: ignore[misc]
    """A call ended by the member probe (its outcome unknown; the member was dealt with)."""

    def __init__(self, details: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )


class _EndedByProbe(StoreUnavailable):
    """A stream step the member probe ended: its member was passed over already, or not at all
    (it has a new leader), so the caller must not blame it again."""


@dataclass(eq=False, slots=True)
class _Pending:
    """A call in flight to one member (a unary call, or a lease keepalive refresh on its
    stream), as the member probe sees it."""

    call: Any  # the gRPC call: the probe cancels it
    started: float  # time.monotonic()
    term: int  # the latest raft term the client had seen when it was sent (0: none yet)
    newer_term_at: float = 0.0  # when a probe first found a later term (0: none yet)
    abandoned: _Abandoned | None = None  # set when the probe ended it


class _Member:
    """One etcd member: its channel, the stubs over it, and until when it is passed over."""

    def __init__(
        self,
        endpoint: str,
        credentials: grpc.ChannelCredentials | None,
        options: list[tuple[str, int | str]],
    ) -> None:
        self.endpoint = endpoint
        # A plain HOST:PORT target: grpc resolves DNS names itself, and with TLS checks the
        # member's certificate against that host name (or IP address).
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(endpoint, options=options)
        else:
            self.channel = grpc.aio.secure_channel(endpoint, credentials, options=options)
        self.kv = pb_grpc.KVStub(self.channel)
        self.lease = pb_grpc.LeaseStub(self.channel)
        self.watch = pb_grpc.WatchStub(self.channel)
        self.maintenance = pb_grpc.MaintenanceStub(self.channel)
        # Calls in flight to it, oldest first, and the task probing it while they wait.
        self.pending: dict[_Pending, None] = {}
        self.monitor: asyncio.Task[None] | None = None
        self.failed_until = 0.0  # time.monotonic() before which another member is preferred
        # Set (and replaced) when the member fails: its watches move at once, not when the
        # connection's keepalive gives up on it.
        self.failed = asyncio.Event()

    def __repr__(self) -> str:
        return f"_Member({self.endpoint})"


def _typed(exc: grpc.aio.AioRpcError, timeout: float) -> StoreError:
    if isinstance(exc, _Abandoned):
        return _EndedByProbe(f"etcd: {exc.code().name}: {exc.details()}")
    if exc.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (exc.details() or ""):
        return Compacted(0)  # etcd's error names no revision
    if exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in (exc.details() or ""):
        return LeaseExpired(exc.details() or "lease not found")
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StoreUnavailable(f"etcd did not answer within {timeout} s")
    return StoreUnavailable(f"etcd: {exc.code().name}: {exc.details()}")


class Members:
    """The members of one etcd cluster and the calls sent to them (see
    :class:`~.client.EtcdClient` for the rules); the base the client's calls are built on."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
        tls: TlsFiles | None = None,
        probe: MemberProbe | None = None,
    ) -> None:
        if timeout <= 0:
            raise InvalidArgument(f"the etcd call timeout must be positive, got {timeout:g}")
        self._endpoints = parse_endpoints(endpoints)
        self._timeout = timeout
        self._probe = probe if probe is not None else MemberProbe()
        # The member probes (one task per member, while calls wait on it).
        self._tasks = Supervisor("etcd client")
        self.probes_sent = 0  # member status probes (tests)
        # The latest raft term seen in any answer (a term is the cluster's, not a member's):
        # a call in flight across a change of term may have been lost with the old leader.
        self._term = 0
        self._max_receive_bytes = max_receive_bytes
        self._tls = tls
        self._tls_stamp = tls.stamp() if tls is not None else ()
        self._retiring: list[tuple[float, grpc.aio.Channel]] = []
        self._members: list[_Member] = []
        # Replicas start on different members, so one member's loss touches only some.
        self._current = random.randrange(len(self._endpoints))
        # Read once at construction, before the replica serves anything; reloads read in a
        # thread (refresh_tls).
        self._open_channels(_credentials(tls) if tls is not None else None)

    def _open_channels(self, credentials: grpc.ChannelCredentials | None) -> None:
        options = [*_CHANNEL_OPTIONS, ("grpc.max_receive_message_length", self._max_receive_bytes)]
        old = {m.endpoint: m for m in self._members}
        self._members = [_Member(e, credentials, options) for e in self._endpoints]
        for member in self._members:
            previous = old.get(member.endpoint)
            if previous is not None:
                member.failed_until = previous.failed_until

    # The current member's channel and stubs (tests look at them).
    @property
    def _channel(self) -> grpc.aio.Channel:
        return self._members[self._current].channel

    @property
    def _kv(self) -> pb_grpc.KVStub:
        return self._members[self._current].kv

    @property
    def _lease(self) -> pb_grpc.LeaseStub:
        return self._members[self._current].lease

    @property
    def _watch(self) -> pb_grpc.WatchStub:
        return self._members[self._current].watch

    @property
    def current_endpoint(self) -> str:
        """The member calls go to now."""
        return self._members[self._current].endpoint

    def _pick(self) -> _Member:
        """The current member, or the next one not passed over (or, when every member failed
        lately, the one that failed longest ago), which becomes current."""
        now = time.monotonic()
        count = len(self._members)
        for step in range(count):
            index = (self._current + step) % count
            if self._members[index].failed_until <= now:
                self._current = index
                return self._members[index]
        self._current = min(range(count), key=lambda i: self._members[i].failed_until)
        return self._members[self._current]

    def _failed(self, member: _Member, why: object, *, penalty: float = MEMBER_PENALTY) -> None:
        """``member`` failed as a member does: pass it over for ``penalty`` seconds."""
        if len(self._members) == 1:
            return
        first = member.failed_until <= time.monotonic()
        member.failed_until = time.monotonic() + penalty
        member.failed.set()
        member.failed = asyncio.Event()
        if self._members[self._current] is member:
            self._current = (self._current + 1) % len(self._members)
        if first:
            log.warning(
                "etcd member %s failed (%s); using %s",
                member.endpoint,
                why,
                self._pick().endpoint,
            )

    def _all_failed(self) -> bool:
        now = time.monotonic()
        return all(m.failed_until > now for m in self._members)

    async def refresh_tls(self) -> bool:
        """Switch to new channels if the TLS files changed; True when it did.

        Also closes channels retired more than :data:`OLD_CHANNEL_GRACE` ago. A change whose
        files do not load yet (a certificate written before its key) is retried next time.
        """
        now = asyncio.get_running_loop().time()
        while self._retiring and self._retiring[0][0] <= now:
            _, old = self._retiring.pop(0)
            await old.close()
        if self._tls is None:
            return False
        stamp = self._tls.stamp()
        if stamp == self._tls_stamp:
            return False
        try:
            credentials = await asyncio.to_thread(_credentials, self._tls)
        except OSError as exc:
            log.warning("etcd TLS files changed but do not load yet: %s", exc)
            return False
        self._tls_stamp = stamp
        retired = self._members
        self._retiring.extend((now + OLD_CHANNEL_GRACE, m.channel) for m in retired)
        self._open_channels(credentials)
        # Nothing long-lived may stay on a channel that will be closed: closing cancels its
        # calls from below. Watches move now (as off a failed member); a keepalive stream is
        # replaced at its next refresh.
        for member in retired:
            member.failed.set()
        log.info("etcd TLS certificate reloaded from %s", ", ".join(self._tls.paths()))
        return True

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def timeout(self) -> float:
        """The deadline of each call, in seconds."""
        return self._timeout

    @property
    def probe(self) -> MemberProbe:
        """When a member with calls waiting is probed (see :class:`MemberProbe`)."""
        return self._probe

    async def _close_channels(self) -> None:
        for _, old in self._retiring:
            await old.close()
        self._retiring.clear()
        for member in self._members:
            await member.channel.close()

    async def _call(self, coro: object, timeout: float | None = None) -> object:
        """Await a stream step within ``timeout`` (the client's by default), errors typed."""
        limit = self._timeout if timeout is None else timeout
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result when the
            # step ends as its caller is cancelled, and the cancellation is lost (gh-86296).
            async with asyncio.timeout(limit):
                return await coro  # type: ignore[misc]
        except TimeoutError as exc:
            raise StoreUnavailable(f"etcd did not answer within {limit:g} s") from exc
        except grpc.aio.AioRpcError as exc:
            raise _typed(exc, limit) from exc

    async def _attempts(
        self, stub: str, method: str, request: object, *, read: bool, deadline: float = 0.0
    ) -> Any:
        """One unary call, on the current member and, if it fails as a member does, on the
        next (a read: always, within the deadline; a write: when it surely did not apply).

        The deadline (``time.monotonic``; by default the client's timeout from now) is
        gRPC's own, which costs no extra task. Raises the last AioRpcError (the caller types
        it)."""
        deadline = deadline or time.monotonic() + self._timeout
        while True:
            member = self._pick()
            remaining = deadline - time.monotonic()
            may_retry = read and len(self._members) > 1
            per_try = remaining * FIRST_TRY_SHARE if may_retry else remaining
            try:
                method_of = getattr(getattr(member, stub), method)
                call = method_of(request, timeout=max(per_try, 0.001), metadata=REQUIRE_LEADER)
                response = await self._probed(member, call, call)
                self._term = max(self._term, int(response.header.raft_term))
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _MEMBER_FAULTS and not _server_timeout(exc):
                    raise
                if not isinstance(exc, _Abandoned):  # the probe dealt with its member itself
                    self._failed(
                        member,
                        f"{exc.code().name}: {exc.details()}",
                        penalty=ELECTION_PENALTY if _in_election(exc) else MEMBER_PENALTY,
                    )
                if len(self._members) == 1 or not (read or _not_applied(exc)):
                    raise
                if self._all_failed():
                    await asyncio.sleep(min(ALL_FAILED_PAUSE, deadline - time.monotonic()))
                if deadline - time.monotonic() < 0.01:
                    raise

    async def _probed(self, member: _Member, call: Any, work: Awaitable[T]) -> T:
        """Await ``work``, which waits for an answer to ``call`` (a gRPC call to ``member``),
        under the member probe: when the probe cancels the call (see :class:`MemberProbe`),
        _Abandoned is raised (whatever ``work`` raised of it)."""
        if not self._probe.enabled or len(self._members) == 1:
            return await work  # nowhere else to go: the deadline alone bounds it
        pending = _Pending(call, time.monotonic(), self._term)
        member.pending[pending] = None
        if member.monitor is None or member.monitor.done():
            member.monitor = self._tasks.spawn(
                self._monitor(member), f"etcd member probe {member.endpoint}", kind="etcd-probe"
            )
        try:
            return await work
        except BaseException as exc:
            # A unary call ends with CancelledError, a stream step with its own error; a
            # cancellation of the caller's own is passed on as it is.
            task = asyncio.current_task()
            caller = isinstance(exc, asyncio.CancelledError) and (
                task is not None and task.cancelling() > 0
            )
            if pending.abandoned is not None and not caller:
                raise pending.abandoned from None
            raise
        finally:
            member.pending.pop(pending, None)

    async def _monitor(self, member: _Member) -> None:
        """Probe ``member`` while calls wait on it (see :class:`MemberProbe`); ends when none
        does, and is started again by the next call."""
        while member.pending:
            oldest = next(iter(member.pending))
            wait = oldest.started + self._probe.after - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            asked = time.monotonic()
            status = await self._status(member)
            waiting = [p for p in member.pending if p.started <= asked and p.abandoned is None]
            self._judge(member, status, waiting)
            if member.pending:
                await asyncio.sleep(PROBE_EVERY)

    async def _status(self, member: _Member) -> pb.StatusResponse | None:
        """The member's status; None when it does not answer in time (or its connection is
        gone). A refusal (an error of another kind) is an answer all the same: an empty one."""
        self.probes_sent += 1
        try:
            status: pb.StatusResponse = await member.maintenance.Status(
                pb.StatusRequest(), timeout=self._probe.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _MEMBER_FAULTS:
                return None
            log.debug("etcd member %s refused a status probe: %s", member.endpoint, exc.code())
            return pb.StatusResponse()
        except grpc.aio.UsageError:
            return pb.StatusResponse()  # its channel was retired (a TLS reload): no verdict
        return status

    def _judge(
        self, member: _Member, status: pb.StatusResponse | None, waiting: list[_Pending]
    ) -> None:
        """End the calls of ``waiting`` that ``member``'s ``status`` says are lost."""
        if status is None:
            why = f"no answer to a status probe within {self._probe.timeout:g} s"
            self._abandon(member, waiting, why)
            self._failed(member, why)
            return
        term = int(status.raftTerm)
        if not status.header.member_id:
            return  # refused: alive, nothing more known
        if not status.leader:
            why = "it has lost its leader (an election is under way)"
            self._abandon(member, waiting, why)
            self._failed(member, why, penalty=ELECTION_PENALTY)
        else:
            lost = []
            for pending in waiting:
                if pending.term == 0:
                    pending.term = term
                elif term > pending.term:
                    now = time.monotonic()
                    if not pending.newer_term_at:
                        pending.newer_term_at = now
                    elif now - pending.newer_term_at >= TERM_GRACE:
                        lost.append(pending)
            # The member has a leader: the call sent again may go to it.
            self._abandon(member, lost, f"a new leader was elected (term {term})")
        self._term = max(self._term, term)

    def _abandon(self, member: _Member, calls: list[_Pending], why: str) -> None:
        for pending in calls:
            error = _Abandoned(
                f"etcd member {member.endpoint}: {why}; the call, in flight for "
                f"{time.monotonic() - pending.started:.1f} s, may or may not have been applied"
            )
            if pending.call.cancel():
                pending.abandoned = error
            member.pending.pop(pending, None)

    async def _unary(self, stub: str, method: str, request: object, *, read: bool) -> Any:
        try:
            return await self._attempts(stub, method, request, read=read)
        except grpc.aio.AioRpcError as exc:
            raise _typed(exc, self._timeout) from exc
