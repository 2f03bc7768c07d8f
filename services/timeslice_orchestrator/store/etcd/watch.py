"""etcd watches: a stream of changes under a prefix from a revision, moved off a member that
fails and probed while it is silent (:class:`Watches`, part of :class:`~.client.EtcdClient`)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2 as pb

from timeslice_orchestrator.store.etcd.errors import StoreUnavailable, WatchCompacted, WatchTooLarge
from timeslice_orchestrator.store.etcd.members import (
    _MEMBER_FAULTS,
    REQUIRE_LEADER,
    Members,
    _Member,
    _server_timeout,
)
from timeslice_orchestrator.store.etcd.ops import KeyValue, _kv, prefix_end

log = logging.getLogger(__name__)

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


class Watches(Members):
    """The watch calls of :class:`~.client.EtcdClient`."""

    _watching: _Member | None  # the member the latest watch was opened on

    def _init_watches(self) -> None:
        self._watching = None

    def pass_over_watch_member(self, why: str) -> None:
        """Pass over the member the latest watch runs on, as if it had failed (a watch that
        looks stuck there): its watches move, and calls prefer the other members a while."""
        if self._watching is not None:
            self._failed(self._watching, why)

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
