"""The agent hub: holds each node agent's stream, sends directives, matches acks.

Agents dial in (AgentHub.Connect). The hub publishes each connected agent, with the workers it
reports, to etcd under ``agents/<node>``, so group membership is visible to every replica. The
record is attached to an agent lease of its own (not this replica's), which the hub keeps alive
while it holds the stream: when the stream or this replica goes, the record stays until the
lease runs out (the agent TTL), so an agent that reconnects to another replica in time stays a
member of its groups, and one that does not leaves them.

Liveness and fencing (``docs/fencing.md``): an agent sends a heartbeat every
``liveness_timeout / 8``; one that is silent for ``liveness_timeout`` (a paused or wedged
process), or that misses a directive's deadline, is fenced out: its agent record goes (so it
leaves every group at once), its residency is marked unknown, its stream is closed, and a fence
record keeps the revision of the fence. Its next hello reconciles its residency from what it
reports, and the Welcome tells it the fence revision, below which it refuses every directive.
An agent that says it cannot write its state file (``StateUnwritable``: a full or read-only
disk) is fenced out the same way, at once: it answers no directive until it can write again,
and then says hello again.

Host memory free: each hello and heartbeat carries what the agent can still park into. It
changes too often for etcd, so the hub keeps only the latest on the connection
(:class:`HostReport`), and the dashboard of this replica shows it for the agents it holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from timeslice.errors import InvalidArgument, PermissionDenied
from timeslice.ids import validate_group_id, validate_job_id, validate_node
from timeslice.tasks import run_to_completion
from timeslice_orchestrator import identity
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import AgentRecord, FenceRecord, WorkerRecord
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentHubBase,
    AgentMessage,
    Directive,
    DirectiveAck,
    JobReport,
    JobState,
    OrchestratorMessage,
    Welcome,
    WorkerInfo,
    WorkersRecorded,
)

log = logging.getLogger(__name__)

# How long a closing agent stream waits for its reader and lease tasks to stop.
_TASK_STOP_SECONDS = 5.0

HELLO_TIMEOUT = 10.0
_ON_DEVICE = (JobState.IDLE, JobState.RUNNING)


class AgentUnavailable(Exception):
    """No stream to that node's agent is held here, or it broke before the ack."""


class AgentTimeout(AgentUnavailable):
    """The agent is connected but did not ack within the directive's deadline: a failure."""


class AgentGone(AgentUnavailable):
    """The node's agent record expired: it has left every group until it comes back."""


class AgentFenced(AgentGone):
    """The node was fenced out (silent past the liveness timeout, or a missed deadline)."""


