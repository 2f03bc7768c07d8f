"""The agent's client of ``timeslice.v1.NodeOperations``: operator snapshot / restore.

The llm-d snapshot agent API's ``Snapshot`` / ``Restore`` / ``GetOperation``
(:mod:`timeslice_agent.llmd`) are not carried out by the agent on its own: the orchestrator
decides which job's state is on a group's devices and fences every move with the group's
epoch (docs/fencing.md), so the agent asks it, as this node. The request reaches the
orchestrator over the agent's own targets and TLS settings (its node certificate: with mutual
TLS it may ask only for its own node); the group's switch driver runs the operation as a
switch without a grant, and this node's agent carries out its directives like any other.

One short-lived channel per call, trying each target in turn (starting with the last that
answered) while they are unreachable: operator calls are rare, and a held channel would need
its own keepalive and reconnect logic for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from timeslice.status_details import KIND_CODEC
from timeslice.targets import HostPort
from timeslice.tls import ReloadingContext, TlsChannel, TlsFiles, client_context
from timeslice_agent.config import Endpoint
from timeslice_proto.timeslice.v1 import (
    GetNodeOperationRequest,
    NodeOperation,
    NodeOperationsStub,
    OperationKind,
    StartOperationRequest,
)

log = logging.getLogger(__name__)

CALL_TIMEOUT_SECONDS = 10.0

_T = TypeVar("_T")


class OrchestratorOperations:
    """Start and read operator operations for ``node`` at the orchestrators ``targets``.

    Errors are the orchestrator's statuses, passed on as :class:`GRPCError` (NOT_FOUND,
    FAILED_PRECONDITION with the reason, ...); no reachable orchestrator is UNAVAILABLE.
    """

    def __init__(
        self,
        node: str,
        targets: Sequence[Endpoint],
        tls: TlsFiles | None,
        *,
        timeout: float = CALL_TIMEOUT_SECONDS,
    ) -> None:
        if not targets:
            raise ValueError("at least one orchestrator target is needed")
        self._node = node
        self._targets = list(targets)
        self._tls = (
            ReloadingContext(tls, client_context, name="agent TLS (operations)")
            if tls is not None
            else None
        )
        self._timeout = timeout
        self._next = 0

    def _channel(self, target: Endpoint) -> Channel:
        if self._tls is None:
            return Channel(target.host, target.port, status_details_codec=KIND_CODEC)
        return TlsChannel(HostPort(target.host, target.port), self._tls, Configuration())

    async def start(self, kind: OperationKind, job_id: str, group_id: str) -> NodeOperation:
        """Ask for an operation on this node; the orchestrator records it PENDING.

        Every attempt (the next orchestrator after one that timed out, perhaps after it
        recorded the operation) carries the same request id, so it is recorded once.
        """
        request = StartOperationRequest(
            node=self._node,
            job_id=job_id,
            group_id=group_id,
            kind=kind,
            request_id=uuid.uuid4().hex,
        )
        return await self._call(lambda stub: stub.start_operation(request))

    async def get(self, operation_id: str) -> NodeOperation:
        """An operation of this node as the orchestrator last recorded it."""
        request = GetNodeOperationRequest(node=self._node, operation_id=operation_id)
        return await self._call(lambda stub: stub.get_operation(request))

    async def _call(self, call: Callable[[NodeOperationsStub], Awaitable[_T]]) -> _T:
        errors: list[str] = []
        for i in range(len(self._targets)):
            index = (self._next + i) % len(self._targets)
            target = self._targets[index]
            channel = self._channel(target)
            try:
                async with asyncio.timeout(self._timeout):
                    result = await call(NodeOperationsStub(channel))
            except GRPCError as exc:
                if exc.status is not Status.UNAVAILABLE:
                    self._next = index
                    raise
                errors.append(f"{target}: {exc.message}")
            except (OSError, TimeoutError, StreamTerminatedError) as exc:
                errors.append(f"{target}: {type(exc).__name__}: {exc}")
            else:
                self._next = index
                return result
            finally:
                channel.close()
        log.warning("operator operation: no orchestrator answered (%s)", "; ".join(errors))
        raise GRPCError(Status.UNAVAILABLE, f"no orchestrator answered: {'; '.join(errors)}"[:1000])
