"""Worker-side registration with the node's snapshot agent.

Every process that owns device state (a trainer rank, an inference engine) announces itself to
the agent on its node, so the agent knows which processes to checkpoint and restore for a
job. The registration lives exactly as long as a server stream to the agent's unix socket
(``WorkerLink.Register``): the agent notices a dead worker when the stream breaks. If the agent
restarts, the worker registers again on its own.

App-aware workers pass ``on_checkpoint`` / ``on_restore``: the agent then sends hook commands
down the stream before it checkpoints and after it restores, and the callbacks' answers
(bytes moved, or the error) go back with ``CompleteCommand``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import cast

from grpclib.client import Channel

from timeslice._transport import map_error
from timeslice._validate import check_seconds
from timeslice.backoff import Backoff
from timeslice.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    TimeSliceError,
    Unavailable,
)
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.status_details import KIND_CODEC
from timeslice_proto.timeslice.v1 import (
    CommandResult,
    HookKind,
    WorkerCommand,
    WorkerInfo,
    WorkerLinkStub,
)

log = logging.getLogger("timeslice.worker")

DEFAULT_AGENT_SOCKET = "/run/timeslice/agent.sock"


@dataclass(frozen=True)
class HookResult:
    """What a checkpoint/restore hook did, when a plain byte count does not say it all."""

    bytes_moved: int
    """Device bytes the hook took off the device (checkpoint) or put back (restore)."""
    bytes_skipped: int = 0
    """Of ``bytes_moved``: bytes released without a copy, because the host already held
    them unchanged (``TorchOffloader(keep_pinned=True)``)."""
    host_bytes_kept: int = 0
    """After a restore: host memory this worker keeps for its state (a reusable host copy).
    The agent's host-memory admission does not ask for it again at the next checkpoint."""


HookCallback = Callable[[], int | HookResult | None]
"""A checkpoint/restore hook: does its work and returns the bytes it moved (an int, a
:class:`HookResult`, or ``None`` for nothing)."""

_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
# Reconnects after the agent went away back off up to this many seconds.
_RECONNECT_MAX = 2.0
_COMPLETE_TIMEOUT = 10.0
_STABLE_SECONDS = 1.0

# This process's registrations that were accepted and not closed (see check_can_enter).
_live: set[WorkerRegistration] = set()
_live_lock = threading.Lock()