# Whoever fences a silent node: (node, reason). The router sets it (it knows the groups).
Fencer = Callable[[str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HostReport:
    """The latest host memory free an agent reported on its stream to this replica."""

    available_bytes: int
    heard_at: float  # wall clock of the hello or heartbeat that said it
    modelled: bool  # a modelled host (--host-memory-gb, the sim default): an emulated figure


@dataclass(eq=False)
class AgentConnection:
    """One agent's stream on this replica: what it sends us, and the acks we wait for."""

    node: str
    record: AgentRecord
    outgoing: asyncio.Queue[OrchestratorMessage] = field(default_factory=asyncio.Queue)
    pending: dict[str, asyncio.Future[DirectiveAck]] = field(default_factory=dict)
    # Set to end the stream from our side: replaced by a newer stream, or shutting down.
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    lease: int = 0  # the agent lease: kept alive while this stream lives, then runs out
    heartbeats: bool = False  # the agent sends heartbeats: its silence means it is stalled
    last_heard: float = 0.0  # loop time of the last message from the agent
    fence_revision: int = 0  # the node's fence as its hello found it (0: never fenced)
    record_revision: int = 0  # the revision of this stream's last write of the agent record
    unwritable: bool = False  # the agent said it cannot write its state file: being fenced
    host: HostReport | None = None  # the latest host memory free heard (None: never said)
    host_modelled: bool = False  # the hello said its host figures are a modelled host's

    def heard_host(self, available: int | None) -> bool:
        """Keep a host memory figure the agent said; False when it said none."""
        if available is None:
            return False
        self.host = HostReport(available, time.time(), self.host_modelled)
        return True

    def fail_pending(self, reason: str, error: type[AgentUnavailable] = AgentUnavailable) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error(reason))
        self.pending.clear()


def _worker_records(infos: list[WorkerInfo]) -> list[WorkerRecord]:
    """The valid ones of an agent's worker registrations, as stored records."""
    out = []
    for w in infos:
        try:
            out.append(
                WorkerRecord(
                    job=validate_job_id(w.job_id),
                    group=validate_group_id(w.group_id),
                    pid=w.pid,
                    state_bytes=w.state_bytes,
                    app_callbacks=w.app_callbacks,
                    acquirer=w.acquirer,
                )
            )
        except InvalidArgument as exc:
            log.warning("ignoring invalid worker registration %s: %s", w, exc)
    return out


class AgentHub(AgentHubBase):
    """The AgentHub service: one stream per node agent, and directives sent down it."""

    def __init__(
        self,
        store: GroupStore,
        replica_id: str,
        agent_ttl: int,
        metrics: Metrics,
        liveness_timeout: float = 0.0,
    ) -> None:
        self._store = store
        self._replica_id = replica_id
        self._agent_ttl = agent_ttl
        self._metrics = metrics
        self._connections: dict[str, AgentConnection] = {}
        self._host_version = 0
        # 0 disables heartbeats (and so fencing on silence; a missed deadline still fences).
        self._liveness_timeout = liveness_timeout
        self.fencer: Fencer = self._fence_alone
        # Fences begun from a stream's reader: they outlive the stream they close.
        self._fencing: set[asyncio.Task[None]] = set()

    @property
    def heartbeat_interval(self) -> float:
        """How often agents are asked to send a heartbeat: 8 of them fit in the timeout."""
        return self._liveness_timeout / 8

    @property
    def nodes(self) -> list[str]:
        return sorted(self._connections)

    def close(self) -> None:
        """End every agent stream from our side, so agents reconnect elsewhere at once."""
        for conn in self._connections.values():
            conn.closed.set()

    @property
    def host_version(self) -> int:
        """Counts host memory reports heard here (the dashboard re-sends on a change)."""
        return self._host_version

    def host_report(self, node: str) -> HostReport | None:
        """``node``'s latest host memory free, if this replica holds its stream."""
        conn = self._connections.get(node)
        return conn.host if conn is not None else None

    def holds(self, node: str) -> bool:
        """Whether this replica holds ``node``'s agent stream."""
        return node in self._connections

    async def connect(
        self, messages: AsyncIterator[AgentMessage]
    ) -> AsyncIterator[OrchestratorMessage]:
        hello = await self._read_hello(messages)
        node = hello.node
        try:
            # With mutual TLS only the node's own certificate may speak for it, so a stream
            # can displace this node's current one only with the same identity.
            identity.check_node(node)
        except PermissionDenied as exc:
            self._metrics.rpc_errors.labels(kind=exc.kind.value).inc()
            raise exc.to_grpc() from exc
        record = AgentRecord(
            node=node,
            replica=self._replica_id,
            backend=hello.backend,
            emulated=hello.emulated,
            connected_at=time.time(),
            workers=_worker_records(hello.workers),
            devices=len(hello.devices),
            capacity_bytes=hello.capacity_bytes,
            default_state_bytes=hello.default_state_bytes,
        )
        loop = asyncio.get_running_loop()
        conn = AgentConnection(
            node,
            record,
            heartbeats=hello.heartbeats,
            last_heard=loop.time(),
            host_modelled=hello.host_memory_modelled,
        )
        self._host_version += conn.heard_host(hello.host_available_bytes)
        previous = self._connections.get(node)
        if previous is not None:
            previous.fail_pending("agent reconnected")
            previous.closed.set()
        self._connections[node] = conn
        self._metrics.agents_connected.set(len(self._connections))
        log.info(
            "agent %s connected (backend %s%s)",
            node,
            hello.backend,
            ", emulated" if hello.emulated else "",
        )
        reader = asyncio.create_task(self._read(conn, messages), name=f"agent-reader-{node}")
        # Both end the stream when they finish: the lease lost (fenced by another replica, or
        # not kept alive through an etcd outage), or the agent fenced for its silence.
        background: list[asyncio.Task[None]] = []
        try:
            fence = await self._store.fence_of(node)
            floor = fence.mod_revision if fence is not None else 0
            if fence is not None and hello.fence_revision < floor:
                # First hello since it was fenced: what it reports is the truth, and it is
                # written before the node rejoins its groups (its record is published).
                await self._reconcile(node, hello.jobs, fence.record.groups)
            # Also before the record is published: a group that lost track of the node (its
            # agent lease ran out) would otherwise be planned with no residency there, and
            # the next holder's state restored beside what the devices still hold.
            await self._forget_off_device(node, hello.jobs)
            conn.lease = await self._store.agent_lease(node, self._agent_ttl)
            conn.fence_revision = floor
            conn.record_revision = await self._store.publish_agent(
                record, conn.lease, fence_revision=floor
            )
            background.append(
                asyncio.create_task(
                    self._store.keep_agent_lease(conn.lease, self._agent_ttl).run(),
                    name=f"agent-lease-{node}",
                )
            )
            if conn.heartbeats and self._liveness_timeout > 0:
                background.append(
                    asyncio.create_task(self._watch(conn), name=f"agent-liveness-{node}")
                )
            yield OrchestratorMessage(
                welcome=Welcome(
                    replica_id=self._replica_id,
                    fence_revision=floor,
                    heartbeat_interval_ms=int(self.heartbeat_interval * 1000),
                    liveness_timeout_ms=int(self._liveness_timeout * 1000),
                    records_workers=True,
                )
            )
            closed = asyncio.ensure_future(conn.closed.wait())
            try:
                while True:
                    get = asyncio.ensure_future(conn.outgoing.get())
                    done, _ = await asyncio.wait(
                        {get, reader, closed, *background}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if get in done:
                        yield get.result()
                        continue
                    get.cancel()
                    if reader.done() and reader.exception() is not None:
                        log.warning("agent %s stream failed: %r", node, reader.exception())
                    elif background[0].done():
                        # The agent lease ran out (etcd was away for longer than its TTL, or
                        # the node was fenced): its record is gone, or about to go. Ending the
                        # stream makes the agent reconnect, publish a fresh record, reconcile.
                        log.warning("agent %s: its agent lease is gone; ending its stream", node)
                    return
            finally:
                closed.cancel()
        finally:
            # The connection is let go of before anything is awaited here: a lost connection
            # cancels this handler twice (grpclib's stream wrapper and its handler both do),
            # and the second cancellation ends the first await of this block. Were the
            # connection still listed after it, directives would go into a dead stream and
            # wait out their deadlines (seen in the soak: two switches of 31 s each).
            reader.cancel()
            for task in background:
                task.cancel()
            conn.fail_pending("agent stream closed")
            conn.closed.set()
            if self._connections.get(node) is conn:
                del self._connections[node]
                self._metrics.agents_connected.set(len(self._connections))
            # The record stays until the agent lease runs out: the agent may be reconnecting
            # to another replica, and its jobs' state is still on its node meanwhile.
            log.info("agent %s disconnected", node)
            # asyncio.wait, not ``await task`` under suppress(BaseException): that would also
            # swallow this handler's own cancellation (a client resetting its stream), and
            # grpclib logs a handler that ignores its cancellation with a traceback.
            stopped, _ = await run_to_completion(
                asyncio.wait({reader, *background}, timeout=_TASK_STOP_SECONDS)
            )
            for task in stopped:
                if not task.cancelled():
                    task.exception()  # retrieved: how they ended was handled above

    async def _watch(self, conn: AgentConnection) -> None:
        """Fence the agent out once it has been silent for the liveness timeout."""
        loop = asyncio.get_running_loop()
        woke = loop.time()
        while not conn.closed.is_set():
            now = loop.time()
            silent = now - conn.last_heard
            if now - woke > self._liveness_timeout / 2:
                # This replica's own loop stalled (it slept far past its wake-up): heartbeats
                # may be waiting unread. Give the reader a turn before judging the agent.
                woke = now
                await asyncio.sleep(self.heartbeat_interval)
                continue
            if silent >= self._liveness_timeout:
                reason = f"agent {conn.node} silent for {silent:.1f} s (no heartbeat)"
                log.warning("%s: fencing it out", reason)
                self._metrics.agents_fenced.labels(reason="silent").inc()
                try:
                    await self.fencer(conn.node, reason)
                except StoreUnavailable as exc:
                    log.error("could not fence %s out: %s", conn.node, exc)
                return
            pause = min(self.heartbeat_interval, self._liveness_timeout - silent)
            woke = now + pause
            await asyncio.sleep(pause)

    def _state_unwritable(self, conn: AgentConnection, detail: str) -> None:
        """The agent cannot persist its state: fence it out as if it had stopped answering.

        It answers no directive meanwhile (one it cannot make durable is not acted on), so
        waiting for its deadlines would only stall its groups; a failed directive would fault
        jobs that did nothing wrong. The fence fails its pending directives as
        :class:`AgentFenced`: its switches go on without it, as for a silent node.
        """
        if conn.unwritable:
            return
        conn.unwritable = True
        reason = f"agent {conn.node} cannot write its state file ({detail or 'no detail'})"
        log.warning("%s: fencing it out", reason)
        self._metrics.agents_fenced.labels(reason="unwritable").inc()
        # Not in the reader: the fence ends this stream, and with it the reader.
        task = asyncio.create_task(self._fence_now(conn.node, reason), name=f"fence-{conn.node}")
        self._fencing.add(task)
        task.add_done_callback(self._fencing.discard)

    async def _fence_now(self, node: str, reason: str) -> None:
        try:
            await self.fencer(node, reason)
        except StoreUnavailable as exc:
            # Its stream is closed all the same (fence); the agent, unable to write, does not
            # say hello again, so its record goes with its agent lease.
            log.error("could not fence %s out: %s", node, exc)

    async def fence(self, node: str, reason: str, groups: list[str]) -> int:
        """Fence ``node`` out of its groups (the rule is in ``docs/fencing.md``).

        ``groups``: where its residency is marked unknown. Its pending directives fail at
        once as :class:`AgentFenced` and its stream here, if any, is closed; a stream held by
        another replica closes when that replica finds the agent lease revoked.
        """
        conn = self._connections.get(node)
        record = FenceRecord(reason, time.time(), self._replica_id, sorted(groups))
        try:
            revision = await self._store.fence_node(node, record)
        except BaseException:
            # Not fenced, or fenced with its residency not all marked (its next hello
            # reconciles it): what it was sent has an unknown outcome; it says hello again.
            if conn is not None:
                conn.fail_pending(f"agent {node} stalled; fencing it failed", AgentUnavailable)
                conn.closed.set()
            raise
        if conn is not None:
            conn.fail_pending(f"node {node} fenced out: {reason}", AgentFenced)
            conn.closed.set()
        log.warning("node %s fenced out at revision %d: %s", node, revision, reason)
        return revision

    async def _fence_alone(self, node: str, reason: str) -> None:
        await self.fence(node, reason, [])

    async def _reconcile(self, node: str, jobs: list[JobReport], groups: list[str]) -> None:
        """Set the node's residency, in every group it reports or was fenced in, to its word."""
        on_device: dict[str, list[str]] = {g: [] for g in groups}
        for report in jobs:
            try:
                group = validate_group_id(report.group_id)
                job = validate_job_id(report.job_id)
            except InvalidArgument as exc:
                log.warning("agent %s: ignoring an invalid job report: %s", node, exc)
                continue
            held = on_device.setdefault(group, [])
            if report.state in _ON_DEVICE:
                held.append(job)
        for group, held in sorted(on_device.items()):
            if await self._store.set_node_residency(group, node, held):
                log.info(
                    "agent %s rejoins %s after its fence: resident there: %s",
                    node,
                    group,
                    ", ".join(held) or "nothing",
                )

    async def _forget_off_device(self, node: str, jobs: list[JobReport]) -> None:
        """Trust the agent about what is on its devices: after a crash or a lost stream, a job
        the group still lists as resident there may in truth be parked, half-moved or faulted;
        and a group that lost track of the node (fenced, or its agent lease ran out) learns
        what the node holds, which lets its driver restore a holder granted meanwhile. The
        jobs it reports off its devices are what the group counts as parked there (a job
        parked on a node is not granted until that node has restored it).
        """
        on_device: dict[str, list[str]] = {}
        parked: dict[str, list[str]] = {}
        reported: dict[str, list[str]] = {}
        for report in jobs:
            try:
                group = validate_group_id(report.group_id)
                job = validate_job_id(report.job_id)
            except InvalidArgument as exc:
                log.warning("agent %s: ignoring an invalid job report: %s", node, exc)
                continue
            reported.setdefault(group, []).append(job)
            held = on_device.setdefault(group, [])
            if report.state in _ON_DEVICE:
                held.append(job)
                continue
            parked.setdefault(group, []).append(job)
            if await self._store.forget_residency(group, node, job, parked=True):
                log.warning(
                    "agent %s reports %s of %s as %s: parked there, not on its devices",
                    node,
                    job,
                    group,
                    report.state.name.lower(),
                )
        for group, held in sorted(on_device.items()):
            if await self._store.settle_unknown_residency(
                group, node, held, runs_here=reported[group]
            ):
                log.info(
                    "agent %s is back in %s: resident there: %s",
                    node,
                    group,
                    ", ".join(held) or "nothing",
                )
            # Jobs the group counted as parked there that the agent no longer does (it
            # reports them on its devices, or not at all) are not held back for this node.
            await self._store.settle_parked(group, node, parked.get(group, []))

    async def _read_hello(self, messages: AsyncIterator[AgentMessage]) -> AgentHello:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                first = await anext(messages)
        except (TimeoutError, StopAsyncIteration) as exc:
            raise InvalidArgument("expected AgentHello first").to_grpc() from exc
        if first.hello is None:
            raise InvalidArgument("expected AgentHello first").to_grpc()
        try:
            validate_node(first.hello.node)
        except InvalidArgument as exc:
            raise exc.to_grpc() from exc
        return first.hello

    async def _read(self, conn: AgentConnection, messages: AsyncIterator[AgentMessage]) -> None:
        loop = asyncio.get_running_loop()
        async for msg in messages:
            conn.last_heard = loop.time()
            if msg.heartbeat is not None:
                self._host_version += conn.heard_host(msg.heartbeat.host_available_bytes)
                continue
            if msg.state_unwritable is not None:
                self._state_unwritable(conn, msg.state_unwritable.reason)
                continue
            if msg.ack is not None:
                fut = conn.pending.pop(msg.ack.directive_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.ack)
            elif msg.workers is not None:
                before = {(w.group, w.job) for w in conn.record.workers}
                conn.record.workers = _worker_records(msg.workers.workers)
                left = before - {(w.group, w.job) for w in conn.record.workers}
                # Raises FailedPrecondition (the stream ends) once a newer stream of the
                # agent has published: this one's late write must not undo that one's.
                revision = await self._store.publish_agent(
                    conn.record,
                    conn.lease,
                    fence_revision=conn.fence_revision,
                    after=conn.record_revision,
                )
                conn.record_revision = revision
                if msg.workers.seq:
                    # The agent holds the registrations of this change until it hears this.
                    recorded = WorkersRecorded(seq=msg.workers.seq, revision=revision)
                    await conn.outgoing.put(OrchestratorMessage(workers_recorded=recorded))
                await self._forget_left(conn.node, sorted(left))

    async def _forget_left(self, node: str, left: list[tuple[str, str]]) -> None:
        """A job whose last worker of a group left the node has no process there holding its
        state (the agent drops it too): it is no longer resident, or a group whose jobs all
        exited would show the last one on its devices, and plan to checkpoint it."""
        for group, job in left:
            try:
                forgotten = await self._store.forget_residency(group, node, job)
            except StoreUnavailable as exc:
                log.warning("agent %s: could not forget %s of %s: %s", node, job, group, exc)
                continue
            if forgotten:
                log.info(
                    "agent %s: %s of %s has no worker left: no longer resident", node, job, group
                )

    async def execute(self, node: str, directive: Directive, timeout: float) -> DirectiveAck:
        """Send one directive and wait for its ack (at most ``timeout`` seconds)."""
        conn = self._connections.get(node)
        if conn is None:
            raise AgentUnavailable(f"agent {node} is not connected to this replica")
        fut: asyncio.Future[DirectiveAck] = asyncio.get_running_loop().create_future()
        conn.pending[directive.directive_id] = fut
        await conn.outgoing.put(OrchestratorMessage(directive=directive))
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError as exc:
            raise AgentTimeout(f"agent {node} did not ack within {timeout:.1f} s") from exc
        finally:
            conn.pending.pop(directive.directive_id, None)
