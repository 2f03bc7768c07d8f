"""The client API (TimeSlice service): thin handlers over LockService.

Typed errors become gRPC statuses with the kind in their status details (timeslice.errors).

Who may call what (:mod:`.authz`): calls on a session carry its secret, checked by
LockService; operator RPCs (SetGroupMembers, the Yield that names no session) are served by
handlers that see the call's stream, hence its metadata and peer (``__mapping__``).

Who may read what (:mod:`.visibility`): the group reads (ListGroups, GetGroupStatus,
WatchGroup) are scoped by the caller's identity; their handlers learn first, from the stream,
whether the caller is an operator (certificate or token).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpclib
import grpclib.server
from grpclib.const import Handler, Status
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer

from timeslice import AcquireStage
from timeslice.errors import ErrorKind, PermissionDenied, ResourceExhausted, TimeSliceError
from timeslice.ids import validate_group_id
from timeslice.tracing import context_from
from timeslice_orchestrator import identity, visibility
from timeslice_orchestrator.admission import Admission
from timeslice_orchestrator.authz import Authorizer, peer_of
from timeslice_orchestrator.limits import Limits, Quotas
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.rpc import Call, encoded_off_loop, served
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.keys import group_topic
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import AgentRecord, hold_epoch
from timeslice_orchestrator.visibility import Reach, Viewer
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    CloseSessionRequest,
    CloseSessionResponse,
    FaultedJob,
    GetGroupStatusRequest,
    GroupEvent,
    GroupStatus,
    GroupSummary,
    JobUsage,
    KeepAliveRequest,
    KeepAliveResponse,
    ListGroupsRequest,
    ListGroupsResponse,
    NodeResidency,
    OpenSessionRequest,
    OpenSessionResponse,
    QueueEntry,
    SetGroupMembersRequest,
    SwitchPhase,
    SwitchStatus,
    TimeSliceBase,
    WatchGroupRequest,
    YieldRequest,
    YieldResponse,
    YieldStreamReply,
)

log = logging.getLogger(__name__)

# A listing of every group reads this many between two turns of the event loop.
LIST_SLICE = 2000
# The viewer of the group read being handled (set from its stream: see __mapping__).
_viewer: contextvars.ContextVar[Viewer | None] = contextvars.ContextVar(
    "timeslice_viewer", default=None
)


class TimeSliceService(TimeSliceBase):
    def __init__(
        self,
        locks: LockService,
        mirror: Mirror,
        metrics: Metrics,
        tracer: Tracer,
        authz: Authorizer | None = None,
        quotas: Quotas | None = None,
        admission: Admission | None = None,
        strict_groups: bool = False,
    ) -> None:
        self._locks = locks
        # --strict-groups: an Acquire of a group that is not known is refused (NOT_FOUND)
        # whatever the client asks; else only clients that ask (AcquireRequest.strict_groups).
        self._strict_groups = strict_groups
        # Admits each yield of a YieldStream as the Yield call it stands for (the stream
        # itself is admitted once, when it opens).
        self._admission = admission
        self._quotas = quotas if quotas is not None else Quotas(Limits(), mirror)
        self._mirror = mirror
        self._metrics = metrics
        self._tracer = tracer
        # No authorizer: no operator identity exists, so operator RPCs are refused.
        self._authz = authz or Authorizer(metrics)

    def __mapping__(self) -> dict[str, Handler]:
        """The generated handlers, except those that need the caller's identity: they get
        the stream (metadata, peer) before the request is acted on."""
        mapping = super().__mapping__()
        for method, handler in (
            ("SetGroupMembers", self._rpc_set_group_members),
            ("Yield", self._rpc_yield),
            ("YieldStream", self._rpc_yield_stream),
        ):
            name = f"/{_SERVICE}/{method}"
            generated = mapping[name]
            mapping[name] = Handler(
                handler, generated.cardinality, generated.request_type, generated.reply_type
            )
        for method in _READS:
            name = f"/{_SERVICE}/{method}"
            generated = mapping[name]
            mapping[name] = Handler(
                self._scoped(generated.func),
                generated.cardinality,
                generated.request_type,
                generated.reply_type,
            )
        return mapping

    def _scoped(
        self, handler: Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]
    ) -> Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]:
        """``handler`` run with its caller's viewer known (an operator token is in the
        stream's metadata, which the generated handler does not pass on)."""

        async def scoped(stream: grpclib.server.Stream[Any, Any]) -> None:
            who = visibility.viewer_of(identity.current(), operator=self._authz.is_operator(stream))
            token = _viewer.set(who)
            try:
                await handler(stream)
            finally:
                _viewer.reset(token)

        return scoped

    @staticmethod
    def _viewer() -> Viewer:
        """Who reads: as :meth:`_scoped` found, else from the certificate alone."""
        return _viewer.get() or visibility.viewer_of(identity.current())

    def _call(
        self,
        method: str,
        group: str = "",
        job: str = "",
        peer: str = "",
        parent: Context | None = None,
    ) -> contextlib.AbstractContextManager[Span]:
        """The RPC's server span; typed errors out, refusals counted by the authorizer."""

        def refused(exc: TimeSliceError) -> None:
            if exc.kind is ErrorKind.PERMISSION_DENIED and method in _READS:
                self._authz.refused(method, "reading groups without a job or operator identity")
            elif exc.kind in _REFUSALS:
                self._authz.refused(method, _REFUSALS[exc.kind], peer)

        call = Call(_SERVICE, method, group, job)
        return served(call, self._tracer, self._metrics, on_error=refused, parent=parent)

    async def open_session(self, message: OpenSessionRequest) -> OpenSessionResponse:
        with self._call("OpenSession", job=message.job_id):
            identity.check_job(message.job_id, "OpenSession")
            self._quotas.open_session(message.job_id)
            sid, secret, ttl = await self._locks.open_session(
                message.job_id, message.ttl_seconds, message.client_host, message.client_pid
            )
        return OpenSessionResponse(session_id=sid, ttl_seconds=ttl, session_secret=secret)

    async def keep_alive(self, message: KeepAliveRequest) -> KeepAliveResponse:
        with self._call("KeepAlive"):
            ttl, asked = await self._locks.keepalive(message.session_id, message.session_secret)
        return KeepAliveResponse(ttl_seconds=ttl, yield_requested=asked)

    async def close_session(self, message: CloseSessionRequest) -> CloseSessionResponse:
        with self._call("CloseSession"):
            await self._locks.close_session(message.session_id, message.session_secret)
        return CloseSessionResponse()

    async def acquire(self, message: AcquireRequest) -> AsyncIterator[AcquireEvent]:
        grant: Progress | None = None
        delivered = False
        viewer = self._viewer()
        try:
            with self._call("Acquire", message.group_id, message.job_id) as span:
                identity.check_job(message.job_id, "Acquire")
                self._quotas.acquire(message.session_id, message.job_id, message.group_id)
                progress = self._locks.acquire(
                    message.session_id,
                    message.job_id,
                    message.group_id,
                    message.priority,
                    message.request_id,
                    secret=message.session_secret,
                    strict=self._strict_groups or message.strict_groups,
                    warn=True,
                )
                async with contextlib.aclosing(progress):
                    async for step in progress:
                        if step.stage is AcquireStage.GRANTED:
                            grant = step
                            span.set_attributes(
                                {
                                    "timeslice.epoch": step.epoch,
                                    "timeslice.restored": step.restored,
                                    "timeslice.waited_seconds": step.waited_seconds,
                                }
                            )
                        yield _event(step, viewer)
                        # Resumed: the framework sent the event and asked for more.
                        delivered = grant is not None
        finally:
            if grant is not None and not delivered:
                await self._locks.release_unsent(
                    message.group_id, message.job_id, message.session_id, grant
                )

    async def yield_(self, message: YieldRequest) -> YieldResponse:
        # grpclib calls _rpc_yield (see __mapping__); without a stream, nobody is an operator.
        return await self._yield(message, operator=False)

    async def _rpc_yield(self, stream: grpclib.server.Stream[YieldRequest, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        # Only a yield that names no session asks for the operator's authority.
        operator = not request.session_id
        if operator:
            self._require_operator(stream, "Yield")
        parent = context_from(request.trace_context)  # else the metadata's, as for any call
        await stream.send_message(await self._yield(request, operator, peer_of(stream), parent))

    async def yield_stream(
        self, messages: AsyncIterator[YieldRequest]
    ) -> AsyncIterator[YieldStreamReply]:
        # grpclib calls _rpc_yield_stream (see __mapping__).
        async for message in messages:
            yield await self._streamed_yield(message, None, "")

    async def _rpc_yield_stream(self, stream: grpclib.server.Stream[YieldRequest, Any]) -> None:
        peer = peer_of(stream)
        address = stream.peer.addr()
        self._metrics.yield_streams.inc()
        try:
            async for request in stream:
                await stream.send_message(await self._streamed_yield(request, address, peer))
        finally:
            self._metrics.yield_streams.dec()

    async def _streamed_yield(
        self, request: YieldRequest, address: Any, peer: str
    ) -> YieldStreamReply:
        """One Yield carried by a YieldStream: the same checks and effects (an operator yield,
        without a session, is refused as it is without an operator identity), answered with
        the status the Yield call would have ended with."""
        ticket = None
        if self._admission is not None and self._admission.enabled:
            try:
                ticket = await self._admission.admit_message(address, "Yield")
            except ResourceExhausted as exc:
                return YieldStreamReply(
                    status=exc.status.value, message=exc.message, kind=exc.kind.name
                )
        status: Status | None = Status.UNKNOWN
        try:
            try:
                # Its parent is the job's span the request names (or none): the stream's own
                # context is that of whichever yield opened it.
                parent = context_from(request.trace_context) or Context()
                await self._yield(request, operator=False, peer=peer, parent=parent)
            except grpclib.GRPCError as exc:
                status = exc.status
                kind = exc.details.name if isinstance(exc.details, ErrorKind) else ""
                return YieldStreamReply(
                    status=exc.status.value, message=exc.message or "", kind=kind
                )
            status = None
            return YieldStreamReply(status=Status.OK.value)
        finally:
            if ticket is not None:
                assert self._admission is not None
                self._admission.done(ticket, status)

    async def _yield(
        self,
        message: YieldRequest,
        operator: bool,
        peer: str = "",
        parent: Context | None = None,
    ) -> YieldResponse:
        with self._call("Yield", message.group_id, message.job_id, peer, parent):
            if not operator:
                identity.check_job(message.job_id, "Yield")
            await self._locks.release(
                message.session_id,
                message.job_id,
                message.group_id,
                message.epoch,
                secret=message.session_secret,
                operator=operator,
            )
        return YieldResponse()

    async def list_groups(self, message: ListGroupsRequest) -> ListGroupsResponse:
        with self._call("ListGroups"):
            viewer = self._viewer()
            viewer.check_reads("ListGroups")
            groups = await (self._summaries() if viewer.reach is Reach.ALL else self._own(viewer))
            return await encoded_off_loop(ListGroupsResponse(groups=groups))

    async def _own(self, viewer: Viewer) -> list[GroupSummary]:
        """The summaries of a job's own groups, other jobs' ids replaced."""
        return [
            GroupSummary(
                group_id=view.group,
                holder_job_id=viewer.name(view.holder.record.job if view.holder else ""),
                queue_length=len(view.queue),
                switching=view.switch is not None,
            )
            for view in await own_groups(self._mirror, viewer)
        ]

    async def _summaries(self) -> list[GroupSummary]:
        """Every group's summary (not its whole view: a deployment may list 100,000 groups),
        read in slices with the replica's other work let through between them. A group that
        changes meanwhile shows as its slice found it: a listing is an overview, not one
        snapshot."""
        groups = []
        for n, name in enumerate(self._mirror.group_names(), 1):
            if n % LIST_SLICE == 0:
                await asyncio.sleep(0)
            if not self._mirror.has_group(name):
                continue  # deleted since the names were read
            holder, queued, switching = self._mirror.summary(name)
            groups.append(
                GroupSummary(
                    group_id=name,
                    holder_job_id=holder.job if holder else "",
                    queue_length=queued,
                    switching=switching,
                )
            )
        return groups

    async def get_group_status(self, message: GetGroupStatusRequest) -> GroupStatus:
        with self._call("GetGroupStatus", message.group_id):
            return self._status(message.group_id, self._viewer(), "GetGroupStatus")

    def _status(
        self, group: str, viewer: Viewer = visibility.EVERYTHING, what: str = ""
    ) -> GroupStatus:
        agents = self._mirror.agents()
        view = read_view(self._locks, self._mirror, viewer, group, agents, what)
        status = group_status(view, self._mirror, agents)
        status.policy = self._locks.policy.value
        return visibility.scoped_status(viewer, status)

    async def _rpc_set_group_members(
        self, stream: grpclib.server.Stream[SetGroupMembersRequest, Any]
    ) -> None:
        """SetGroupMembers for operators only; a stranger's request is not even read."""
        self._require_operator(stream, "SetGroupMembers")
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(await self.set_group_members(request))

    def _require_operator(self, stream: grpclib.server.Stream[Any, Any], method: str) -> None:
        """Refuse (PERMISSION_DENIED, counted, logged once) a caller who is no operator."""
        if self._authz.is_operator(stream):
            return
        self._metrics.rpc_errors.labels(kind=ErrorKind.PERMISSION_DENIED.value).inc()
        self._authz.refused(method, "no operator identity", peer_of(stream))
        raise PermissionDenied(
            f"{method} needs an operator identity (metadata authorization: Bearer <operator token>)"
        ).to_grpc()

    async def set_group_members(self, message: SetGroupMembersRequest) -> GroupStatus:
        """Pin nodes; grpclib reaches it only through :meth:`_rpc_set_group_members`."""
        with self._call("SetGroupMembers", message.group_id):
            self._quotas.set_members(message.group_id, list(message.nodes))
            await self._locks.set_members(message.group_id, list(message.nodes))
            return self._status(message.group_id)

    async def watch_group(self, message: WatchGroupRequest) -> AsyncIterator[GroupEvent]:
        viewer, group = self._viewer(), message.group_id
        with self._call("WatchGroup", group):
            agents = self._mirror.agents()
            view = read_view(self._locks, self._mirror, viewer, group, agents, "WatchGroup")
        topic = group_topic(view.group)
        while True:
            seen = self._mirror.version(topic)
            view = self._mirror.group(view.group)
            agents = self._mirror.agents()
            if not viewer.sees(view, agents) and viewer.reach is not Reach.ALL:
                # No longer the job's (its last record there went): what opening it would get.
                gone = visibility.hidden(view.group, viewer)
                raise gone.to_grpc()
            status = visibility.scoped_status(viewer, group_status(view, self._mirror, agents))
            yield GroupEvent(revision=view.revision, status=status)
            await self._mirror.wait_for_change(topic, seen)


_SERVICE = "timeslice.v1.TimeSlice"
# The group reads, scoped by the caller's identity (:mod:`.visibility`).
_READS = ("ListGroups", "GetGroupStatus", "WatchGroup")
# Typed errors that refuse a caller for who it is, and the cause each is counted under.
_REFUSALS = {
    ErrorKind.UNAUTHENTICATED: "session secret missing or wrong",
    ErrorKind.PERMISSION_DENIED: "acting for another job or session",
}


def read_view(
    locks: LockService,
    mirror: Mirror,
    viewer: Viewer,
    group: str,
    agents: dict[str, AgentRecord],
    what: str,
) -> GroupView:
    """The group ``viewer`` asks ``what`` of: PERMISSION_DENIED for a caller that reads no
    groups; NOT_FOUND, the same, for a job's read of a group that does not exist and of one
    that is not the job's."""
    viewer.check_reads(what)
    if viewer.reach is Reach.ALL:
        return locks.view(group)
    validate_group_id(group)
    view = mirror.group(group)
    if not viewer.sees(view, agents):
        raise visibility.hidden(group, viewer)
    return view


async def own_groups(mirror: Mirror, viewer: Viewer) -> list[GroupView]:
    """The groups ``viewer`` (a job) may read, by name, in slices with the replica's other
    work let through between them, as an operator's listing is. Only a group whose keys or
    values name the job (or where a worker of it is registered) is decoded to tell: a job
    id recorded anywhere in a group is in its bytes as is (ids are plain ASCII)."""
    agents = mirror.agents()
    registered = {w.group for a in agents.values() for w in a.workers if w.job == viewer.job}
    needle = viewer.job.encode()
    views = []
    for n, name in enumerate(mirror.group_names(), 1):
        if n % LIST_SLICE == 0:
            await asyncio.sleep(0)
        if name not in registered and not mirror.mentions(name, needle):
            continue
        view = mirror.group(name)
        if viewer.sees(view, agents):
            views.append(view)
    return views


def _event(step: Progress, viewer: Viewer) -> AcquireEvent:
    return AcquireEvent(
        state=step.stage.to_wire(),
        queue_position=step.position,
        epoch=step.epoch,
        waited_seconds=step.waited_seconds,
        restored=step.restored,
        previous_job_id=viewer.name(step.previous_job),
        switch_seconds=step.switch_seconds,
        ticket=step.ticket,
        warning=step.warning,
    )


_PHASE = {
    "checkpoint": SwitchPhase.CHECKPOINT,
    "restore": SwitchPhase.RESTORE,
    "rollback": SwitchPhase.ROLLBACK,
}


def group_status(
    view: GroupView, mirror: Mirror, agents: dict[str, AgentRecord] | None = None
) -> GroupStatus:
    """The group as timeslice.v1 states it (``agents``: the mirror's, if already read)."""
    agents = mirror.agents() if agents is None else agents
    resident = view.residency().nodes
    nodes = sorted(
        set(resident)
        | set(view.static_members)
        | {n for n, a in agents.items() if any(w.group == view.group for w in a.workers)}
    )
    status = GroupStatus(
        group_id=view.group,
        queue=[
            QueueEntry(
                job_id=q.job,
                priority=q.entry.record.priority,
                enqueued_at=q.entry.record.enqueued_at,
                revision=q.revision,
            )
            for q in view.queue
        ],
        nodes=[
            NodeResidency(
                node=n,
                resident_job_id=(resident.get(n) or [""])[-1],
                resident_jobs=resident.get(n, []),
                # From the agent's registration, so every view can label emulated figures.
                backend=agents[n].backend if n in agents else "",
                emulated=agents[n].emulated if n in agents else False,
            )
            for n in nodes
        ],
        faulted=[
            FaultedJob(job_id=j, reason=f.record.reason) for j, f in sorted(view.faults.items())
        ],
        last_error=view.stats.last_error,
        switches=view.stats.switches,
        driver_replica=view.driver or "",
        static_members=list(view.static_members),
        missing_members=[n for n in view.static_members if n not in agents],
        usage=[
            JobUsage(
                job_id=job,
                held_seconds=u.held_seconds,
                holds=u.holds,
                first_seen=u.first_seen,
                last_seen=u.last_seen,
            )
            for job, u in sorted((view.usage.record.jobs if view.usage else {}).items())
        ],
    )
    if view.holder is not None:
        status.holder_job_id = view.holder.record.job
        status.holder_epoch = hold_epoch(view.holder)
        status.held_since = view.holder.record.granted_at
    if view.switch is not None:
        s = view.switch.record
        status.switch = SwitchStatus(
            switch_id=s.switch_id,
            epoch=view.switch.create_revision,
            from_job_id=",".join(s.from_jobs),
            to_job_id=s.to_job,
            phase=_PHASE[s.phase.value],
            started_at=s.started_at,
        )
    return status
