"""A small typed asyncio etcd v3 client over aetcd's generated gRPC stubs.

aetcd's own high-level client is untyped, has no TLS, no re-watch and a lock we must not use
(DESIGN.md section 8); we use its protocol stubs and keep the behaviour we rely on here:
transactions with typed compares and operations, leases with a supervised keepalive, and watch
streams that the caller resumes from the last revision it saw.

With several endpoints (members of one etcd cluster) the client keeps one channel per member
and sends every call to one current member; a member that fails (unreachable, no answer
within the deadline, or no leader) is set aside for a while and the next one takes over.
A call left unanswered for a moment has its member asked for its status (:class:`MemberProbe`),
so that a member that stopped answering, or that lost its leader with the call in flight, is
found well before the call's deadline. See :class:`EtcdClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

from timeslice.errors import InvalidArgument
from timeslice.targets import parse_targets
from timeslice.tasks import Supervisor
from timeslice.tls import TlsFiles
from timeslice_orchestrator.store.batch import TxnBatcher

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """etcd could not be reached or did not answer in time."""


class LeaseExpired(StoreError):
    """The lease no longer exists in etcd."""


class MustRelist(StoreError):
    """A watch or paged listing cannot go on from where it is: the caller lists again."""


class Compacted(MustRelist):
    """A read or watch asked for a revision etcd has compacted away; the caller must re-list."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


class WatchCompacted(Compacted):
    """The watch start revision was compacted away; the caller must re-list."""


class EtcdRewound(MustRelist):
    """etcd's revision is behind one already seen from it: it lost writes it had acknowledged
    (restored from an older backup, or a single-member etcd before 3.5.5 / 3.4.21 that crashed
    right after answering, etcd-io/etcd#14370). What was seen of the lost history is wrong
    now, so the caller lists again."""


class WatchTooLarge(MustRelist):
    """A watch response exceeded the receive limit. Resuming would ask for it again, so the
    caller re-lists (paged) past it and watches on from there."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class EventType(enum.Enum):
    PUT = 0
    DELETE = 1


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events of one watch response; ``revision`` is the store revision it reflects."""

    revision: int
    events: tuple[WatchEvent, ...]


class CompareTarget(enum.Enum):
    VERSION = pb.Compare.VERSION
    CREATE = pb.Compare.CREATE
    MOD = pb.Compare.MOD
    VALUE = pb.Compare.VALUE
    LEASE = pb.Compare.LEASE


class CompareOp(enum.Enum):
    EQUAL = pb.Compare.EQUAL
    NOT_EQUAL = pb.Compare.NOT_EQUAL
    GREATER = pb.Compare.GREATER
    LESS = pb.Compare.LESS


@dataclass(frozen=True, slots=True)
class Compare:
    key: bytes
    target: CompareTarget
    op: CompareOp
    value: int | bytes
    # With a range end, every key in [key, range_end) must pass; an empty range compares as
    # one absent key (version, revisions and lease 0), so it passes ``absent``.
    range_end: bytes = b""

    def to_pb(self) -> pb.Compare:
        msg = pb.Compare(
            key=self.key, target=self.target.value, result=self.op.value, range_end=self.range_end
        )
        if self.target is CompareTarget.VALUE:
            assert isinstance(self.value, bytes)
            msg.value = self.value
        elif self.target is CompareTarget.VERSION:
            msg.version = int(self.value)
        elif self.target is CompareTarget.CREATE:
            msg.create_revision = int(self.value)
        elif self.target is CompareTarget.MOD:
            msg.mod_revision = int(self.value)
        else:
            msg.lease = int(self.value)
        return msg


def absent(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, CompareOp.EQUAL, 0)


def none_under(prefix: bytes) -> Compare:
    """No key starts with ``prefix``."""
    return Compare(prefix, CompareTarget.VERSION, CompareOp.EQUAL, 0, prefix_end(prefix))


def present(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, CompareOp.GREATER, 0)


def created_at(key: bytes, revision: int) -> Compare:
    return Compare(key, CompareTarget.CREATE, CompareOp.EQUAL, revision)


def modified_at(key: bytes, revision: int) -> Compare:
    return Compare(key, CompareTarget.MOD, CompareOp.EQUAL, revision)