class WorkerRegistration:
    """A live registration of this worker process with its node agent.

    Returned by :func:`register`. It stays registered (re-registering after an agent restart)
    until :meth:`close` is called or the process exits. Usable as a context manager.
    """

    def __init__(
        self,
        info: WorkerInfo,
        socket_path: str,
        on_checkpoint: HookCallback | None,
        on_restore: HookCallback | None,
    ) -> None:
        self.info = info
        """What was sent to the agent (job, group, pid, state bytes, flags)."""
        self.socket_path = socket_path
        self._on_checkpoint = on_checkpoint
        self._on_restore = on_restore
        self._first: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task[None] | None = None
        self._closing = False
        self._connected = False
        self.commands_handled = 0
        """Hook commands answered so far."""
        self.last_error: TimeSliceError | None = None
        """The last error on the link to the agent, if any."""
        self._thread = threading.Thread(
            target=self._run, name=f"timeslice-worker-{info.job_id}", daemon=True
        )
        # The finalizer holds a reference to this object on purpose (through _cancel): a
        # registration must not end just because the caller dropped the handle. It runs on
        # close() or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop, self._loop, self._thread, self._cancel)

    @property
    def connected(self) -> bool:
        """True while the stream to the agent is open and accepted."""
        return self._connected

    @property
    def live(self) -> bool:
        """True from acceptance until :meth:`close`, or until the agent refused it for good
        (a registration that lost its agent and re-registers stays live)."""
        return not self.closed and self._first.done() and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return not self._finalizer.alive

    def close(self) -> None:
        """End the registration (the agent sees the stream end). Idempotent."""
        self._closing = True
        with _live_lock:
            _live.discard(self)
        self._finalizer()

    def __enter__(self) -> WorkerRegistration:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"WorkerRegistration(job_id={self.info.job_id!r}, group_id={self.info.group_id!r}, "
            f"pid={self.info.pid}, socket={self.socket_path!r}, connected={self._connected})"
        )

    # ----------------------------------------------------------------- internals

    def _start(self, timeout: float) -> None:
        self._thread.start()
        done, _ = concurrent.futures.wait([self._first], timeout=timeout)
        if not done:
            self.close()
            detail = f": {self.last_error}" if self.last_error is not None else ""
            raise Unavailable(
                f"could not register with the timeslice agent at {self.socket_path} within "
                f"{timeout:g}s{detail}"
            )
        error = self._first.exception()
        if error is not None:
            self.close()
            raise error
        with _live_lock:
            if not self.closed:
                _live.add(self)

    def _cancel(self) -> None:
        # Runs on the loop thread (scheduled by _stop).
        self._closing = True
        if self._main is not None:
            self._main.cancel()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._main = self._loop.create_task(self._serve_forever())
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("worker registration of job %s crashed", self.info.job_id)
        finally:
            self._connected = False
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
            finally:
                self._loop.close()
                if not self._first.done():
                    self._first.set_exception(
                        Unavailable("the worker registration stopped before it was accepted")
                    )

    async def _serve_forever(self) -> None:
        backoff = Backoff(maximum=_RECONNECT_MAX)
        loop = asyncio.get_running_loop()
        while not self._closing:
            started = loop.time()
            try:
                await self._serve_once()
                error: TimeSliceError = Unavailable("the agent ended the registration stream")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                mapped = map_error(exc, f"agent at {self.socket_path}")
                if mapped is None:
                    raise
                error = mapped
            if self._connected and loop.time() - started > _STABLE_SECONDS:
                # A registration that held for a while starts its reconnects afresh; one that
                # the agent keeps dropping at once keeps backing off.
                backoff.reset()
            self._connected = False
            self.last_error = error
            if not isinstance(error, Unavailable):
                # A refusal (bad job id, ...) will not get better by retrying.
                if not self._first.done():
                    self._first.set_exception(error)
                else:
                    log.error("the agent refused worker %s: %s", self.info.pid, error)
                return
            if self._first.done():
                log.warning(
                    "lost the timeslice agent at %s (%s); re-registering", self.socket_path, error
                )
            await asyncio.sleep(backoff.next_delay())

    async def _serve_once(self) -> None:
        channel = Channel(path=self.socket_path, status_details_codec=KIND_CODEC)
        try:
            stub = WorkerLinkStub(channel)
            commands = cast(AsyncGenerator[WorkerCommand, None], stub.register(self.info))
            async with contextlib.aclosing(commands) as stream:
                first = True
                async for command in stream:
                    if first:
                        if command.kind != HookKind.REGISTERED:
                            raise InternalError(
                                f"the agent's first message was {command.kind!r}, "
                                "expected REGISTERED"
                            )
                        first = False
                        self._connected = True
                        self.last_error = None
                        if not self._first.done():
                            self._first.set_result(None)
                        else:
                            log.info(
                                "re-registered with the timeslice agent at %s", self.socket_path
                            )
                        continue
                    await self._handle(stub, command)
        finally:
            channel.close()

    async def _handle(self, stub: WorkerLinkStub, command: WorkerCommand) -> None:
        callback: HookCallback | None
        if command.kind == HookKind.BEFORE_CHECKPOINT:
            callback = self._on_checkpoint
        elif command.kind == HookKind.AFTER_RESTORE:
            callback = self._on_restore
        else:
            await self._complete(
                stub,
                CommandResult(
                    command_id=command.command_id,
                    ok=False,
                    error=f"unknown hook kind {command.kind!r}",
                ),
            )
            return
        if callback is None:
            # This worker has no hook of that kind: nothing to do is success.
            result = CommandResult(command_id=command.command_id, ok=True)
        else:
            result = await self._run_callback(callback, command)
        await self._complete(stub, result)

    async def _run_callback(self, callback: HookCallback, command: WorkerCommand) -> CommandResult:
        name = getattr(callback, "__qualname__", repr(callback))
        try:
            # Hooks block (they move tensors): run them off the loop so the stream stays live.
            moved = await asyncio.to_thread(callback)
        except Exception as exc:
            log.exception("hook %s for command %s failed", name, command.command_id)
            return CommandResult(
                command_id=command.command_id, ok=False, error=f"{name} raised {exc!r}"
            )
        result = moved if isinstance(moved, HookResult) else HookResult(moved or 0)
        if not (
            _is_count(result.bytes_moved)
            and _is_count(result.bytes_skipped)
            and _is_count(result.host_bytes_kept)
            and result.bytes_skipped <= result.bytes_moved
        ):
            return CommandResult(
                command_id=command.command_id,
                ok=False,
                error=(
                    f"{name} returned {moved!r}; expected a byte count (int >= 0), None, or a "
                    "HookResult whose bytes_skipped is at most its bytes_moved"
                ),
            )
        return CommandResult(
            command_id=command.command_id,
            ok=True,
            bytes_moved=result.bytes_moved,
            bytes_skipped=result.bytes_skipped,
            host_bytes_kept=result.host_bytes_kept,
        )

    async def _complete(self, stub: WorkerLinkStub, result: CommandResult) -> None:
        try:
            await stub.complete_command(result, timeout=_COMPLETE_TIMEOUT)
        except Exception as exc:
            mapped = map_error(exc, f"CompleteCommand via {self.socket_path}")
            if mapped is None:
                raise
            # The agent bounds the hook with its own deadline; it will report the failure.
            log.warning("could not report command %s to the agent: %s", result.command_id, mapped)
            return
        self.commands_handled += 1


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT64_MAX


def _stop(
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    cancel: Callable[[], None],
) -> None:
    if thread.ident is None:
        loop.close()  # never started: nothing runs on it
        return
    if not thread.is_alive() or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(cancel)
    if threading.current_thread() is not thread:
        thread.join(_COMPLETE_TIMEOUT)


