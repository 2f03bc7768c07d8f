"""Worker registrations and the local ``WorkerLink`` gRPC service.

A GPU worker process registers with ``WorkerLink.Register(WorkerInfo)`` over the agent's unix
socket and keeps the response stream open: the registration lives exactly as long as that
stream. The first message down the stream is ``HOOK_KIND_REGISTERED``; workers that asked for
app callbacks later receive ``BEFORE_CHECKPOINT`` / ``AFTER_RESTORE`` commands and answer each
with ``CompleteCommand``. When the stream ends (the process exited, the worker cancelled) the
registration is removed; a sweep every two seconds also drops registrations whose process is
gone (or whose pid now names another process), in case a stream outlives its process.

**A worker registers only itself or its descendants.** The kernel says who connected
(``SO_PEERCRED``); :func:`timeslice_agent.peers.authorize_registration` refuses, with
PERMISSION_DENIED and nothing recorded, a pid that is not the peer or a descendant of it, runs
as another uid, or is labelled for another job. An accepted registration pins the process's
identity (start time, uids); the backends act on the pid only while it still matches.

**Pids are the agent's.** A worker in another pid namespace (a pod without ``hostPID``) sends
the pid it sees; the registration records the same process's pid in the agent's namespace
(see :mod:`timeslice_agent.peers`), and everything downstream (backends, sweeps, the
orchestrator's view) uses that one. Every refusal is counted by reason (``on_refused``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpclib.const
import grpclib.server
from grpclib.exceptions import GRPCError

from timeslice.errors import InvalidArgument, NotFound, PermissionDenied, Timeout, TimeSliceError
from timeslice.ids import validate_group_id, validate_job_id
from timeslice_agent.discovery import Discovered, labels_of
from timeslice_agent.peers import (
    RegistrationRefused,
    authorize_registration,
    credentials_of_stream,
)
from timeslice_agent.procs import ProcessIdentity, identity_of, pid_exists
from timeslice_proto.timeslice.v1 import (
    CommandResult,
    CommandResultAck,
    HookKind,
    WorkerCommand,
    WorkerInfo,
)

log = logging.getLogger(__name__)

SWEEP_INTERVAL_SECONDS = 2.0
# Checking a registration reads a few /proc files of the peer's processes; a process stuck in
# the kernel can hold such a read, so the check has a deadline (the registration is refused).
AUTHORIZE_SECONDS = 5.0


class HookFailed(Exception):
    """An app callback failed, timed out, or its worker went away; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Moved:
    """Device bytes a move took off (or put back on) the device; ``bytes_skipped`` of them
    were released without a copy, the host already holding them unchanged."""

    bytes_moved: int = 0
    bytes_skipped: int = 0
    host_bytes_kept: int = 0
    """After a restore: host memory the workers keep for the state, reused by its next
    checkpoint (their kept pinned copies)."""


@dataclass(frozen=True)
class HookOutcome:
    """A worker's answer to one hook command."""

    pid: int
    ok: bool
    error: str
    bytes_moved: int
    bytes_skipped: int = 0
    host_bytes_kept: int = 0


@dataclass
class Registration:
    """One live ``Register`` stream."""

    reg_id: int
    info: WorkerInfo
    registered_at: float
    identity: ProcessIdentity | None = None
    commands: asyncio.Queue[WorkerCommand | None] = field(default_factory=asyncio.Queue)
    pending: set[str] = field(default_factory=set)
    closed_reason: str | None = None


@dataclass
class _Waiter:
    registration: Registration
    future: asyncio.Future[HookOutcome]


def _hook_name(kind: HookKind) -> str:
    return kind.name.lower()


