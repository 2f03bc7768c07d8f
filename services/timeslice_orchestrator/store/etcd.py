"""A small typed asyncio etcd v3 client over aetcd's generated gRPC stubs.

aetcd's own high-level client is untyped, has no TLS, no re-watch and a lock we must not use
(DESIGN.md section 8); we use its protocol stubs and keep the behaviour we rely on here:
transactions with typed compares and operations, leases with a supervised keepalive, and watch
streams that the caller resumes from the last revision it saw.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """etcd could not be reached or did not answer in time."""


class LeaseExpired(StoreError):
    """The lease no longer exists in etcd."""


class WatchCompacted(StoreError):
    """The watch start revision was compacted away; the caller must re-list."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


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

    def to_pb(self) -> pb.Compare:
        msg = pb.Compare(key=self.key, target=self.target.value, result=self.op.value)
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


def _txn_to_pb(txn: Txn) -> pb.TxnRequest:
    return pb.TxnRequest(
        compare=[c.to_pb() for c in txn.compare],
        success=[_op_to_pb(o) for o in txn.success],
        failure=[_op_to_pb(o) for o in txn.failure],
    )


class EtcdClient:
    """One gRPC channel to an etcd cluster; endpoints are tried in order on failure."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self._endpoints = list(endpoints)
        self._timeout = timeout
        # grpc's own name resolution spreads calls over the endpoints and fails over.
        target = (
            self._endpoints[0] if len(self._endpoints) == 1 else "ipv4:" + ",".join(self._endpoints)
        )
        self._channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.keepalive_time_ms", 5000),
                ("grpc.keepalive_timeout_ms", 3000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._kv = pb_grpc.KVStub(self._channel)
        self._lease = pb_grpc.LeaseStub(self._channel)
        self._watch = pb_grpc.WatchStub(self._channel)

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, coro: object) -> object:
        try:
            return await asyncio.wait_for(coro, self._timeout)  # type: ignore[arg-type]
        except TimeoutError as exc:
            raise StoreUnavailable(f"etcd did not answer within {self._timeout} s") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in (exc.details() or ""):
                raise LeaseExpired(exc.details() or "lease not found") from exc
            raise StoreUnavailable(f"etcd: {exc.code().name}: {exc.details()}") from exc

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._call(self._kv.Range(pb.RangeRequest(key=key)))
        kvs = resp.kvs  # type: ignore[attr-defined]
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """All keys under ``prefix`` and the store revision they were read at."""
        resp = await self._call(
            self._kv.Range(pb.RangeRequest(key=prefix, range_end=prefix_end(prefix)))
        )
        return resp.header.revision, [_kv(kv) for kv in resp.kvs]  # type: ignore[attr-defined]

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        resp = await self._call(self._kv.Put(pb.PutRequest(key=key, value=value, lease=lease)))
        return int(resp.header.revision)  # type: ignore[attr-defined]

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        req = pb.DeleteRangeRequest(key=key)
        if prefix:
            req.range_end = prefix_end(key)
        resp = await self._call(self._kv.DeleteRange(req))
        return int(resp.deleted)  # type: ignore[attr-defined]

    async def txn(self, txn: Txn) -> TxnResult:
        resp = await self._call(self._kv.Txn(_txn_to_pb(txn)))
        result = TxnResult(
            succeeded=bool(resp.succeeded),  # type: ignore[attr-defined]
            revision=int(resp.header.revision),  # type: ignore[attr-defined]
        )
        for r in resp.responses:  # type: ignore[attr-defined]
            if r.WhichOneof("response") == "response_range":
                result.reads.append([_kv(kv) for kv in r.response_range.kvs])
        return result

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (operators and tests; etcd usually auto-compacts)."""
        await self._call(self._kv.Compact(pb.CompactionRequest(revision=revision, physical=True)))

    async def grant_lease(self, ttl: int) -> int:
        resp = await self._call(self._lease.LeaseGrant(pb.LeaseGrantRequest(TTL=ttl)))
        return int(resp.ID)  # type: ignore[attr-defined]

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(self._lease.LeaseRevoke(pb.LeaseRevokeRequest(ID=lease_id)))
        except LeaseExpired:
            pass

    async def keepalive_once(self, lease_id: int) -> int:
        """Refresh a lease once; returns the TTL granted, raises LeaseExpired if it is gone."""

        async def once() -> int:
            call = self._lease.LeaseKeepAlive(iter([pb.LeaseKeepAliveRequest(ID=lease_id)]))
            async for reply in call:
                return int(reply.TTL)
            raise StoreUnavailable("lease keepalive stream ended without a reply")

        ttl = await self._call(once())
        assert isinstance(ttl, int)
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired")
        return ttl

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease, -1 if it does not exist."""
        resp = await self._call(self._lease.LeaseTimeToLive(pb.LeaseTimeToLiveRequest(ID=lease_id)))
        return int(resp.TTL)  # type: ignore[attr-defined]

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Stream changes under ``prefix`` from ``start_revision`` (inclusive).

        Progress notifications arrive as empty batches so the caller's revision keeps moving.
        Raises WatchCompacted when the start revision is gone and StoreUnavailable when the
        stream breaks; the caller resumes from its last revision + 1.
        """
        request = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=prefix,
                range_end=prefix_end(prefix),
                start_revision=start_revision,
                progress_notify=True,
            )
        )
        call = self._watch.Watch()
        try:
            await call.write(request)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise StoreUnavailable("etcd closed the watch stream")
                if resp.compact_revision:
                    raise WatchCompacted(int(resp.compact_revision))
                if resp.canceled:
                    raise StoreUnavailable(f"watch cancelled by etcd: {resp.cancel_reason}")
                if resp.created and not resp.events:
                    # Its header revision is etcd's current one, not how far this watch has
                    # caught up: reporting it would let readers see a future they lack.
                    continue
                events = tuple(WatchEvent(EventType(ev.type), _kv(ev.kv)) for ev in resp.events)
                yield WatchBatch(int(resp.header.revision), events)
        except grpc.aio.AioRpcError as exc:
            raise StoreUnavailable(f"watch stream failed: {exc.code().name}") from exc
        finally:
            call.cancel()


class LeaseKeeper:
    """Keeps one lease alive in the background (every ttl/3) and reports its loss.

    ``lost`` is set when etcd says the lease is gone, or when it could not be refreshed
    for longer than its TTL; the owner must then stop acting on it.
    """

    def __init__(self, etcd: EtcdClient, lease_id: int, ttl: int) -> None:
        self._etcd = etcd
        self.lease_id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while not self.lost.is_set():
            try:
                await self._etcd.keepalive_once(self.lease_id)
                last_ok = loop.time()
            except LeaseExpired:
                log.error("lease %x expired", self.lease_id)
                self.lost.set()
                return
            except StoreUnavailable as exc:
                if loop.time() - last_ok > self.ttl:
                    log.error("lease %x not refreshed for %.1f s: %s", self.lease_id, self.ttl, exc)
                    self.lost.set()
                    return
                log.warning("lease %x keepalive failed, retrying: %s", self.lease_id, exc)
                await asyncio.sleep(min(0.2, self.ttl / 10))
                continue
            await asyncio.sleep(self.ttl / 3)
