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

Cut as etcd's own client is: the data model and transaction DSL (``ops``), the members and
the calls' failover (``members``), leases (``leases``) and watches (``watch``); the key-value
calls are the client's own, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2 as pb

from timeslice.tls import TlsFiles
from timeslice_orchestrator.store.batch import TxnBatcher
from timeslice_orchestrator.store.etcd.leases import Leases
from timeslice_orchestrator.store.etcd.members import MAX_RECEIVE_BYTES, MemberProbe, _typed
from timeslice_orchestrator.store.etcd.ops import (
    KeyValue,
    Txn,
    TxnResult,
    _kv,
    _reads_only,
    _txn_to_pb,
    prefix_end,
)
from timeslice_orchestrator.store.etcd.watch import Watches

log = logging.getLogger(__name__)

# Paging of prefix reads. etcd counts every key left in the range for each page it serves
# (RangeResponse.count), so a page costs time in proportion to the keys after it and small
# pages make a listing quadratic: 400,000 keys in pages of 2,000 took etcd seconds. The first
# page is small, and the rest are sized from its bytes per key to about PAGE_BYTES each:
# a listing takes a few dozen round trips however many keys there are, and each message stays
# far below the receive limit.
FIRST_PAGE = 1000
PAGE_BYTES = 4 * 1024 * 1024


class EtcdClient(Leases, Watches):
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
        super().__init__(
            endpoints,
            timeout=timeout,
            max_receive_bytes=max_receive_bytes,
            tls=tls,
            probe=probe,
        )
        self._init_leases()
        self._init_watches()
        self._batcher = TxnBatcher(self._send_txn, timeout)

    @property
    def batcher(self) -> TxnBatcher:
        """What batches transactions (its counts: tests and benchmarks)."""
        return self._batcher

    async def close(self) -> None:
        await self._batcher.close()
        await self._tasks.cancel_all(1.0)
        self._close_keepalives()
        await self._close_channels()

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