class WorkerRegistry:
    """The workers registered on this node, and the hook round trips to them.

    ``check`` is called before a registration is accepted and may raise
    :class:`~timeslice.errors.InvalidArgument` (the executor uses it to keep a job in one group);
    ``on_change(job_id)`` is called after the set of workers of ``job_id`` changed.
    """

    def __init__(
        self,
        *,
        on_change: Callable[[str], None],
        check: Callable[[WorkerInfo], None] | None = None,
    ) -> None:
        self._on_change = on_change
        self._check = check
        self._ids = itertools.count(1)
        self._registrations: dict[int, Registration] = {}
        self._discovered: dict[tuple[str, int], Discovered] = {}
        self._waiters: dict[str, _Waiter] = {}

    def __len__(self) -> int:
        return len(self._registrations)

    @staticmethod
    def validate(info: WorkerInfo) -> None:
        """Raise InvalidArgument if the ids or the pid of ``info`` are malformed."""
        validate_job_id(info.job_id)
        validate_group_id(info.group_id)
        if info.pid <= 0:
            raise InvalidArgument(f"pid must be > 0, got {info.pid}")

    def register(self, info: WorkerInfo, identity: ProcessIdentity | None = None) -> Registration:
        """Validate and add a registration; raises InvalidArgument and changes nothing if bad.

        ``identity``: the process :func:`~timeslice_agent.peers.authorize_registration` pinned
        for the socket's peer. Without one (in-process callers) the process now at the pid is
        pinned, after the same job-label check.
        """
        self.validate(info)
        if identity is None:
            labels = labels_of(info.pid)
            if labels is not None and labels.job_id != info.job_id:
                raise PermissionDenied(
                    f"pid {info.pid} belongs to job {labels.job_id} by its environment "
                    f"(TIMESLICE_JOB_ID); it cannot be registered for job {info.job_id}"
                )
            identity = identity_of(info.pid)
        for other in self._registrations.values():
            if other.info.job_id == info.job_id and other.info.group_id != info.group_id:
                raise InvalidArgument(
                    f"job {info.job_id} is registered in group {other.info.group_id} on this "
                    f"node, not {info.group_id}"
                )
        if self._check is not None:
            self._check(info)
        reg = Registration(
            reg_id=next(self._ids), info=info, registered_at=time.time(), identity=identity
        )
        self._registrations[reg.reg_id] = reg
        log.info(
            "worker registered: job %s group %s pid %d state_bytes %d app_callbacks %s acquirer %s",
            info.job_id,
            info.group_id,
            info.pid,
            info.state_bytes,
            info.app_callbacks,
            info.acquirer,
        )
        self._on_change(info.job_id)
        return reg

    def unregister(self, reg: Registration, reason: str) -> None:
        """Remove a registration (idempotent); fails its pending hooks."""
        if self._registrations.pop(reg.reg_id, None) is None:
            return
        if reg.closed_reason is None:
            reg.closed_reason = reason
        for command_id in list(reg.pending):
            waiter = self._waiters.pop(command_id, None)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_exception(
                    HookFailed(f"worker pid {reg.info.pid} went away during the hook ({reason})")
                )
        reg.pending.clear()
        # Wake the stream handler so it ends the stream if it is still open.
        reg.commands.put_nowait(None)
        log.info("worker unregistered: job %s pid %d (%s)", reg.info.job_id, reg.info.pid, reason)
        self._on_change(reg.info.job_id)

    def workers(self) -> list[WorkerInfo]:
        """Current workers, one per (job, pid): a re-registration replaces the older entry.

        Discovered processes (see :meth:`set_discovered`) follow the registered ones; a
        registration of the same (job, pid) wins, since it may carry app callbacks.
        """
        latest: dict[tuple[str, int], Registration] = {}
        for reg in self._registrations.values():
            key = (reg.info.job_id, reg.info.pid)
            if key not in latest or latest[key].reg_id < reg.reg_id:
                latest[key] = reg
        registered = [r.info for r in sorted(latest.values(), key=lambda r: r.reg_id)]
        found = [d.info for key, d in sorted(self._discovered.items()) if key not in latest]
        return registered + found

    def identities_of(self, job_id: str) -> tuple[ProcessIdentity, ...]:
        """The pinned process behind each pid of ``job_id`` (the newest registration wins)."""
        pinned: dict[int, ProcessIdentity] = {
            pid: d.identity for (job, pid), d in self._discovered.items() if job == job_id
        }
        for reg in sorted(self._registrations.values(), key=lambda r: r.reg_id):
            if reg.info.job_id == job_id and reg.identity is not None:
                pinned[reg.info.pid] = reg.identity
        return tuple(pinned[pid] for pid in sorted(pinned))

    def set_discovered(self, found: list[Discovered]) -> None:
        """Replace the discovered processes; notifies each job whose set changed."""
        fresh: dict[tuple[str, int], Discovered] = {}
        for item in found:
            info = item.info
            try:
                if self._check is not None:
                    self._check(info)
            except InvalidArgument as exc:
                log.warning("ignoring discovered pid %d: %s", info.pid, exc.message)
                continue
            fresh[info.job_id, info.pid] = item
        # A pid whose process changed (reused within the job) counts as gone and found again.
        changed = {
            job
            for job, pid in fresh.keys() | self._discovered.keys()
            if fresh.get((job, pid)) != self._discovered.get((job, pid))
        }
        if not changed:
            return
        for job, pid in sorted(fresh.keys() - self._discovered.keys()):
            log.info(
                "process discovered: job %s group %s pid %d",
                job,
                fresh[job, pid].info.group_id,
                pid,
            )
        self._discovered = fresh
        for job_id in sorted(changed):
            self._on_change(job_id)

    def workers_of(self, job_id: str) -> list[WorkerInfo]:
        return [w for w in self.workers() if w.job_id == job_id]

    def _hook_targets(self, job_id: str) -> list[Registration]:
        latest: dict[int, Registration] = {}
        for reg in self._registrations.values():
            if reg.info.job_id == job_id and reg.info.app_callbacks:
                if reg.info.pid not in latest or latest[reg.info.pid].reg_id < reg.reg_id:
                    latest[reg.info.pid] = reg
        return list(latest.values())

    async def run_hooks(self, job_id: str, group_id: str, kind: HookKind, timeout: float) -> Moved:
        """Send ``kind`` to every app-callback worker of the job and wait for all answers.

        Returns the bytes the workers reported moving (and skipping). Raises
        :class:`HookFailed` if any worker answers not-ok, goes away, or does not answer within
        ``timeout`` seconds.
        """
        targets = self._hook_targets(job_id)
        if not targets:
            return Moved()
        loop = asyncio.get_running_loop()
        issued: list[tuple[str, Registration, asyncio.Future[HookOutcome]]] = []
        for reg in targets:
            command_id = uuid.uuid4().hex
            future: asyncio.Future[HookOutcome] = loop.create_future()
            self._waiters[command_id] = _Waiter(reg, future)
            reg.pending.add(command_id)
            reg.commands.put_nowait(
                WorkerCommand(command_id=command_id, kind=kind, job_id=job_id, group_id=group_id)
            )
            issued.append((command_id, reg, future))
        name = _hook_name(kind)
        try:
            async with asyncio.timeout(timeout):
                outcomes = await asyncio.gather(*(f for _, _, f in issued))
        except TimeoutError:
            late = [reg.info.pid for _, reg, f in issued if not f.done()]
            raise HookFailed(
                f"hook {name} timed out after {timeout:g} s waiting for worker pid(s) {late}"
            ) from None
        finally:
            for command_id, reg, future in issued:
                self._waiters.pop(command_id, None)
                reg.pending.discard(command_id)
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    # gather stops at the first failure; retrieve the rest so none is unobserved.
                    future.exception()
        failed = [o for o in outcomes if not o.ok]
        if failed:
            detail = "; ".join(f"pid {o.pid}: {o.error or 'no reason given'}" for o in failed)
            raise HookFailed(f"hook {name} failed: {detail}")
        # A worker's skipped bytes are part of its moved ones (the worker checks so).
        return Moved(
            sum(o.bytes_moved for o in outcomes),
            sum(min(o.bytes_skipped, o.bytes_moved) for o in outcomes),
            sum(o.host_bytes_kept for o in outcomes),
        )

    def complete(self, result: CommandResult) -> None:
        """Resolve a pending hook; raises :class:`NotFound` for an unknown command id."""
        waiter = self._waiters.pop(result.command_id, None)
        if waiter is None or waiter.future.done():
            raise NotFound(f"no pending command {result.command_id!r}")
        waiter.registration.pending.discard(result.command_id)
        waiter.future.set_result(
            HookOutcome(
                pid=waiter.registration.info.pid,
                ok=result.ok,
                error=result.error,
                bytes_moved=result.bytes_moved,
                bytes_skipped=result.bytes_skipped,
                host_bytes_kept=result.host_bytes_kept,
            )
        )

    @staticmethod
    def _gone(regs: list[Registration]) -> list[Registration]:
        """The registrations whose pinned process is gone (blocking /proc reads)."""
        gone = []
        for reg in regs:
            if not pid_exists(reg.info.pid):
                gone.append(reg)
            elif reg.identity is not None and identity_of(reg.info.pid) != reg.identity:
                gone.append(reg)  # exited, and the pid already names another process
        return gone

    def _drop(self, gone: list[Registration]) -> int:
        for reg in gone:
            self.unregister(reg, f"process {reg.info.pid} no longer exists")
        return len(gone)

    def sweep(self) -> int:
        """Drop registrations whose process no longer exists; returns how many."""
        return self._drop(self._gone(list(self._registrations.values())))

    async def sweep_forever(self, interval: float = SWEEP_INTERVAL_SECONDS) -> None:
        """Sweep every ``interval`` seconds until cancelled (the /proc reads off the loop)."""
        while True:
            await asyncio.sleep(interval)
            try:
                async with asyncio.timeout(interval * 5):
                    gone = await asyncio.to_thread(self._gone, list(self._registrations.values()))
            except TimeoutError:
                log.warning("the worker sweep's /proc reads took over %g s", interval * 5)
                continue
            self._drop(gone)

    def close(self, reason: str) -> None:
        """Unregister everyone (agent shutdown)."""
        for reg in list(self._registrations.values()):
            self.unregister(reg, reason)