def check_can_enter(job_id: str, group_id: str) -> None:
    """Refuse a phase of ``group_id`` by ``job_id`` that this process cannot serve.

    A job's registration in group A (made in this process, on any node's agent) means A's
    switches move the job's state on that node: the agent checkpoints it whenever A goes to
    another job, whatever this process is doing then. A phase of another group B by the same
    job would run with its state taken away underneath it (the agent also refuses the job in
    a second group on a node). So a job registered here may only enter the groups it is
    registered in; other jobs are not concerned (one process may serve several jobs' groups,
    the benchmarks' emulated workers do).

    Raises:
        FailedPrecondition: the job is registered here in other groups only.
    """
    with _live_lock:
        mine = [r for r in _live if r.info.job_id == job_id and r.live]
    groups = sorted({r.info.group_id for r in mine})
    if not groups or group_id in groups:
        return
    registered = ", ".join(groups)
    raise FailedPrecondition(
        f"job {job_id} cannot enter a phase of group {group_id} from this process: the process "
        f"registered the job's state with the node agent in group {registered}, whose switches "
        f"offload that state whenever the group goes to another job, also in the middle of a "
        f"phase of {group_id}. A process serves one group per node: acquire only {registered} "
        f"here (one group for all of the job's phases on these devices), or run the phases of "
        f"{group_id} in a process registered in {group_id}, as another job id if it is on "
        "this node"
    )


def register(
    group_id: str,
    *,
    job_id: str | None = None,
    pid: int | None = None,
    state_bytes: int = 0,
    socket: str | None = None,
    on_checkpoint: HookCallback | None = None,
    on_restore: HookCallback | None = None,
    acquirer: bool = False,
    timeout: float = 10.0,
) -> WorkerRegistration:
    """Register this worker process with its node's timeslice agent.

    Returns once the agent has the worker and, when the agent is connected to an orchestrator
    that confirms it, once the orchestrator has recorded it (at most 3 s more): an
    ``acquire`` right after ``register`` is then planned with this worker's device state.

    Args:
        group_id: the accelerator group the worker's devices belong to.
        job_id: the job; default ``TIMESLICE_JOB_ID``.
        pid: the process holding the device state; default this process. It must be this
            process or one of its descendants: the agent checks the caller's credentials and
            refuses any other pid. It is the pid as this process sees it (``os.getpid()``, in
            its own pid namespace, for instance a pod's without ``hostPID``): the agent
            translates it to the node's.
        state_bytes: device bytes the job's state takes on this node (sim backend, admission).
        socket: the agent's unix socket; default ``TIMESLICE_AGENT_SOCKET``, else
            ``/run/timeslice/agent.sock``.
        on_checkpoint: called (in a worker thread) before the agent checkpoints the job;
            returns the bytes it moved, or ``None``. An exception fails the checkpoint.
        on_restore: likewise, after the agent restored the job.
        acquirer: this process calls ``acquire`` itself, so it must never be frozen.
        timeout: seconds to wait for the agent to accept the registration.

    Raises:
        InvalidArgument: bad ids or arguments (nothing is sent).
        PermissionDenied: ``pid`` is not this process or a descendant of it, runs as another
            user, or is labelled for another job (the agent recorded nothing).
        Unavailable: the agent could not be reached or did not accept in time.
    """
    group = validate_group_id(group_id)
    if job_id is None:
        job_id = os.environ.get("TIMESLICE_JOB_ID") or None
    if job_id is None:
        raise InvalidArgument(
            "no job id: pass job_id=... or set the TIMESLICE_JOB_ID environment variable"
        )
    job = validate_job_id(job_id)
    if pid is None:
        pid = os.getpid()
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _UINT32_MAX:
        raise InvalidArgument(f"pid must be a positive int, got {pid!r}")
    if (
        isinstance(state_bytes, bool)
        or not isinstance(state_bytes, int)
        or not 0 <= state_bytes <= _UINT64_MAX
    ):
        raise InvalidArgument(f"state_bytes must be an int >= 0, got {state_bytes!r}")
    for name, hook in (("on_checkpoint", on_checkpoint), ("on_restore", on_restore)):
        if hook is None:
            continue
        if not callable(hook) or inspect.iscoroutinefunction(hook):
            raise InvalidArgument(f"{name} must be a plain (non-async) callable")
    wait = check_seconds(timeout, "timeout")
    assert wait is not None
    path = socket or os.environ.get("TIMESLICE_AGENT_SOCKET") or DEFAULT_AGENT_SOCKET
    info = WorkerInfo(
        job_id=job,
        group_id=group,
        pid=pid,
        state_bytes=state_bytes,
        app_callbacks=on_checkpoint is not None or on_restore is not None,
        acquirer=bool(acquirer),
        # Lets the agent check that this message comes from the process that connected.
        registrant_pid=os.getpid(),
    )
    registration = WorkerRegistration(info, path, on_checkpoint, on_restore)
    registration._start(wait)
    return registration