def value_is(key: bytes, value: bytes) -> Compare:
    return Compare(key, CompareTarget.VALUE, CompareOp.EQUAL, value)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Txn:
    compare: Sequence[Compare]
    success: Sequence[Op] = ()
    failure: Sequence[Op] = ()


Op = Put | Delete | Get | Txn


@dataclass(slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One list of key-values per Get op of the branch that ran, in order.
    reads: list[list[KeyValue]] = field(default_factory=list)


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


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


def _kv(msg: object) -> KeyValue:
    return KeyValue(
        key=msg.key,  # type: ignore[attr-defined]
        value=msg.value,  # type: ignore[attr-defined]
        create_revision=msg.create_revision,  # type: ignore[attr-defined]
        mod_revision=msg.mod_revision,  # type: ignore[attr-defined]
        version=msg.version,  # type: ignore[attr-defined]
        lease=msg.lease,  # type: ignore[attr-defined]
    )


def _op_to_pb(op: Op) -> pb.RequestOp:
    if isinstance(op, Put):
        return pb.RequestOp(request_put=pb.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        req = pb.DeleteRangeRequest(key=op.key)
        if op.prefix:
            req.range_end = prefix_end(op.key)
        return pb.RequestOp(request_delete_range=req)
    if isinstance(op, Get):
        get = pb.RangeRequest(key=op.key)
        if op.prefix:
            get.range_end = prefix_end(op.key)
        return pb.RequestOp(request_range=get)
    return pb.RequestOp(request_txn=_txn_to_pb(op))


def _reads_only(txn: Txn) -> bool:
    """The transaction writes nothing, whichever branch runs: it may be sent again."""
    return all(
        isinstance(op, Get) or (isinstance(op, Txn) and _reads_only(op))
        for op in (*txn.success, *txn.failure)
    )


def _txn_to_pb(txn: Txn) -> pb.TxnRequest:
    return pb.TxnRequest(
        compare=[c.to_pb() for c in txn.compare],
        success=[_op_to_pb(o) for o in txn.success],
        failure=[_op_to_pb(o) for o in txn.failure],
    )


class _LeaseStream:
    """One LeaseKeepAlive stream, reused by every refresh of one lease.

    etcd's keepalive is a bidirectional stream: a request per refresh, a reply per request.
    Opening a stream per refresh costs an HTTP/2 stream set-up and tear-down each time; the
    etcd Go client keeps its streams open, and so do we. Refreshes of the lease take turns.
    """

    def __init__(self, member: _Member, lease_id: int) -> None:
        self.lease_id = lease_id
        self.member = member  # the etcd member the stream goes to
        self.expires_at = 0.0  # loop time past which the lease is gone unless refreshed
        self._call = member.lease.LeaseKeepAlive(metadata=REQUIRE_LEADER)
        self._turn = asyncio.Lock()
        self.used = False  # a refresh went through it: it may have broken since

    @property
    def call(self) -> Any:
        """The gRPC stream (the member probe cancels it when its member stops serving)."""
        return self._call

    async def refresh(self) -> int:
        """One refresh: the TTL etcd granted (0 or less: the lease is gone)."""
        async with self._turn:
            if self._call.done():
                raise _StreamBroken("the lease keepalive stream has ended")
            try:
                await self._call.write(pb.LeaseKeepAliveRequest(ID=self.lease_id))
                reply = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise _StreamBroken(f"lease keepalive stream failed: {exc.code().name}") from exc
            except asyncio.InvalidStateError as exc:  # it ended between the check and the write
                raise _StreamBroken("the lease keepalive stream has ended") from exc
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling() == 0:
                    # Cancelled from below, not by our caller: its channel was closed, or the
                    # member probe found its member silent or without a leader.
                    raise _StreamBroken("the lease keepalive stream was cancelled") from None
                raise
            if reply is grpc.aio.EOF:
                raise _StreamBroken("etcd closed the lease keepalive stream")
            self.used = True
            return int(reply.TTL)

    @property
    def busy(self) -> bool:
        return self._turn.locked()

    def close(self) -> None:
        self._call.cancel()


class _StreamBroken(StoreUnavailable):
    """A keepalive stream failed (etcd restarted, the connection broke): open another."""


# How often, at most, the keepalive streams of leases nobody refreshes any more are closed.
_SWEEP_EVERY = 1.0

# Paging of prefix reads. etcd counts every key left in the range for each page it serves
# (RangeResponse.count), so a page costs time in proportion to the keys after it and small
# pages make a listing quadratic: 400,000 keys in pages of 2,000 took etcd seconds. The first
# page is small, and the rest are sized from its bytes per key to about PAGE_BYTES each:
# a listing takes a few dozen round trips however many keys there are, and each message stays
# far below the receive limit.
FIRST_PAGE = 1000
PAGE_BYTES = 4 * 1024 * 1024

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
# A watch that has heard nothing for this long asks its member, with a small read, whether
# it still answers; one that does not within the member probe's timeout (MemberProbe; with
# probes off, WATCH_PROBE_TIMEOUT) is failed and the watch moves on. gRPC's own keepalive
# cannot be relied on for this: it stops pinging a connection that sends no data (a watch's,
# once created), so a paused member would keep the watch silent for as long as the pause
# lasts. A member that answers is then asked, on the watch's own stream, for a progress
# report: a stream that does not answer that either is stuck while its member is well, and
# the watch starts again. Short, as a replica that only watches (its waiters' grants made
# through another replica) learns of them no sooner than its watch moves; an idle watch
# costs a one-key read and a progress request a second.
WATCH_PROBE_AFTER = 1.0
WATCH_PROBE_TIMEOUT = 2.0
# The watch ID etcd gives the answer to a progress request: it belongs to no one watch.
PROGRESS_ANSWER = -1
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


class EtcdClient:
    """A client of one etcd cluster: one gRPC channel per member, calls go to a current one.

    ``endpoints`` are the members' ``HOST:PORT`` (IP addresses or DNS names; an item may
    hold several, comma-separated). Every call goes to the current member; when it fails as a
    member does (UNAVAILABLE: down, no leader, connection lost; or no answer within the
    deadline: a paused process), that member is passed over for :data:`MEMBER_PENALTY`
    seconds and the next one becomes current. A read is tried again on the next member within
    the same deadline; a write only when the member surely did not carry it out (no leader,
    no connection), since a write that timed out may have been applied. A call that waits
    has its member probed (``probe``, :class:`MemberProbe`): one found silent or leaderless is
    passed over at once, and the calls waiting on it end then, not at their deadline, with
    the same rules for sending them again. Watches and lease
    keepalive streams move to the next member when theirs breaks: the caller resumes a watch
    from its last revision + 1, which every member serves alike (one revision history), and
    a lease outlives the loss of a member (etcd's leader keeps it; a new leader renews every
    lease for a full TTL).

    With ``tls`` the channels verify each member against ``tls.ca`` and its host name, and
    present ``tls.cert`` (etcd started with ``--client-cert-auth`` takes the user from its
    CN). grpc fixes a channel's credentials for its life, so :meth:`refresh_tls` (called
    periodically) opens new channels when the files change: new calls use them at once;
    streams on the old ones (watches, keepalives) move over when those close
    :data:`OLD_CHANNEL_GRACE` later, as after any broken stream.
    """

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
        self._keepalives: dict[int, _LeaseStream] = {}
        self._swept_at = 0.0
        self._watching: _Member | None = None  # the member the latest watch was opened on
        self._batcher = TxnBatcher(self._send_txn, timeout)

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

    def pass_over_watch_member(self, why: str) -> None:
        """Pass over the member the latest watch runs on, as if it had failed (a watch that
        looks stuck there): its watches move, and calls prefer the other members a while."""
        if self._watching is not None:
            self._failed(self._watching, why)

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
    def batcher(self) -> TxnBatcher:
        """What batches transactions (its counts: tests and benchmarks)."""
        return self._batcher

    @property
    def timeout(self) -> float:
        """The deadline of each call, in seconds."""
        return self._timeout

    @property
    def probe(self) -> MemberProbe:
        """When a member with calls waiting is probed (see :class:`MemberProbe`)."""
        return self._probe

    async def close(self) -> None:
        await self._batcher.close()
        await self._tasks.cancel_all(1.0)
        for stream in self._keepalives.values():
            stream.close()
        self._keepalives.clear()
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

    async def get(self, key: bytes, *, revision: int = 0) -> KeyValue | None:
        """``key`` now, or as it was at ``revision`` (Compacted when that is gone)."""
        request = pb.RangeRequest(key=key, revision=revision)
        resp = await self._unary("kv", "Range", request, read=True)
        kvs = resp.kvs
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(
        self, prefix: bytes, *, page: int | None = None
    ) -> tuple[int, list[KeyValue]]:
        """All keys under ``prefix`` and the store revision they were read at (paged)."""
        revision = 0
        kvs: list[KeyValue] = []
        async with contextlib.aclosing(self.pages(prefix, page=page)) as pages:
            async for at, chunk in pages:
                revision = at
                kvs.extend(chunk)
        return revision, kvs

    async def pages(
        self, prefix: bytes, *, page: int | None = None
    ) -> AsyncGenerator[tuple[int, list[KeyValue]], None]:
        """The keys under ``prefix`` in key order, a page at a time, all at one revision.

        One read of a whole prefix is one gRPC message, and past a few thousand groups that
        exceeded the receive limit. Each page starts after the last key of the one before;
        the first is read at etcd's current revision and every later one at that same
        revision, so together they are one consistent snapshot, from which a watch can resume
        at revision + 1 (list-then-watch). The next page is asked for before this one is
        handed out, so etcd reads it while the caller indexes this one. ``page`` fixes the
        keys per page; by default pages are sized to about PAGE_BYTES.

        Use it in ``contextlib.aclosing``, so that a caller that stops early cancels the page
        read ahead at once. Yields ``(revision, key-values)`` per page, at least one page
        (maybe empty). Raises Compacted when that revision is compacted away between pages
        (the caller lists again) and StoreUnavailable as every call does.
        """
        if page is not None and page < 1:
            raise ValueError(f"page must be at least 1, got {page}")
        limit = page or FIRST_PAGE
        end = prefix_end(prefix)
        revision = 0  # 0 asks for the current revision: only the first page does
        key = prefix
        ahead: asyncio.Task[Any] | None = None
        try:
            while True:
                task = ahead or asyncio.ensure_future(self._page(key, end, limit, revision))
                ahead = None
                try:
                    resp = await task
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and limit > 1:
                        # Values too large for this many per message: read in smaller pages.
                        limit = max(1, limit // 4)
                        log.warning("a page at %r did not fit one message; pages of %d", key, limit)
                        continue
                    raise _typed(exc, self._timeout) from exc
                if revision == 0:
                    revision = int(resp.header.revision)
                got = len(resp.kvs)
                more = bool(resp.more) and got > 0
                if more:
                    if page is None:
                        limit = max(1, PAGE_BYTES * got // max(1, resp.ByteSize()))
                    key = resp.kvs[-1].key + b"\0"  # the smallest key after the last one read
                    ahead = asyncio.ensure_future(self._page(key, end, limit, revision))
                yield revision, [_kv(kv) for kv in resp.kvs]
                if not more:
                    return
        finally:
            if ahead is not None:
                # The caller stopped early, or failed: the page read ahead is not wanted.
                ahead.cancel()
                if ahead.done() and not ahead.cancelled():
                    ahead.exception()  # retrieved, so that nothing logs it as lost

    async def _page(self, key: bytes, end: bytes, limit: int, revision: int) -> Any:
        request = pb.RangeRequest(key=key, range_end=end, limit=limit, revision=revision)
        return await self._attempts("kv", "Range", request, read=True)

    async def revision(self, key: bytes) -> int:
        """etcd's current revision, from a linearizable read of ``key`` (a key the client may
        read: with auth on, one under its prefix)."""
        request = pb.RangeRequest(key=key, count_only=True)
        resp = await self._unary("kv", "Range", request, read=True)
        return int(resp.header.revision)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        resp = await self._unary(
            "kv", "Put", pb.PutRequest(key=key, value=value, lease=lease), read=False
        )
        return int(resp.header.revision)

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        req = pb.DeleteRangeRequest(key=key)
        if prefix:
            req.range_end = prefix_end(key)
        resp = await self._unary("kv", "DeleteRange", req, read=False)
        return int(resp.deleted)

    async def txn(self, txn: Txn, *, batch: str = "") -> TxnResult:
        """Run ``txn``. With ``batch`` (its group) it may share one etcd request with the
        transactions of other groups (:mod:`~timeslice_orchestrator.store.batch`): only for
        a transaction whose revision means nothing outside that group."""
        request = _txn_to_pb(txn)
        if batch and not _reads_only(txn):
            try:
                answer = await self._batcher.txn(request, batch)
            except grpc.aio.AioRpcError as exc:
                raise _typed(exc, self._timeout) from exc
            succeeded, revision, responses = answer.succeeded, answer.revision, answer.responses
        else:
            resp = await self._unary("kv", "Txn", request, read=_reads_only(txn))
            succeeded, revision = bool(resp.succeeded), int(resp.header.revision)
            responses = list(resp.responses)
        result = TxnResult(succeeded=succeeded, revision=revision)
        for r in responses:
            if r.WhichOneof("response") == "response_range":
                result.reads.append([_kv(kv) for kv in r.response_range.kvs])
        return result

    async def _send_txn(self, request: pb.TxnRequest, deadline: float) -> pb.TxnResponse:
        response: pb.TxnResponse = await self._attempts(
            "kv", "Txn", request, read=False, deadline=deadline
        )
        return response

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (operators and tests; etcd usually auto-compacts)."""
        await self._unary(
            "kv", "Compact", pb.CompactionRequest(revision=revision, physical=True), read=True
        )

    async def grant_lease(self, ttl: int) -> int:
        resp = await self._unary("lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl), read=False)
        return int(resp.ID)

    async def revoke_lease(self, lease_id: int) -> None:
        self._drop_stream(lease_id)
        try:
            # Revoking twice is harmless: the second one finds the lease gone.
            await self._unary("lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id), read=True)
        except LeaseExpired:
            pass

    async def keepalive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Refresh a lease once; returns the TTL granted, raises LeaseExpired if it is gone.

        Every refresh of a lease goes over the one keepalive stream this client keeps for it
        (opened on the first refresh, closed when the lease is revoked, expires, or is no
        longer refreshed here). A stream found broken is replaced once, so the first refresh
        after etcd comes back succeeds, as a fresh stream would. A stream that fails or does
        not answer within ``timeout`` (the client's by default) sets its member aside, so the
        next refresh goes to another member.
        """
        loop = asyncio.get_running_loop()
        self._sweep(loop.time())
        while True:
            stream = self._keepalives.get(lease_id)
            if stream is not None and stream.member not in self._members and not stream.busy:
                self._drop_stream(lease_id, stream)  # on a retired channel (a TLS reload)
                stream = None
            if stream is None:
                stream = self._keepalives[lease_id] = _LeaseStream(self._pick(), lease_id)
            reused = stream.used
            try:
                refresh = self._probed(stream.member, stream.call, stream.refresh())
                ttl = await self._call(refresh, timeout)
            except _EndedByProbe:
                self._drop_stream(lease_id, stream)  # the probe dealt with its member
                raise
            except _StreamBroken as exc:
                self._drop_stream(lease_id, stream)
                self._failed(stream.member, exc)
                if reused:
                    continue  # it broke while idle: try once on a fresh stream
                raise
            except StoreUnavailable as exc:
                self._drop_stream(lease_id, stream)
                self._failed(stream.member, exc)
                raise
            except BaseException:
                # A timeout or a cancellation leaves a reply in flight: never reuse the stream.
                self._drop_stream(lease_id, stream)
                raise
            assert isinstance(ttl, int)
            if ttl <= 0:
                self._drop_stream(lease_id, stream)
                raise LeaseExpired(f"lease {lease_id:x} expired")
            stream.expires_at = loop.time() + ttl
            return ttl

    def _drop_stream(self, lease_id: int, stream: _LeaseStream | None = None) -> None:
        current = self._keepalives.get(lease_id)
        if current is not None and (stream is None or current is stream):
            del self._keepalives[lease_id]
            current.close()

    def _sweep(self, now: float) -> None:
        """Close the streams of leases not refreshed here within their TTL (closed sessions,
        sessions now kept alive through another replica): they would otherwise stay open."""
        if now - self._swept_at < _SWEEP_EVERY:
            return
        self._swept_at = now
        for lease_id, stream in list(self._keepalives.items()):
            if stream.used and not stream.busy and now > stream.expires_at:
                self._drop_stream(lease_id, stream)

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease, -1 if it does not exist."""
        resp = await self._unary(
            "lease", "LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=lease_id), read=True
        )
        return int(resp.TTL)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Stream changes under ``prefix`` from ``start_revision`` (inclusive).

        Progress notifications arrive as empty batches so the caller's revision keeps moving.
        Raises WatchCompacted when the start revision is gone, WatchTooLarge when a response
        does not fit the receive limit (both: the caller re-lists) and StoreUnavailable when
        the stream breaks (the caller resumes from its last revision + 1).
        """
        request = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=prefix,
                range_end=prefix_end(prefix),
                start_revision=start_revision,
                progress_notify=True,
            )
        )
        member = self._pick()
        self._watching = member
        call = member.watch.Watch(metadata=REQUIRE_LEADER)
        abandoned = asyncio.Event()
        stream = _Stream(call, abandoned)
        watchdog = asyncio.ensure_future(_abandon(member.failed, stream))
        heard = _Heard()
        prober = asyncio.ensure_future(self._probe_while_silent(member, prefix, heard, stream))
        try:
            await call.write(request)
            while True:
                if heard.created:
                    resp = await call.read()
                    heard.at = time.monotonic()
                else:
                    # A member that does not even confirm the watch (paused, say) is left now
                    # rather than when the connection's keepalive gives up on it.
                    try:
                        # Not wait_for (see _call): a cancel as the answer came would be lost,
                        # and the watch would run on after its mirror stopped it.
                        async with asyncio.timeout(self._timeout):
                            resp = await call.read()
                    except TimeoutError:
                        self._failed(member, "no answer to a watch request")
                        raise StoreUnavailable(
                            f"etcd {member.endpoint} did not start a watch within "
                            f"{self._timeout:g} s"
                        ) from None
                    heard.created = True
                if resp is grpc.aio.EOF:
                    self._failed(member, "watch stream closed")
                    raise StoreUnavailable(f"etcd {member.endpoint} closed the watch stream")
                if resp.compact_revision:
                    raise WatchCompacted(int(resp.compact_revision))
                if resp.canceled:
                    # A member that lost its leader cancels the watches that require one.
                    self._failed(member, f"watch cancelled: {resp.cancel_reason}")
                    raise StoreUnavailable(f"watch cancelled by etcd: {resp.cancel_reason}")
                if (resp.created and not resp.events) or resp.watch_id == PROGRESS_ANSWER:
                    # Its header revision is etcd's current one, not how far this watch has
                    # caught up: reporting it would let readers see a future they lack. (The
                    # answer to a progress request is one too: etcd before 3.5.8 gives it at
                    # once, even to a watch still catching up.) Either is a sign of life only.
                    continue
                events = tuple(WatchEvent(EventType(ev.type), _kv(ev.kv)) for ev in resp.events)
                yield WatchBatch(int(resp.header.revision), events)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise WatchTooLarge(f"a watch response was too large: {exc.details()}") from exc
            if exc.code() in _MEMBER_FAULTS:
                self._failed(member, f"watch: {exc.code().name}: {exc.details()}")
            raise StoreUnavailable(
                f"watch stream on {member.endpoint} failed: {exc.code().name}"
            ) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() == 0:
                # Nobody cancelled the watcher: its call was, by the member failing over
                # (``abandoned``) or by its channel closing (a TLS reload retires channels).
                # Either way the watch resumes, not ends as if asked to.
                why = "failed" if abandoned.is_set() else "closed its channel"
                raise StoreUnavailable(
                    f"etcd member {member.endpoint} {why}: the watch moves on"
                ) from None
            raise
        finally:
            watchdog.cancel()
            prober.cancel()
            call.cancel()

    async def _probe_while_silent(
        self, member: _Member, key: bytes, heard: _Heard, stream: _Stream
    ) -> None:
        """Fail ``member`` (which moves its watches) once a watch on it has been silent for
        :data:`WATCH_PROBE_AFTER` and a small read to it then goes unanswered (within the
        member probe's timeout, see :class:`MemberProbe`); end the watch's
        ``stream`` alone when the member answers the read but the stream does not answer a
        progress request within :data:`WATCH_PROBE_TIMEOUT`.

        The read is of the one key ``key`` (the watched prefix itself, which the client may
        read where etcd's auth limits it to the prefix), served by the member alone."""
        probe = pb.RangeRequest(key=key, count_only=True, serializable=True)
        progress = pb.WatchRequest(progress_request=pb.WatchProgressRequest())
        probing = self._probe.enabled and len(self._members) > 1
        answer_within = self._probe.timeout if probing else WATCH_PROBE_TIMEOUT
        while True:
            await asyncio.sleep(max(heard.at + WATCH_PROBE_AFTER - time.monotonic(), 0.05))
            if time.monotonic() - heard.at < WATCH_PROBE_AFTER:
                continue
            try:
                await member.kv.Range(probe, timeout=answer_within, metadata=REQUIRE_LEADER)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _MEMBER_FAULTS or _server_timeout(exc):
                    self._failed(member, f"a silent watch's probe failed: {exc.code().name}")
                    return
            if not heard.created:
                heard.at = time.monotonic()
                continue  # its creation has a deadline of its own
            asked = time.monotonic()
            with contextlib.suppress(
                asyncio.InvalidStateError, grpc.aio.UsageError, grpc.aio.AioRpcError
            ):
                # A stream that cannot take the request (ended meanwhile, or failing) ends
                # with its own error, which its reader sees.
                await stream.call.write(progress)
            await asyncio.sleep(WATCH_PROBE_TIMEOUT)
            if heard.at < asked:
                log.warning(
                    "a watch on etcd member %s answered nothing for %g s, not even a progress "
                    "request, while the member answers reads: starting it again",
                    member.endpoint,
                    time.monotonic() - heard.at,
                )
                self._failed(member, "its watch stream stopped answering")
                stream.abandon()
                return


@dataclass
class _Heard:
    """When a watch last heard from its member (time.monotonic()), and whether it started."""

    at: float = field(default_factory=time.monotonic)
    created: bool = False  # etcd confirmed the watch


@dataclass
class _Stream:
    """A watch's gRPC call, and the flag that tells its reader the call was ended on purpose
    (so the watch resumes rather than ends as if its caller cancelled it)."""

    call: Any
    abandoned: asyncio.Event

    def abandon(self) -> None:
        self.abandoned.set()
        self.call.cancel()


async def _abandon(failed: asyncio.Event, stream: _Stream) -> None:
    """End a watch call once its member has failed (another call found it unanswering)."""
    await failed.wait()
    stream.abandon()


class LeaseKeeper:
    """Keeps one lease alive in the background (every ttl/3, over one keepalive stream) and
    reports its loss.

    ``lost`` is set when etcd says the lease is gone, or when it could not be refreshed
    for longer than its TTL (or when the keeper ends for any other reason: a lease nobody
    refreshes cannot be relied on); the owner must then stop acting on it. ``failing`` says
    that the last refresh did not go through (etcd is away, the lease may soon be lost).
    """

    def __init__(self, etcd: EtcdClient, lease_id: int, ttl: int) -> None:
        self._etcd = etcd
        self.lease_id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()
        self.failing = False

    async def run(self) -> None:
        try:
            await self._refresh_until_lost()
        finally:
            self.lost.set()

    async def _refresh_until_lost(self) -> None:
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        # A refresh stuck on a member that stopped answering must leave time to refresh
        # through another member before the TTL runs out.
        timeout = max(0.5, min(self._etcd.timeout, self.ttl / 3))
        while not self.lost.is_set():
            try:
                await self._etcd.keepalive_once(self.lease_id, timeout=timeout)
                last_ok = loop.time()
                self.failing = False
            except LeaseExpired:
                log.error("lease %x expired", self.lease_id)
                return
            except StoreUnavailable as exc:
                self.failing = True
                if loop.time() - last_ok > self.ttl:
                    log.error("lease %x not refreshed for %.1f s: %s", self.lease_id, self.ttl, exc)
                    return
                log.warning("lease %x keepalive failed, retrying: %s", self.lease_id, exc)
                await asyncio.sleep(min(0.2, self.ttl / 10))
                continue
            await asyncio.sleep(self.ttl / 3)