def _grpc_error(exc: TimeSliceError) -> GRPCError:
    return exc.to_grpc()


class WorkerLinkService:
    """The ``timeslice.v1.WorkerLink`` service over a :class:`WorkerRegistry` (grpclib)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        own_pid: int | None = None,
        on_refused: Callable[[str], None] | None = None,
        recorded: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._registry = registry
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._on_refused = on_refused
        # Awaited between adding a registration and telling the worker: until the
        # orchestrator has it (bounded), so an acquire right after is planned with it.
        self._recorded = recorded

    async def _authorize(
        self, stream: grpclib.server.Stream[WorkerInfo, WorkerCommand], info: WorkerInfo
    ) -> ProcessIdentity:
        """The pinned process ``info`` names, if the peer may register it; else raises.

        ``info.pid`` is read in the peer's pid namespace; the identity's pid is the agent's.
        """
        self._registry.validate(info)
        peer = credentials_of_stream(stream)
        # The thread stops walking /proc at the deadline too, rather than running on unseen.
        deadline = time.monotonic() + AUTHORIZE_SECONDS
        try:
            async with asyncio.timeout(AUTHORIZE_SECONDS):
                identity = await asyncio.to_thread(
                    authorize_registration,
                    peer,
                    info.pid,
                    info.job_id,
                    own_pid=self._own_pid,
                    registrant_pid=info.registrant_pid,
                    deadline=deadline,
                )
        except TimeoutError:
            raise Timeout(
                f"checking the registration of pid {info.pid} took over {AUTHORIZE_SECONDS:g} s"
            ) from None
        if identity.pid != info.pid:
            log.info(
                "pid %d of the worker's pid namespace is pid %d on this node (peer pid %d)",
                info.pid,
                identity.pid,
                peer.pid,
            )
        log.debug("peer pid %d uid %d may register pid %d", peer.pid, peer.uid, identity.pid)
        return identity

    def _refused(self, exc: TimeSliceError) -> None:
        if isinstance(exc, RegistrationRefused):
            reason = exc.reason
        elif isinstance(exc, InvalidArgument):
            reason = "invalid"
        elif isinstance(exc, Timeout):
            reason = "timeout"
        else:
            reason = "other"
        log.warning("worker registration refused: %s [%s]", exc.message, reason)
        if self._on_refused is not None:
            self._on_refused(reason)

    async def register(self, stream: grpclib.server.Stream[WorkerInfo, WorkerCommand]) -> None:
        info = await stream.recv_message()
        if info is None:
            self._refused(InvalidArgument("Register needs a WorkerInfo message"))
            raise _grpc_error(InvalidArgument("Register needs a WorkerInfo message"))
        try:
            identity = await self._authorize(stream, info)
            # From here on the pid is the agent's: what the backends act on and the hub sees.
            info = dataclasses.replace(info, pid=identity.pid)
            reg = self._registry.register(info, identity)
        except TimeSliceError as exc:
            self._refused(exc)
            raise _grpc_error(exc) from None
        reason = "stream ended"
        try:
            if self._recorded is not None:
                await self._recorded()
            await stream.send_message(
                WorkerCommand(
                    command_id=f"registered-{reg.reg_id}",
                    kind=HookKind.REGISTERED,
                    job_id=info.job_id,
                    group_id=info.group_id,
                )
            )
            while True:
                command = await reg.commands.get()
                if command is None:
                    break
                await stream.send_message(command)
        except asyncio.CancelledError:
            # grpclib cancels the handler when the peer resets the stream or disconnects.
            reason = "worker disconnected"
            raise
        finally:
            self._registry.unregister(reg, reason)
        if reg.closed_reason is not None and reg.closed_reason != reason:
            raise _grpc_error(NotFound(f"registration closed by the agent: {reg.closed_reason}"))

    async def complete_command(
        self, stream: grpclib.server.Stream[CommandResult, CommandResultAck]
    ) -> None:
        result = await stream.recv_message()
        if result is None:
            raise _grpc_error(InvalidArgument("CompleteCommand needs a CommandResult message"))
        try:
            self._registry.complete(result)
        except TimeSliceError as exc:
            raise _grpc_error(exc) from None
        await stream.send_message(CommandResultAck())

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/timeslice.v1.WorkerLink/Register": grpclib.const.Handler(
                self.register,
                grpclib.const.Cardinality.UNARY_STREAM,
                WorkerInfo,
                WorkerCommand,
            ),
            "/timeslice.v1.WorkerLink/CompleteCommand": grpclib.const.Handler(
                self.complete_command,
                grpclib.const.Cardinality.UNARY_UNARY,
                CommandResult,
                CommandResultAck,
            ),
        }
