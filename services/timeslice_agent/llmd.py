"""The llm-d reference's node snapshot agent API, served by this agent on ``--llmd-port``.

``snapshot_agent.v1alpha1.SnapshotAgentService`` (protos/snapshot_agent/v1alpha1) and
``grpc.health.v1.Health/Check`` on one TCP port (off by default; ``--llmd-host`` 127.0.0.1).
Everything here is thin over the agent's own parts (docs/llmd-agent.md):

- **WorkloadChannel**: a workload that sends ``register{job_id, group, capabilities}`` becomes
  an app-callback worker of the :class:`~timeslice_agent.workers.WorkerRegistry`, exactly as a
  ``timeslice.register(on_checkpoint=..., on_restore=...)`` worker over the unix socket: the
  executor's BEFORE_CHECKPOINT hook reaches it as ``AgentCommand{snapshot{mode, tags}}``,
  AFTER_RESTORE as ``restore{tags}``, and its ``result{command_id, ok, error}`` completes the
  hook (ok=false fails it). The registration lives as long as the stream.
- **Who may register over TCP.** A TCP connection carries no ``SO_PEERCRED``. Only loopback
  connections are accepted: the connecting process is found from ``/proc/net/tcp{,6}`` (the
  client end's socket inode) and ``/proc/<pid>/fd`` (which process holds that inode), and then
  the unix socket's rules apply unchanged (:func:`~timeslice_agent.peers.authorize_registration`:
  the process registers itself, and a job label in its environment must name the same job).
  A peer that cannot be identified (not loopback, no socket entry, held by no process or by
  several) is refused with PERMISSION_DENIED, and nothing is recorded.
- **Status**: the executor's job table (plus registered jobs not in it yet, IDLE) and, where
  NVML works, each accelerator's memory.
- **Snapshot / Restore** are answered ABORTED while the job is TRANSITIONING and
  FAILED_PRECONDITION in the wrong state (snapshot needs RUNNING, restore needs SAVED). In the
  right state the agent does not move the state itself: on this platform the orchestrator
  decides which job of a group holds the devices, and the agent moves device state only under
  its fencing epoch. It forwards the request to the orchestrator as this node
  (``timeslice.v1.NodeOperations``, :mod:`timeslice_agent.operations`), which refuses it
  (FAILED_PRECONDITION with the reason: the job holds the group, another job holds it and the
  state does not fit beside it) or records an operation that the group's switch driver runs as
  a fenced switch without a grant; the answer is its id.
- **GetOperation** reads the operation back from the orchestrator: PENDING while it waits or
  runs, COMPLETE with the bytes the checkpoint or restore moved, FAILED with the reason;
  NOT_FOUND for an id the orchestrator does not know for this node.

Without an orchestrator client (``operations`` None) Snapshot / Restore in the right state are
refused FAILED_PRECONDITION and GetOperation answers NOT_FOUND, as before operations existed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from timeslice.errors import InvalidArgument, NotFound, Timeout, TimeSliceError
from timeslice.ids import validate_group_id, validate_job_id
from timeslice_agent.jobs import Job, JobState
from timeslice_agent.peers import PeerCredentials, RegistrationRefused, authorize_registration
from timeslice_agent.procs import PROC, ProcessIdentity, identity_of, nspid_of
from timeslice_agent.workers import AUTHORIZE_SECONDS, Registration, WorkerRegistry
from timeslice_proto.grpc.health.v1 import (
    HealthCheckRequest,
    HealthCheckResponse,
    HealthCheckResponseServingStatus,
)
from timeslice_proto.snapshot_agent.v1alpha1 import (
    AcceleratorStatus,
    AgentCommand,
    BackendConfig,
    GetOperationRequest,
    GetOperationResponse,
    JobStatus,
    OperationStatus,
    RestoreCommand,
    RestoreRequest,
    RestoreResponse,
    SnapshotCommand,
    SnapshotRequest,
    SnapshotResponse,
    StatusRequest,
    StatusResponse,
    SuspendMode,
    WorkloadCapabilities,
    WorkloadMessage,
)
from timeslice_proto.snapshot_agent.v1alpha1 import JobState as LlmdJobState
from timeslice_proto.timeslice.v1 import (
    CommandResult,
    HookKind,
    NodeOperation,
    OperationKind,
    OperationState,
    WorkerInfo,
)

log = logging.getLogger(__name__)

SERVICE = "snapshot_agent.v1alpha1.SnapshotAgentService"
HEALTH_SERVICE = "grpc.health.v1.Health"
# How long an opened WorkloadChannel may take to send its `register`.
REGISTER_WAIT_SECONDS = 30.0
MAX_TAGS = 64
MAX_TAG_LENGTH = 256
MAX_OPERATION_ID_LENGTH = 256
MAX_HEALTH_SERVICE_LENGTH = 256
MAX_PIDS = 1024
MAX_REGIONS = 4096
# Backend types of the reference's health check, and whether this agent serves them.
APP_CHANNEL = "app-channel"

_JOB_STATES: dict[JobState, LlmdJobState] = {
    JobState.IDLE: LlmdJobState.IDLE,
    JobState.RUNNING: LlmdJobState.RUNNING,
    JobState.TRANSITIONING: LlmdJobState.TRANSITIONING,
    JobState.SAVED: LlmdJobState.SAVED,
    JobState.FAULTED: LlmdJobState.FAULTED,
}

OPERATOR_REFUSAL = (
    "operator {what} is not supported by the timeslice agent: the orchestrator decides which "
    "job of a group holds the devices and fences every move of device state with the group's "
    "epoch; a {what} outside a switch would {harm}. Use the orchestrator instead "
    "(yield / acquire, or the operator yield), which runs the same checkpoint and restore "
    "with the workload's hooks"
)
_HARM = {
    "snapshot": "leave the holder without its state while the orchestrator still counts it as "
    "granted",
    "restore": "put a job's state on devices that another job of the group may hold",
}


class Operations(Protocol):
    """The orchestrator's NodeOperations, as this node (:class:`~timeslice_agent.operations.
    OrchestratorOperations`); errors are the orchestrator's statuses (GRPCError)."""

    async def start(self, kind: OperationKind, job_id: str, group_id: str) -> NodeOperation: ...

    async def get(self, operation_id: str) -> NodeOperation: ...


class AcceleratorMemory(Protocol):
    """What Status needs from NVML: per accelerator, (id, used bytes, total bytes)."""

    async def usage(self) -> list[tuple[str, int, int]]: ...


def _status(exc: TimeSliceError) -> GRPCError:
    return exc.to_grpc()


# ----- who is on the other end of a loopback TCP connection -----------------------------------

_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


def _parse_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (/proc/net/tcp) or its 32-hex-digit IPv6 form -> (address, port).

    The kernel prints each 32-bit word of the address as a native-endian integer.
    """
    host, port = text.split(":")
    raw = b"".join(
        int(host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(host), 8)
    )
    address = ipaddress.ip_address(raw)
    return _unmapped(address), int(port, 16)


def _unmapped(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def socket_inode(local: tuple[str, int], remote: tuple[str, int], proc: Path = PROC) -> int | None:
    """The inode of the TCP socket whose local end is ``local`` and remote end ``remote``.

    Read from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (the agent's network namespace); None
    if there is none (blocking reads).
    """
    want_local = (_unmapped(ipaddress.ip_address(local[0])), local[1])
    want_remote = (_unmapped(ipaddress.ip_address(remote[0])), remote[1])
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                if (
                    _parse_address(fields[1]) == want_local
                    and _parse_address(fields[2]) == want_remote
                ):
                    inode = int(fields[9])
                    return inode or None
            except ValueError:
                continue
    return None


def holders_of(inode: int, proc: Path = PROC, deadline: float | None = None) -> list[int]:
    """The pids whose open files include the socket ``inode`` (blocking /proc walk)."""
    target = f"socket:[{inode}]"
    found: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("walking /proc/*/fd took too long")
        try:
            fds = os.listdir(entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(entry / "fd" / fd) == target:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


def loopback_peer(
    peer: tuple[str, int], local: tuple[str, int], proc: Path = PROC, deadline: float | None = None
) -> PeerCredentials:
    """The process at the other end of a loopback TCP connection; raises RegistrationRefused.

    ``peer`` is the client's address (``getpeername``), ``local`` the agent's
    (``getsockname``). The client's end of the connection is the socket whose local address
    is ``peer`` and remote address ``local``.
    """
    address = _unmapped(ipaddress.ip_address(peer[0]))
    if not address.is_loopback:
        raise RegistrationRefused(
            "credentials",
            f"workloads register only over loopback (the peer is {peer[0]}): the agent must "
            "identify the registering process, which it can only for a connection on this node",
        )
    inode = socket_inode(peer, local, proc)
    if inode is None:
        raise RegistrationRefused(
            "credentials",
            f"no socket of this network namespace connects {peer[0]}:{peer[1]} to the agent "
            "(a process in another network namespace?)",
        )
    holders = holders_of(inode, proc, deadline)
    if len(holders) != 1:
        raise RegistrationRefused(
            "credentials",
            f"the connection from port {peer[1]} is held by "
            + ("no process the agent can see" if not holders else f"several processes {holders}")
            + ": the registering process cannot be identified",
        )
    identity = identity_of(holders[0], proc)
    if identity is None:
        raise RegistrationRefused("connector_gone", f"pid {holders[0]} exited while being checked")
    return PeerCredentials(pid=identity.pid, uid=identity.euid, gid=-1)


def _authorize_tcp(
    peer: tuple[str, int], local: tuple[str, int], job_id: str, own_pid: int, deadline: float
) -> ProcessIdentity:
    """Identify the peer and check it may register itself for ``job_id`` (blocking reads)."""
    try:
        creds = loopback_peer(peer, local, deadline=deadline)
    except TimeoutError as exc:
        raise RegistrationRefused("timeout", str(exc)) from None
    # The peer registers itself; authorize_registration reads a pid in the peer's own pid
    # namespace, so hand it the peer's innermost pid.
    chain = nspid_of(creds.pid)
    own = chain[-1] if chain else creds.pid
    return authorize_registration(creds, own, job_id, own_pid=own_pid, deadline=deadline)


def _addresses(stream: grpclib.server.Stream[Any, Any]) -> tuple[tuple[str, int], tuple[str, int]]:
    """(peer, local) TCP addresses of a server stream; raises RegistrationRefused."""
    transport = getattr(stream.peer, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        raise RegistrationRefused("credentials", "not a TCP connection")
    peer = sock.getpeername()
    local = sock.getsockname()
    return (str(peer[0]), int(peer[1])), (str(local[0]), int(local[1]))


# ----- validation ------------------------------------------------------------------------------


def _check_tags(tags: Sequence[str], what: str) -> None:
    if len(tags) > MAX_TAGS:
        raise InvalidArgument(f"{what}: {len(tags)} tags; the limit is {MAX_TAGS}")
    for tag in tags:
        if not tag or len(tag) > MAX_TAG_LENGTH or not tag.isprintable():
            raise InvalidArgument(
                f"{what}: a tag must be 1 to {MAX_TAG_LENGTH} printable characters"
            )


def _check_capabilities(caps: WorkloadCapabilities | None) -> None:
    if caps is None:
        return
    if len(caps.supported_modes) > 8:
        raise InvalidArgument("capabilities.supported_modes: too many entries")
    if SuspendMode.UNSPECIFIED in caps.supported_modes:
        raise InvalidArgument("capabilities.supported_modes must not list SUSPEND_MODE_UNSPECIFIED")
    if (
        caps.default_mode is not SuspendMode.UNSPECIFIED
        and caps.supported_modes
        and caps.default_mode not in caps.supported_modes
    ):
        raise InvalidArgument(
            f"capabilities.default_mode {caps.default_mode.name} is not among supported_modes"
        )
    _check_tags(caps.tags, "capabilities.tags")


def _check_pids(pids: Iterable[int], what: str) -> None:
    pids = list(pids)
    if len(pids) > MAX_PIDS:
        raise InvalidArgument(f"{what}: {len(pids)} pids; the limit is {MAX_PIDS}")
    if any(p <= 0 for p in pids):
        raise InvalidArgument(f"{what}: pids must be > 0")


def _check_backend_config(config: BackendConfig | None) -> None:
    if config is None:
        return
    if config.cuda is not None and config.cuda.explicit_target is not None:
        _check_pids(config.cuda.explicit_target.pids, "backend_config.cuda.explicit_target")
    if config.direct_memory is not None and config.direct_memory.explicit_target is not None:
        _check_pids(
            config.direct_memory.explicit_target.pids,
            "backend_config.direct_memory.explicit_target",
        )
    if config.app_endpoint is not None:
        _check_tags(config.app_endpoint.tags, "backend_config.app_endpoint.tags")
        if len(config.app_endpoint.endpoints) > MAX_TAGS:
            raise InvalidArgument("backend_config.app_endpoint.endpoints: too many entries")
    if config.app_channel is not None:
        _check_tags(config.app_channel.tags, "backend_config.app_channel.tags")
    if config.memory_regions is not None:
        regions = config.memory_regions.regions
        if len(regions) > MAX_REGIONS:
            raise InvalidArgument("backend_config.memory_regions.regions: too many entries")
        _check_pids((r.pid for r in regions), "backend_config.memory_regions.regions")
        if len(config.memory_regions.snapshot_name) > MAX_TAG_LENGTH:
            raise InvalidArgument("backend_config.memory_regions.snapshot_name is too long")


def _validate_operator_request(job_id: str, group: str, config: BackendConfig | None) -> None:
    validate_job_id(job_id)
    if group:
        validate_group_id(group)
    _check_backend_config(config)


def operation_response(op: NodeOperation, now: float | None = None) -> GetOperationResponse:
    """The contract's view of an orchestrator operation: PENDING until it ends (waiting or
    running), COMPLETE with the bytes its checkpoint or restore moved (parked in host memory
    or brought back: the same bytes, so both counts), FAILED with the reason."""
    end = op.finished_at if op.finished_at else (time.time() if now is None else now)
    elapsed_ms = max(0, round((end - op.requested_at) * 1000))
    if op.state is OperationState.SUCCEEDED:
        return GetOperationResponse(
            status=OperationStatus.COMPLETE,
            storage_bytes=op.bytes_moved,
            snapshot_device_bytes=op.bytes_moved,
            elapsed_ms=elapsed_ms,
        )
    if op.state is OperationState.FAILED:
        return GetOperationResponse(
            status=OperationStatus.FAILED, elapsed_ms=elapsed_ms, error=op.error or "failed"
        )
    return GetOperationResponse(status=OperationStatus.PENDING, elapsed_ms=elapsed_ms)


# ----- the services ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Channel:
    """What one WorkloadChannel registration turns hooks into."""

    mode: SuspendMode
    tags: list[str]


class SnapshotAgentService:
    """``snapshot_agent.v1alpha1.SnapshotAgentService`` over the agent's registry and jobs.

    ``jobs`` returns the executor's job table; ``memory`` (None without NVML) gives the
    accelerators' memory for Status; ``on_refused(reason)`` counts refused registrations;
    ``operations`` forwards Snapshot / Restore / GetOperation to the orchestrator (None:
    refused, as the module docstring says).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        jobs: Callable[[], dict[str, Job]],
        *,
        memory: Callable[[], AcceleratorMemory | None] = lambda: None,
        own_pid: int | None = None,
        on_refused: Callable[[str], None] | None = None,
        operations: Operations | None = None,
    ) -> None:
        self._registry = registry
        self._operations = operations
        self._jobs = jobs
        self._memory = memory
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._on_refused = on_refused

    # -- WorkloadChannel ---------------------------------------------------------------------

    def _refused(self, exc: TimeSliceError) -> GRPCError:
        reason = exc.reason if isinstance(exc, RegistrationRefused) else "invalid"
        if isinstance(exc, Timeout):
            reason = "timeout"
        elif not isinstance(exc, (RegistrationRefused, InvalidArgument)):
            reason = "other"
        log.warning("llm-d workload registration refused: %s [%s]", exc.message, reason)
        if self._on_refused is not None:
            self._on_refused(reason)
        return _status(exc)

    async def _authorize(
        self, stream: grpclib.server.Stream[WorkloadMessage, AgentCommand], job_id: str
    ) -> ProcessIdentity:
        peer, local = _addresses(stream)
        deadline = time.monotonic() + AUTHORIZE_SECONDS
        try:
            async with asyncio.timeout(AUTHORIZE_SECONDS):
                return await asyncio.to_thread(
                    _authorize_tcp, peer, local, job_id, self._own_pid, deadline
                )
        except TimeoutError:
            raise Timeout(
                f"identifying the registering process took over {AUTHORIZE_SECONDS:g} s"
            ) from None

    async def _register(
        self, stream: grpclib.server.Stream[WorkloadMessage, AgentCommand]
    ) -> tuple[Registration, _Channel]:
        try:
            async with asyncio.timeout(REGISTER_WAIT_SECONDS):
                first = await stream.recv_message()
        except TimeoutError:
            raise self._refused(
                InvalidArgument(f"no register message within {REGISTER_WAIT_SECONDS:g} s")
            ) from None
        if first is None or first.register is None:
            raise self._refused(
                InvalidArgument("the first WorkloadChannel message must be `register`")
            )
        request = first.register
        try:
            validate_job_id(request.job_id)
            validate_group_id(request.group)
            _check_capabilities(request.capabilities)
            identity = await self._authorize(stream, request.job_id)
            info = WorkerInfo(
                job_id=request.job_id,
                group_id=request.group,
                pid=identity.pid,
                app_callbacks=True,
            )
            reg = self._registry.register(info, identity)
        except TimeSliceError as exc:
            raise self._refused(exc) from None
        caps = request.capabilities or WorkloadCapabilities()
        mode = caps.default_mode
        if mode is SuspendMode.UNSPECIFIED:
            mode = SuspendMode.OFFLOAD
        log.info(
            "llm-d workload registered: job %s group %s pid %d mode %s tags %s",
            info.job_id,
            info.group_id,
            info.pid,
            mode.name,
            list(caps.tags),
        )
        return reg, _Channel(mode=mode, tags=list(caps.tags))

    @staticmethod
    async def _send_commands(
        stream: grpclib.server.Stream[WorkloadMessage, AgentCommand],
        reg: Registration,
        channel: _Channel,
    ) -> None:
        """Forward the registration's hook commands until the agent closes it."""
        while True:
            command = await reg.commands.get()
            if command is None:
                return
            if command.kind is HookKind.BEFORE_CHECKPOINT:
                out = AgentCommand(
                    command_id=command.command_id,
                    snapshot=SnapshotCommand(mode=channel.mode, tags=list(channel.tags)),
                )
            elif command.kind is HookKind.AFTER_RESTORE:
                out = AgentCommand(
                    command_id=command.command_id, restore=RestoreCommand(tags=list(channel.tags))
                )
            else:
                continue  # nothing else is a hook the workload answers
            await stream.send_message(out)

    def _receive_results(self, reg: Registration, message: WorkloadMessage) -> None:
        if message.register is not None:
            raise InvalidArgument("a second `register` on one WorkloadChannel")
        result = message.result
        if result is None:
            raise InvalidArgument("a WorkloadMessage must carry `register` or `result`")
        if len(result.command_id) > MAX_OPERATION_ID_LENGTH or len(result.error) > 64 * 1024:
            raise InvalidArgument("result: command_id or error too long")
        if result.command_id not in reg.pending:
            # Late (the hook timed out) or not this stream's: nothing waits for it.
            log.warning(
                "llm-d workload pid %d answered command %r, which is not pending for it",
                reg.info.pid,
                result.command_id[:64],
            )
            return
        try:
            self._registry.complete(
                CommandResult(command_id=result.command_id, ok=result.ok, error=result.error)
            )
        except NotFound:
            log.warning("llm-d workload pid %d answered a finished command", reg.info.pid)

    async def _receive(
        self, stream: grpclib.server.Stream[WorkloadMessage, AgentCommand], reg: Registration
    ) -> None:
        while True:
            message = await stream.recv_message()
            if message is None:
                return  # the workload closed its side: the registration ends
            self._receive_results(reg, message)

    async def workload_channel(
        self, stream: grpclib.server.Stream[WorkloadMessage, AgentCommand]
    ) -> None:
        reg, channel = await self._register(stream)
        reason = "stream ended"
        sender = asyncio.create_task(self._send_commands(stream, reg, channel))
        receiver = asyncio.create_task(self._receive(stream, reg))
        try:
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if isinstance(exc, TimeSliceError):
                    reason = f"refused: {exc.message}"
                    raise _status(exc)
                if exc is not None:
                    raise exc
        except asyncio.CancelledError:
            reason = "workload disconnected"
            raise
        finally:
            for task in (sender, receiver):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)
            self._registry.unregister(reg, reason)
        if reg.closed_reason is not None and reg.closed_reason != reason:
            raise GRPCError(
                Status.UNAVAILABLE, f"registration closed by the agent: {reg.closed_reason}"
            )

    # -- Status ------------------------------------------------------------------------------

    async def status(self, stream: grpclib.server.Stream[StatusRequest, StatusResponse]) -> None:
        await stream.recv_message()
        jobs = self._jobs()
        statuses = [
            JobStatus(job_id=job.job_id, state=_JOB_STATES[job.state])
            for job in sorted(jobs.values(), key=lambda j: j.job_id)
        ]
        registered = sorted({w.job_id for w in self._registry.workers()} - jobs.keys())
        statuses += [JobStatus(job_id=j, state=LlmdJobState.IDLE) for j in registered]
        accelerators: list[AcceleratorStatus] = []
        memory = self._memory()
        if memory is not None:
            try:
                accelerators = [
                    AcceleratorStatus(id=ident, memory_used_bytes=used, memory_total_bytes=total)
                    for ident, used, total in await memory.usage()
                ]
            except Exception as exc:  # NVML errors vary by driver; Status still answers
                log.warning("llm-d Status: NVML failed: %r", exc)
        await stream.send_message(
            StatusResponse(job_statuses=statuses, accelerator_statuses=accelerators)
        )

    # -- Snapshot / Restore / GetOperation -----------------------------------------------------

    def _check_state(self, what: str, job_id: str, group: str, needs: JobState) -> str:
        """The job's group on this node, if it is in the state ``what`` needs; else the
        contract's refusal (NOT_FOUND, ABORTED while TRANSITIONING, FAILED_PRECONDITION)."""
        job = self._jobs().get(job_id)
        state = job.state if job is not None else None
        workers = self._registry.workers_of(job_id)
        known = job.group_id if job is not None else (workers[0].group_id if workers else "")
        if state is None and workers:
            state = JobState.IDLE  # registered; nothing moved yet (as Status says)
        if state is None:
            raise GRPCError(Status.NOT_FOUND, f"job {job_id} is not known on this node")
        if group and group != known:
            raise GRPCError(
                Status.NOT_FOUND, f"job {job_id} is in group {known} on this node, not {group}"
            )
        if state is JobState.TRANSITIONING:
            raise GRPCError(
                Status.ABORTED, f"job {job_id} is transitioning; try again when it settled"
            )
        if state is not needs:
            raise GRPCError(
                Status.FAILED_PRECONDITION,
                f"{what} needs the job {needs.name}; job {job_id} is {state.name}",
            )
        return known

    async def _operate(self, what: str, job_id: str, group: str, needs: JobState) -> str:
        """Check the job here, then ask the orchestrator for the operation; its id."""
        known = self._check_state(what, job_id, group, needs)
        if self._operations is None:
            raise GRPCError(
                Status.FAILED_PRECONDITION, OPERATOR_REFUSAL.format(what=what, harm=_HARM[what])
            )
        kind = OperationKind.SNAPSHOT if what == "snapshot" else OperationKind.RESTORE
        try:
            op = await self._operations.start(kind, job_id, known)
        except GRPCError as exc:
            # The orchestrator's status (FAILED_PRECONDITION with its reason, ...) goes back
            # as is, saying who refused.
            raise GRPCError(exc.status, f"orchestrator: {exc.message}", exc.details) from None
        log.info("llm-d operator %s of job %s: operation %s", what, job_id, op.operation_id)
        return op.operation_id

    async def snapshot(
        self, stream: grpclib.server.Stream[SnapshotRequest, SnapshotResponse]
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        try:
            _validate_operator_request(request.job_id, request.group, request.backend_config)
        except TimeSliceError as exc:
            raise _status(exc) from None
        op = await self._operate("snapshot", request.job_id, request.group, JobState.RUNNING)
        await stream.send_message(SnapshotResponse(operation_id=op))

    async def restore(self, stream: grpclib.server.Stream[RestoreRequest, RestoreResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        try:
            _validate_operator_request(request.job_id, request.group, request.backend_config)
        except TimeSliceError as exc:
            raise _status(exc) from None
        op = await self._operate("restore", request.job_id, request.group, JobState.SAVED)
        await stream.send_message(RestoreResponse(operation_id=op))

    async def get_operation(
        self, stream: grpclib.server.Stream[GetOperationRequest, GetOperationResponse]
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        op = request.operation_id
        if not op or len(op) > MAX_OPERATION_ID_LENGTH or not op.isprintable():
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"operation_id must be 1 to {MAX_OPERATION_ID_LENGTH} printable characters",
            )
        if self._operations is None:
            raise GRPCError(
                Status.NOT_FOUND,
                f"no operation {op[:64]!r}: this agent starts no operator snapshots or restores "
                "(docs/llmd-agent.md)",
            )
        await stream.send_message(operation_response(await self._operations.get(op)))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            f"/{SERVICE}/Snapshot": grpclib.const.Handler(
                self.snapshot, unary, SnapshotRequest, SnapshotResponse
            ),
            f"/{SERVICE}/Restore": grpclib.const.Handler(
                self.restore, unary, RestoreRequest, RestoreResponse
            ),
            f"/{SERVICE}/GetOperation": grpclib.const.Handler(
                self.get_operation, unary, GetOperationRequest, GetOperationResponse
            ),
            f"/{SERVICE}/Status": grpclib.const.Handler(
                self.status, unary, StatusRequest, StatusResponse
            ),
            f"/{SERVICE}/WorkloadChannel": grpclib.const.Handler(
                self.workload_channel,
                grpclib.const.Cardinality.STREAM_STREAM,
                WorkloadMessage,
                AgentCommand,
            ),
        }


class HealthService:
    """``grpc.health.v1.Health/Check``: ``service`` names a backend type.

    The default (empty) and ``app-channel`` (WorkloadChannel: hooks run on every backend) are
    SERVING while the agent is connected to an orchestrator; the agent's own backend name
    (``cuda``, ``app``, ``freeze``, ``sim``) likewise; every other name is NOT_SERVING.
    """

    def __init__(self, backend: str, ready: Callable[[], bool]) -> None:
        self._served = {"", APP_CHANNEL, backend}
        self._ready = ready

    async def check(
        self, stream: grpclib.server.Stream[HealthCheckRequest, HealthCheckResponse]
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        if len(request.service) > MAX_HEALTH_SERVICE_LENGTH:
            raise GRPCError(Status.INVALID_ARGUMENT, "service name too long")
        serving = request.service in self._served and self._ready()
        await stream.send_message(
            HealthCheckResponse(
                status=HealthCheckResponseServingStatus.SERVING
                if serving
                else HealthCheckResponseServingStatus.NOT_SERVING
            )
        )

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/{HEALTH_SERVICE}/Check": grpclib.const.Handler(
                self.check,
                grpclib.const.Cardinality.UNARY_UNARY,
                HealthCheckRequest,
                HealthCheckResponse,
            )
        }


__all__ = [
    "HealthService",
    "SnapshotAgentService",
    "holders_of",
    "loopback_peer",
    "operation_response",
    "socket_inode",
]
