"""NodeOperations: operator snapshot / restore of one job on one node, asked by that node.

The llm-d snapshot agent API has ``Snapshot`` / ``Restore`` / ``GetOperation`` on each node
(docs/llmd-agent.md). On this platform the orchestrator decides which job's state is on a
group's devices and every move is fenced by the group's epoch, so the agent does not move
state on its own: it forwards the request here. A request is checked against the group as
this replica sees it (:func:`~timeslice_orchestrator.switch_plan.plan_operation`: refused,
FAILED_PRECONDITION, with the reason), then recorded PENDING in etcd
(:mod:`.store.operations`); the group's switch driver runs it as a switch without a grant and
writes the outcome, which ``GetOperation`` reads back from the mirror.

Who may ask: with mutual TLS, a node certificate only for its own node (the request's
``node``, and the operation's node for GetOperation); an operator certificate for any node;
a job certificate never. Without TLS (``--insecure``) there is no identity to check, as for
the agent stream itself.
"""

from __future__ import annotations

import logging
import time

from opentelemetry import trace
from opentelemetry.trace import Tracer

from timeslice.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from timeslice.ids import validate_group_id, validate_job_id, validate_node
from timeslice_orchestrator import identity
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.rpc import Call, served
from timeslice_orchestrator.store.follower import MIRROR_LAG_TIMEOUT, Mirror
from timeslice_orchestrator.store.groups import GroupStore, new_operation_id, operation_id_for
from timeslice_orchestrator.store.records import (
    OperationKind,
    OperationRecord,
    OperationState,
)
from timeslice_orchestrator.switch_plan import plan_operation
from timeslice_proto.timeslice.v1 import (
    GetNodeOperationRequest,
    NodeOperation,
    NodeOperationsBase,
    StartOperationRequest,
)
from timeslice_proto.timeslice.v1 import OperationKind as WireKind
from timeslice_proto.timeslice.v1 import OperationState as WireState

log = logging.getLogger(__name__)

SERVICE = "timeslice.v1.NodeOperations"

OPERATION_RETENTION_SECONDS = 3600
"""How long an operation record is kept after its request (its lease's TTL), whatever its state."""
MAX_PENDING_OPERATIONS = 16
"""Operations of one group not finished yet; more are refused (RESOURCE_EXHAUSTED)."""
MAX_OPERATION_ID_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 64

_KINDS = {WireKind.SNAPSHOT: OperationKind.SNAPSHOT, WireKind.RESTORE: OperationKind.RESTORE}
_WIRE_KINDS = {v: k for k, v in _KINDS.items()}
_WIRE_STATES = {
    OperationState.PENDING: WireState.PENDING,
    OperationState.RUNNING: WireState.RUNNING,
    OperationState.SUCCEEDED: WireState.SUCCEEDED,
    OperationState.FAILED: WireState.FAILED,
}


def to_wire(op: OperationRecord) -> NodeOperation:
    """An operation record as the NodeOperations API answers it."""
    return NodeOperation(
        operation_id=op.operation_id,
        kind=_WIRE_KINDS[op.kind],
        job_id=op.job,
        group_id=op.group,
        node=op.node,
        state=_WIRE_STATES[op.state],
        requested_at=op.requested_at,
        finished_at=op.finished_at,
        bytes_moved=op.bytes_moved,
        error=op.error,
    )


def _check_node(node: str, what: str) -> None:
    """Refuse a caller whose certificate is neither ``node``'s nor an operator's."""
    who = identity.current()
    if who is None or who.operator or who.node == node:
        return
    log.warning("%s for node %r refused: the certificate is %s", what, node, who)
    raise PermissionDenied(f"{what}: the client certificate {who} may not act for node {node!r}")


def _same_request(
    op: OperationRecord, kind: OperationKind, job: str, request_id: str
) -> OperationRecord:
    """``op``, recorded for an earlier attempt of the same request id; refused when that
    request asked for something else (a client reusing its key)."""
    if op.kind is not kind or op.job != job:
        raise InvalidArgument(
            f"request_id {request_id!r} was already used for a {op.kind.value} of job "
            f"{op.job} (operation {op.operation_id})"
        )
    return op


