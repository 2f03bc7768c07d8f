"""The agent hub: holds each node agent's stream, sends directives, matches acks.

Agents dial in (AgentHub.Connect). The hub publishes each connected agent, with the workers it
reports, to etcd under ``agents/<node>``, so group membership is visible to every replica. The
record is attached to an agent lease of its own (not this replica's), which the hub keeps alive
while it holds the stream: when the stream or this replica goes, the record stays until the
lease runs out (the agent TTL), so an agent that reconnects to another replica in time stays a
member of its groups, and one that does not leaves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpclib
from grpclib.const import Status

from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_job_id, validate_node
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import AgentRecord, WorkerRecord
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
)

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 10.0
_ON_DEVICE = (JobState.IDLE, JobState.RUNNING)


class AgentUnavailable(Exception):
    """No stream to that node's agent is held here, or it broke before the ack."""


class AgentTimeout(AgentUnavailable):
    """The agent is connected but did not ack within the directive's deadline: a failure."""


class AgentGone(AgentUnavailable):
    """The node's agent record expired: it has left every group until it comes back."""


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

    def fail_pending(self, reason: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(AgentUnavailable(reason))
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
        self, store: GroupStore, replica_id: str, agent_ttl: int, metrics: Metrics
    ) -> None:
        self._store = store
        self._replica_id = replica_id
        self._agent_ttl = agent_ttl
        self._metrics = metrics
        self._connections: dict[str, AgentConnection] = {}

    @property
    def nodes(self) -> list[str]:
        return sorted(self._connections)

    def close(self) -> None:
        """End every agent stream from our side, so agents reconnect elsewhere at once."""
        for conn in self._connections.values():
            conn.closed.set()

    def holds(self, node: str) -> bool:
        """Whether this replica holds ``node``'s agent stream."""
        return node in self._connections

    async def connect(
        self, messages: AsyncIterator[AgentMessage]
    ) -> AsyncIterator[OrchestratorMessage]:
        hello = await self._read_hello(messages)
        node = hello.node
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
        conn = AgentConnection(node, record)
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
        keeper: asyncio.Task[None] | None = None
        try:
            conn.lease = await self._store.agent_lease(node, self._agent_ttl)
            await self._store.publish_agent(record, conn.lease)
            keeper = asyncio.create_task(
                self._store.keep_agent_lease(conn.lease, self._agent_ttl).run(),
                name=f"agent-lease-{node}",
            )
            await self._forget_off_device(node, hello.jobs)
            yield OrchestratorMessage(welcome=Welcome(replica_id=self._replica_id))
            closed = asyncio.ensure_future(conn.closed.wait())
            try:
                while True:
                    get = asyncio.ensure_future(conn.outgoing.get())
                    done, _ = await asyncio.wait(
                        {get, reader, closed, keeper}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if get in done:
                        yield get.result()
                        continue
                    get.cancel()
                    if reader.done() and reader.exception() is not None:
                        log.warning("agent %s stream failed: %r", node, reader.exception())
                    if keeper.done():
                        # The agent lease ran out (etcd was away for longer than its TTL):
                        # the agent's record is gone, or about to go. Ending the stream makes
                        # the agent reconnect, publish a fresh record and reconcile.
                        log.warning("agent %s: its lease was lost; ending its stream", node)
                    return
            finally:
                closed.cancel()
        finally:
            reader.cancel()
            if keeper is not None:
                keeper.cancel()
            with contextlib.suppress(BaseException):
                await reader
            conn.fail_pending("agent stream closed")
            if self._connections.get(node) is conn:
                del self._connections[node]
                self._metrics.agents_connected.set(len(self._connections))
            # The record stays until the agent lease runs out: the agent may be reconnecting
            # to another replica, and its jobs' state is still on its node meanwhile.
            log.info("agent %s disconnected", node)

    async def _forget_off_device(self, node: str, jobs: list[JobReport]) -> None:
        """Trust the agent about what is on its devices: after a crash or a lost stream, a job
        the group still lists as resident there may in truth be parked, half-moved or faulted.
        """
        for report in jobs:
            if report.state in _ON_DEVICE:
                continue
            if await self._store.forget_residency(report.group_id, node, report.job_id):
                log.warning(
                    "agent %s reports %s of %s as %s: no longer resident there",
                    node,
                    report.job_id,
                    report.group_id,
                    report.state.name.lower(),
                )

    async def _read_hello(self, messages: AsyncIterator[AgentMessage]) -> AgentHello:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                first = await anext(messages)
        except (TimeoutError, StopAsyncIteration) as exc:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, "expected AgentHello first") from exc
        if first.hello is None:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, "expected AgentHello first")
        try:
            validate_node(first.hello.node)
        except InvalidArgument as exc:
            raise grpclib.GRPCError(exc.status, exc.wire_message()) from exc
        return first.hello

    async def _read(self, conn: AgentConnection, messages: AsyncIterator[AgentMessage]) -> None:
        async for msg in messages:
            if msg.ack is not None:
                fut = conn.pending.pop(msg.ack.directive_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.ack)
            elif msg.workers is not None:
                conn.record.workers = _worker_records(msg.workers.workers)
                await self._store.publish_agent(conn.record, conn.lease)

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
