"""The llm-d reference's orchestrator API (``timeslice_orchestrator.v1alpha1``), served on
the same port as ``timeslice.v1`` so that its users switch by changing the address only.

Thin handlers over :class:`LockService`: the same etcd transactions, fencing, driver and
tracing as our own API. What v1alpha1 lacks, we add without changing the wire
(docs/migrating-from-llm-d.md):

- **Implicit sessions.** A v1alpha1 client has no session and no keepalive, so each job gets
  one implicit session per HTTP/2 connection, with TTL ``--compat-hold-ttl``. A supervised
  task renews it while any connection it is attached to stays open (and at once on every
  call of the job); when the connections close it stops, so the job's holds and queue
  entries (on that session's lease) lapse at most TTL seconds after the client is gone.
- **Failover.** A client that re-calls Acquire on another replica finds its queue entry or
  hold under the implicit session of the replica it left; the call adopts that session
  (attaches it to the new connection and keeps it alive from here), so the job keeps its
  place in line and never holds or queues twice.
- **Waiters that leave, leave.** A blocked Acquire whose call ends (deadline, cancel, dropped
  connection) is cancelled by grpclib; LockService's generator withdraws its queue entry.

An implicit session's secret is derived from a nonce in its own record, so another replica
can adopt it: it protects nothing beyond what v1alpha1 itself does (any client that reaches
the port may act as any job, as in the reference), while a TLS job identity is still checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpclib
import grpclib.server
from grpclib.const import Handler, Status
from grpclib.protocol import Connection
from opentelemetry.trace import Span, Tracer

from timeslice import AcquireStage
from timeslice.errors import (
    GroupFaulted,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    TimeSliceError,
    Unavailable,
)
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.tasks import Supervisor
from timeslice_orchestrator import identity, visibility
from timeslice_orchestrator.api import own_groups, read_view
from timeslice_orchestrator.authz import secret_hash
from timeslice_orchestrator.limits import Quotas
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.rpc import Call, encoded_off_loop, served
from timeslice_orchestrator.store.etcd import StoreError
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import AgentRecord, HolderRecord, Stored, hold_epoch
from timeslice_proto.timeslice_orchestrator.v1alpha1 import (
    AcquireRequest,
    AcquireResponse,
    GetGroupStatusRequest,
    GetGroupStatusResponse,
    GroupStatus,
    GroupStatusState,
    ListGroupsRequest,
    ListGroupsResponse,
    SnapshotAgentJobState,
    SnapshotAgentJobStateState,
    TimeSliceOrchestratorServiceBase,
    YieldRequest,
    YieldResponse,
)

log = logging.getLogger(__name__)

SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
# The host field of an implicit session's record: the marker, then the nonce of its secret.
IMPLICIT_HOST = "v1alpha1-compat/"


@dataclass(eq=False)
class _Implicit:
    """One implicit session kept alive by this replica."""

    session_id: str
    job: str
    secret: str
    connections: set[Connection] = field(default_factory=set)
    poke: asyncio.Event = field(default_factory=asyncio.Event)


def _secret(nonce: str) -> str:
    return hashlib.sha256(f"timeslice-compat-v1alpha1:{nonce}".encode()).hexdigest()


def _connection(stream: grpclib.server.Stream[Any, Any]) -> Connection:
    """The HTTP/2 connection a call came on (grpclib keeps it behind the stream)."""
    conn = getattr(getattr(stream, "_stream", None), "connection", None)
    if not isinstance(conn, Connection):
        raise Unavailable("cannot tell the connection of this call")
    return conn


class CompatService(TimeSliceOrchestratorServiceBase):
    def __init__(
        self,
        locks: LockService,
        store: GroupStore,
        mirror: Mirror,
        metrics: Metrics,
        tracer: Tracer,
        quotas: Quotas,
        tasks: Supervisor,
        hold_ttl: int,
    ) -> None:
        self._locks = locks
        self._store = store
        self._mirror = mirror
        self._metrics = metrics
        self._tracer = tracer
        self._quotas = quotas
        self._tasks = tasks
        self._ttl = hold_ttl
        self._implicit: dict[str, _Implicit] = {}  # by session id
        self._by_connection: dict[tuple[Connection, str], str] = {}  # (connection, job)
        self._opening = asyncio.Lock()

    def __mapping__(self) -> dict[str, Handler]:
        """Acquire and Yield see their stream: the connection is what keeps a hold alive."""
        mapping = super().__mapping__()
        for method, handler in (("Acquire", self._rpc_acquire), ("Yield", self._rpc_yield)):
            name = f"/{SERVICE}/{method}"
            generated = mapping[name]
            mapping[name] = Handler(
                handler, generated.cardinality, generated.request_type, generated.reply_type
            )
        return mapping

    def _call(
        self, method: str, group: str = "", job: str = ""
    ) -> contextlib.AbstractContextManager[Span]:
        """One server span per RPC and typed errors out, as timeslice.v1's handlers do."""
        return served(Call(SERVICE, method, group, job), self._tracer, self._metrics, _status_of)

    # -- RPCs -----------------------------------------------------------------------------

    async def _rpc_acquire(self, stream: grpclib.server.Stream[AcquireRequest, Any]) -> None:
        started = time.monotonic()
        request = await stream.recv_message()
        assert request is not None
        job, group = request.job_id, request.group_id
        grant: Progress | None = None
        session = ""
        with self._call("Acquire", group, job) as span:
            validate_job_id(job)
            validate_group_id(group)
            identity.check_job(job, "Acquire")
            conn = _connection(stream)
            holder = await self._holder(group)
            if holder is not None and holder.record.job == job:
                # Idempotent; a hold under an implicit session now lives on this connection
                # too (a hold under a timeslice.v1 session stays that session's).
                async with self._opening:
                    adopted = await self._adopted(holder.record.session, job)
                    if adopted is not None:
                        self._bind(adopted, job, conn)
            else:
                queued = self._mirror.group(group).queued(job)
                adopt = queued.entry.record.session if queued is not None else ""
                implicit = await self._attach(job, conn, adopt=adopt)
                session = implicit.session_id
                self._quotas.acquire(session, job, group)
                grant = await self._granted(implicit, group)
                span.set_attributes(
                    {"timeslice.epoch": grant.epoch, "timeslice.restored": grant.restored}
                )
        response = AcquireResponse(
            success=True,
            waited_ms=int((time.monotonic() - started) * 1000),
            context_restored=grant.restored if grant is not None else False,
        )
        try:
            await stream.send_message(response)
        except BaseException:
            if grant is not None:  # the client left as it was granted: give the grant back
                await self._locks.release_unsent(group, job, session, grant)
            raise

    async def _granted(self, implicit: _Implicit, group: str) -> Progress:
        """Wait for the grant; leaving early (the call is cancelled) withdraws the entry."""
        progress = self._locks.acquire(
            implicit.session_id, implicit.job, group, 0, secret=implicit.secret
        )
        async with contextlib.aclosing(progress):
            async for step in progress:
                if step.stage is AcquireStage.GRANTED:
                    return step
        raise Unavailable(f"the acquire of {group} ended without a grant")

    async def _rpc_yield(self, stream: grpclib.server.Stream[YieldRequest, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        job, group = request.job_id, request.group_id
        with self._call("Yield", group, job):
            validate_job_id(job)
            validate_group_id(group)
            identity.check_job(job, "Yield")
            self._renew(job, _connection(stream))
            holder = await self._holder(group)
            if holder is None and not await self._exists(group):
                raise NotFound(f"group {group} does not exist")
            pending = len(self._mirror.group(group).queue)
            if holder is not None:
                if holder.record.job != job:
                    # Named to those who may read it (operators, plaintext); a job reads
                    # another tenant as such (visibility.py).
                    holder_job = visibility.viewer_of(identity.current()).name(holder.record.job)
                    raise PermissionDenied(
                        f"job {job} does not hold {group} (held by {holder_job})"
                    )
                # v1alpha1 has no session secret: the operator path, by job and epoch, after
                # the identity check above (a TLS job certificate must be this job's).
                with contextlib.suppress(NotHolder):  # it lapsed meanwhile: nobody holds
                    await self._locks.release(
                        "", job, group, hold_epoch(holder), secret="", operator=True
                    )
        await stream.send_message(
            YieldResponse(success=True, pending_waiters=pending, snapshot_deferred=pending == 0)
        )

    async def list_groups(self, message: ListGroupsRequest) -> ListGroupsResponse:
        """Every group to an operator; a job's own groups to a job (:mod:`.visibility`)."""
        with self._call("ListGroups"):
            viewer = visibility.viewer_of(identity.current())
            viewer.check_reads("ListGroups")
            if viewer.reach is visibility.Reach.ALL:
                names = self._mirror.group_names()
            else:
                names = [view.group for view in await own_groups(self._mirror, viewer)]
            return await encoded_off_loop(ListGroupsResponse(group_ids=names))

    async def get_group_status(self, message: GetGroupStatusRequest) -> GetGroupStatusResponse:
        """The group as v1alpha1 states it, other jobs' ids replaced for a job."""
        group = message.group_id
        with self._call("GetGroupStatus", group):
            viewer = visibility.viewer_of(identity.current())
            agents = self._mirror.agents()
            view = read_view(self._locks, self._mirror, viewer, group, agents, "GetGroupStatus")
            return visibility.scoped_v1alpha1(viewer, group_status(view, agents))

    # -- implicit sessions ----------------------------------------------------------------

    async def _holder(self, group: str) -> Stored[HolderRecord] | None:
        """The group's hold as etcd has it now: the mirror may not show yet a yield or grant
        just made through another replica (or handed over here)."""
        return await self._store.current_holder(group)

    async def _exists(self, group: str) -> bool:
        if self._mirror.group(group).exists:
            return True
        return await self._store.group_exists(group)

    def _renew(self, job: str, conn: Connection) -> None:
        """A call of ``job``: renew its implicit session on ``conn`` now (if it has one)."""
        implicit = self._implicit.get(self._by_connection.get((conn, job), ""))
        if implicit is not None:
            implicit.poke.set()

    async def _attach(self, job: str, conn: Connection, *, adopt: str) -> _Implicit:
        """The implicit session of ``job`` on ``conn``: ``adopt`` (the session of its entry or
        hold, if implicit), else the one it has here, else a new one."""
        async with self._opening:
            implicit = await self._adopted(adopt, job) if adopt else None
            if implicit is None:
                known = self._implicit.get(self._by_connection.get((conn, job), ""))
                implicit = known or await self._open(job)
            self._bind(implicit, job, conn)
            return implicit

    def _bind(self, implicit: _Implicit, job: str, conn: Connection) -> None:
        implicit.connections.add(conn)
        self._by_connection[(conn, job)] = implicit.session_id
        implicit.poke.set()  # renewed now: every call of the job renews its session

    async def _adopted(self, session_id: str, job: str) -> _Implicit | None:
        """The implicit session ``session_id`` of ``job``, kept alive from here from now on
        (None: not an implicit session of that job, or gone)."""
        implicit = self._implicit.get(session_id)
        if implicit is not None:
            return implicit
        stored = self._mirror.session(session_id)
        if stored is None:  # just opened through another replica: not in the mirror yet
            try:
                stored = await self._store.session(session_id)
            except (SessionExpired, InvalidArgument):
                return None
        if stored.record.job != job:
            return None
        host = stored.record.host
        if not host.startswith(IMPLICIT_HOST):
            return None
        implicit = _Implicit(session_id, job, _secret(host[len(IMPLICIT_HOST) :]))
        self._keep(implicit)
        log.info("adopted implicit session %s of job %s", session_id, job)
        return implicit

    async def _open(self, job: str) -> _Implicit:
        self._quotas.open_session(job)
        nonce = secrets.token_hex(16)
        secret = _secret(nonce)
        sid = await self._store.open_session(
            job, self._ttl, IMPLICIT_HOST + nonce, 0, secret_hash=secret_hash(secret)
        )
        implicit = _Implicit(sid, job, secret)
        self._keep(implicit)
        return implicit

    def _keep(self, implicit: _Implicit) -> None:
        self._implicit[implicit.session_id] = implicit
        self._tasks.spawn(
            self._keepalive(implicit), f"compat-session-{implicit.session_id}", kind="compat"
        )

    async def _keepalive(self, implicit: _Implicit) -> None:
        """Renew while a connection of the session is open (and on each call); then stop, so
        the session lapses at most TTL seconds after its last connection closed."""
        interval = self._ttl / 3
        try:
            while True:
                # asyncio.timeout: wait_for (3.11) can lose a cancel that comes as it ends.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await implicit.poke.wait()
                implicit.poke.clear()
                closed = {c for c in implicit.connections if c.is_closing()}
                for conn in closed:
                    self._by_connection.pop((conn, implicit.job), None)
                implicit.connections -= closed
                if not implicit.connections:
                    log.info(
                        "implicit session %s of job %s: its connections closed, it lapses "
                        "within %d s",
                        implicit.session_id,
                        implicit.job,
                        self._ttl,
                    )
                    return
                try:
                    async with asyncio.timeout(interval):
                        await self._store.keepalive(implicit.session_id)
                except SessionExpired:
                    return
                except (StoreError, TimeoutError, Unavailable) as exc:
                    log.info("renewing implicit session %s: %s", implicit.session_id, exc)
        finally:
            self._forget(implicit)

    def _forget(self, implicit: _Implicit) -> None:
        if self._implicit.get(implicit.session_id) is implicit:
            del self._implicit[implicit.session_id]
        for key in [k for k, sid in self._by_connection.items() if sid == implicit.session_id]:
            del self._by_connection[key]


def _status_of(exc: TimeSliceError) -> Status:
    # The reference answers UNAVAILABLE for a faulted group.
    return Status.UNAVAILABLE if isinstance(exc, GroupFaulted) else exc.status


def _timestamp(seconds: float) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if seconds > 0 else None


def _loaded(resident: dict[str, list[str]], holder: str) -> str:
    """The job whose state is on the group's devices: the holder if it is, else the job that
    ran last on the first node."""
    if holder and any(holder in jobs for jobs in resident.values()):
        return holder
    return next((jobs[-1] for _, jobs in sorted(resident.items()) if jobs), "")


def group_status(view: GroupView, agents: dict[str, AgentRecord]) -> GetGroupStatusResponse:
    """The group as v1alpha1 states it (docs/migrating-from-llm-d.md, "status")."""
    resident = view.residency().nodes
    holder = view.holder.record if view.holder is not None else None
    switch = view.switch.record if view.switch is not None else None
    if switch is not None and switch.prefetch:
        switch = None  # a prefetch moves a waiter's state in while the holder runs on
    holder_job = holder.job if holder is not None else ""
    loaded = _loaded(resident, holder_job)
    stamp: float = 0.0
    if switch is not None:
        state, locking, active, stamp = (
            GroupStatusState.SWITCHING,
            switch.to_job,
            "",
            switch.started_at,
        )
    elif holder is not None:
        in_place = not any(resident.values()) or all(
            holder.job in jobs for jobs in resident.values() if jobs
        )
        state = GroupStatusState.LOCKED if in_place else GroupStatusState.SWITCHING
        locking, active, stamp = holder.job, holder.job if in_place else "", holder.granted_at
    else:
        state = GroupStatusState.IDLE_YIELDED if loaded else GroupStatusState.IDLE
        locking = active = ""
        usage = view.usage.record.jobs if view.usage is not None else {}
        stamp = max((u.last_seen for u in usage.values()), default=0.0)
    moving: set[tuple[str, str]] = set()
    if switch is not None:
        for step in switch.steps:
            moving |= {(step.node, j) for j in (step.evict, step.restore) if j}
    workers = {
        (node, w.job) for node, a in agents.items() for w in a.workers if w.group == view.group
    }
    pairs = sorted(workers | {(n, j) for n, jobs in resident.items() for j in jobs})
    states = []
    for node, job in pairs:
        if job in view.faults:
            job_state = SnapshotAgentJobStateState.FAULTED
        elif (node, job) in moving:
            job_state = SnapshotAgentJobStateState.TRANSITIONING
        elif job in resident.get(node, []):
            running = job == active
            job_state = (
                SnapshotAgentJobStateState.RUNNING if running else SnapshotAgentJobStateState.IDLE
            )
        else:
            job_state = SnapshotAgentJobStateState.SAVED
        states.append(SnapshotAgentJobState(agent=node, job_state=job_state, job_id=job))
    return GetGroupStatusResponse(
        group=GroupStatus(
            group_id=view.group,
            group_state=state,
            state_timestamp=_timestamp(stamp),
            locking_job=locking,
            active_job=active,
            waiter_queue_depth=len(view.queue),
            loaded_job=loaded,
        ),
        agent_job_states=states,
    )