class NodeOperationsService(NodeOperationsBase):
    """``timeslice.v1.NodeOperations``: thin handlers over the store and the mirror."""

    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        metrics: Metrics,
        *,
        co_residency: bool = False,
        retention: int = OPERATION_RETENTION_SECONDS,
        max_pending: int = MAX_PENDING_OPERATIONS,
        tracer: Tracer | None = None,
    ) -> None:
        self._tracer = tracer or trace.NoOpTracer()
        self._store = store
        self._mirror = mirror
        self._metrics = metrics
        self._co_residency = co_residency
        self._retention = retention
        self._max_pending = max_pending

    async def start_operation(self, message: StartOperationRequest) -> NodeOperation:
        """Check the request against the group now, then record it PENDING for the driver."""
        call = Call(SERVICE, "StartOperation", message.group_id, message.job_id)
        with served(call, self._tracer, self._metrics):
            return await self._start(message)

    async def _start(self, message: StartOperationRequest) -> NodeOperation:
        node = validate_node(message.node)
        job = validate_job_id(message.job_id)
        group = validate_group_id(message.group_id)
        kind = _KINDS.get(message.kind)
        if kind is None:
            raise InvalidArgument("kind must be OPERATION_KIND_SNAPSHOT or OPERATION_KIND_RESTORE")
        request_id = message.request_id
        if len(request_id) > MAX_REQUEST_ID_LENGTH or not request_id.isprintable():
            raise InvalidArgument(
                f"request_id must be at most {MAX_REQUEST_ID_LENGTH} printable characters"
            )
        _check_node(node, "StartOperation")
        view = self._mirror.group(group)
        if not view.exists:
            raise NotFound(f"group {group} does not exist")
        if request_id:
            # A retry of a request already recorded gets that operation back, whatever the
            # group has become since (its first attempt was checked against the group then).
            operation_id = operation_id_for(node, group, request_id)
            known = self._mirror.operation(operation_id) or await self._store.operation(
                group, operation_id
            )
            if known is not None:
                return to_wire(_same_request(known.record, kind, job, request_id))
        else:
            operation_id = new_operation_id()
        open_ops = [o for o in view.operations.values() if not o.record.state.done]
        if len(open_ops) >= self._max_pending:
            raise ResourceExhausted(
                f"group {group} has {len(open_ops)} operations not finished yet "
                f"(limit {self._max_pending})"
            )
        record = OperationRecord(
            operation_id=operation_id,
            kind=kind,
            group=group,
            job=job,
            node=node,
            requested_at=time.time(),
        )
        # Decided again when the driver runs it: the group may change in between.
        steps = plan_operation(view, record, self._mirror.agents(), self._co_residency)
        if isinstance(steps, str):
            raise FailedPrecondition(steps)
        stored = await self._store.request_operation(record, self._retention)
        if stored is None:
            raise NotFound(f"group {group} does not exist")
        if stored.record is not record:
            # Another attempt of this request was recorded meanwhile, on another replica.
            return to_wire(_same_request(stored.record, kind, job, request_id))
        # The node's next GetOperation, on this replica, must find it.
        await self._mirror.wait_for_revision(stored.mod_revision, MIRROR_LAG_TIMEOUT)
        log.info(
            "operation %s requested: %s of %s in group %s on node %s",
            record.operation_id,
            kind.value,
            job,
            group,
            node,
        )
        return to_wire(record)

    async def get_operation(self, message: GetNodeOperationRequest) -> NodeOperation:
        """The operation as last written; NOT_FOUND when unknown, expired or another node's."""
        with served(Call(SERVICE, "GetOperation"), self._tracer, self._metrics):
            node = validate_node(message.node)
            op_id = message.operation_id
            if not op_id or len(op_id) > MAX_OPERATION_ID_LENGTH or not op_id.isprintable():
                raise InvalidArgument(
                    f"operation_id must be 1 to {MAX_OPERATION_ID_LENGTH} printable characters"
                )
            _check_node(node, "GetOperation")
            stored = self._mirror.operation(op_id)
            if stored is None or stored.record.node != node:
                raise NotFound(f"no operation {op_id[:64]!r} for node {node}")
            return to_wire(stored.record)
