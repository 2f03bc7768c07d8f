"""etcd leases: grant, revoke, and refresh over one keepalive stream per lease
(:class:`Leases`, part of :class:`~.client.EtcdClient`), and :class:`LeaseKeeper`, which keeps
one lease alive in the background."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2 as pb

from timeslice_orchestrator.store.etcd.errors import LeaseExpired, StoreUnavailable
from timeslice_orchestrator.store.etcd.members import (
    REQUIRE_LEADER,
    Members,
    _EndedByProbe,
    _Member,
)

log = logging.getLogger(__name__)


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


class Leases(Members):
    """The lease calls of :class:`~.client.EtcdClient`, and the keepalive streams they keep."""

    _keepalives: dict[int, _LeaseStream]
    _swept_at: float

    def _init_leases(self) -> None:
        self._keepalives = {}
        self._swept_at = 0.0

    def _close_keepalives(self) -> None:
        for stream in self._keepalives.values():
            stream.close()
        self._keepalives.clear()

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


class LeaseKeeper:
    """Keeps one lease alive in the background (every ttl/3, over one keepalive stream) and
    reports its loss.

    ``lost`` is set when etcd says the lease is gone, or when it could not be refreshed
    for longer than its TTL (or when the keeper ends for any other reason: a lease nobody
    refreshes cannot be relied on); the owner must then stop acting on it. ``failing`` says
    that the last refresh did not go through (etcd is away, the lease may soon be lost).
    """

    def __init__(self, etcd: Leases, lease_id: int, ttl: int) -> None:
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
