"""The ``cuda`` backend: whole-process device state through NVIDIA's driver checkpoint API.

A checkpoint moves everything a process holds on its GPUs (allocations, contexts, streams)
into host memory that the driver manages, and frees the devices; a restore brings it back to
the same virtual addresses. Two paths reach the driver:

- ``driver-api``: ``cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState}`` called
  through NVIDIA's ``cuda-bindings`` from the agent process (no process spawned per toggle).
  Needs a driver with CUDA 12.8 support (r570 or newer) and a cuda-bindings release with the
  whole checkpoint API (checked at start: the agent refuses to start naming the release that
  lacks it). The agent calls ``cuInit`` once at start, which the driver requires of a process
  that restores others.
- ``cli``: the ``cuda-checkpoint`` binary (``--toggle --pid``, ``--get-state``), used when the
  API is missing and the binary is on ``PATH``; it pays a process start per toggle.

**All of a job's processes move together, in two steps** (a job whose ranks talk over NCCL
must never have one rank frozen while another runs): lock every pid, then checkpoint every
pid; restore every pid, then unlock every pid. Each step runs for all pids concurrently.
**Nothing is left half-done**: if any pid fails a step, the pids that already passed it, and
every pid for the steps before it, are put back in reverse order, and the directive fails
naming the pid, the CUDA error and the step. A directive deadline that cancels the move waits
for the calls in flight (driver calls cannot be interrupted), then rolls back the same way.

**Only the registered processes**: before the first driver call of a move, every pid is
checked against the identity pinned when it was registered (start time, uid, job label;
:func:`~.base.check_targets`), so a pid reused by another process is refused, not
checkpointed. The driver takes pids, not pidfds: the window left is between that check and
the call, microseconds for a pid the job's own process holds.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.metadata
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    BackendUnavailable,
    JobContext,
    SavedJob,
    Transfer,
    check_targets,
)
from timeslice_agent.config import AgentConfig, CudaPath, CudaSettings
from timeslice_agent.tasks import run_to_completion
from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)

# cuCheckpointProcess* arrived with CUDA 12.8 (driver r570); cuDriverGetVersion says 12080.
MIN_DRIVER_API_VERSION = 12080
_CLI_SECONDS = 300.0


class CudaUnavailable(BackendUnavailable):
    """The cuda backend cannot run on this machine; the message names what is missing."""


class ProcessState(enum.Enum):
    """A process's checkpoint state, as the driver reports it."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"


class CudaCallError(Exception):
    """One driver call failed for one pid."""

    def __init__(self, step: str, pid: int, error: str) -> None:
        super().__init__(f"{step} of pid {pid} failed: {error}")
        self.step = step
        self.pid = pid
        self.error = error


class NoCudaState(CudaCallError):
    """The driver says the process never initialised CUDA: it has nothing to move."""


@dataclass(frozen=True)
class Step:
    """One step of a move, applied to every pid at once, and how to take it back."""

    name: str
    do: Callable[[int], Awaitable[None]]
    undo: Callable[[int], Awaitable[None]]


class CheckpointDriver(Protocol):
    """The narrow interface the backend needs from the driver (a fake in unit tests)."""

    mechanism: str

    def checkpoint_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        """The steps that take running processes to checkpointed."""

    def restore_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        """The steps that take checkpointed processes back to running."""

    async def state(self, pid: int) -> ProcessState:
        """The process's state.

        Raises :class:`NoCudaState` for a process without CUDA, :class:`CudaCallError` when
        the driver cannot tell.
        """


# ----- the driver API through cuda-bindings ---------------------------------------------------


# Everything DriverApi touches in cuda.bindings.driver. Some releases ship without part of the
# checkpoint API (cuda-bindings 13.3.0 has no CUcheckpointRestoreArgs): such a release is refused
# at start, in one line, rather than failing the first restore with an AttributeError. The Args
# types are checked although DriverApi passes None, because a release missing one was not built
# with the whole API.
REQUIRED_DRIVER_SYMBOLS = (
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "CUcheckpointLockArgs",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
    "CUprocessState",
    "CUresult",
    "CUresult.CUDA_SUCCESS",
    "CUresult.CUDA_ERROR_NOT_INITIALIZED",
)


class DriverApi:
    """``cuCheckpointProcess*`` through cuda-bindings, each call in a worker thread."""

    mechanism = "driver-api"

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError:
            raise CudaUnavailable(
                "cuda-bindings is not installed (pip install 'timeslice-services[cuda]')"
            ) from None
        self.bindings_version = _bindings_version()
        missing = [name for name in REQUIRED_DRIVER_SYMBOLS if not _has_symbol(driver, name)]
        if missing:
            raise CudaUnavailable(
                f"cuda-bindings {self.bindings_version} lacks the driver checkpoint API "
                f"({', '.join(missing)}); install a cuda-bindings release that has it"
            )
        try:
            (err,) = driver.cuInit(0)
        except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError
            raise CudaUnavailable(
                f"libcuda.so.1 not found ({_first_line(exc)}); install the NVIDIA driver "
                "(r570 or newer) on this node, or choose another --backend"
            ) from None
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CudaUnavailable(f"cuInit failed: {_error_name(err)}")
        err, version = driver.cuDriverGetVersion()
        if err != driver.CUresult.CUDA_SUCCESS or version < MIN_DRIVER_API_VERSION:
            raise CudaUnavailable(
                f"the NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10}; the "
                "checkpoint API needs CUDA 12.8 (driver r570 or newer)"
            )
        self._driver: Any = driver
        self.driver_version = version

    async def _call(self, step: str, pid: int, func: Callable[[], tuple[Any, ...]]) -> Any:
        # cuda-bindings returns (CUresult,) or (CUresult, value), value None on an error.
        result = await asyncio.to_thread(func)
        err = result[0]
        if err == self._driver.CUresult.CUDA_SUCCESS:
            return result[1] if len(result) > 1 else None
        # CUDA_ERROR_NOT_INITIALIZED is the driver's answer for a pid whose process never
        # initialised CUDA: it is the only code that means "nothing to move here". The others
        # the checkpoint API documents are real failures and must not be read as that:
        # NOT_SUPPORTED / NOT_FOUND (a driver or setup without checkpoint support; cuda.core's
        # checkpoint module reads them so), INVALID_VALUE (a pid the driver cannot address; our
        # pids were just checked to be the live registered processes), ILLEGAL_STATE.
        # CRIU's driver-API plugin (plugins/cuda/cuda_plugin_driver.c) also takes
        # NOT_INITIALIZED as "no CUDA", for its restore-thread lookup.
        no_cuda = err == self._driver.CUresult.CUDA_ERROR_NOT_INITIALIZED
        raise (NoCudaState if no_cuda else CudaCallError)(step, pid, _error_name(err))

    async def lock(self, pid: int, timeout_ms: int) -> None:
        args = self._driver.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        await self._call("lock", pid, lambda: self._driver.cuCheckpointProcessLock(pid, args))

    async def checkpoint(self, pid: int) -> None:
        d = self._driver
        await self._call("checkpoint", pid, lambda: d.cuCheckpointProcessCheckpoint(pid, None))

    async def restore(self, pid: int) -> None:
        d = self._driver
        await self._call("restore", pid, lambda: d.cuCheckpointProcessRestore(pid, None))

    async def unlock(self, pid: int) -> None:
        d = self._driver
        await self._call("unlock", pid, lambda: d.cuCheckpointProcessUnlock(pid, None))

    async def state(self, pid: int) -> ProcessState:
        d = self._driver
        value = await self._call("get-state", pid, lambda: d.cuCheckpointProcessGetState(pid))
        return _STATE_BY_NAME[value.name.removeprefix("CU_PROCESS_STATE_")]

    async def restore_thread_id(self, pid: int) -> int:
        """The thread the driver restores ``pid`` on (diagnostics; CRIU users need it)."""
        d = self._driver
        tid = await self._call(
            "get-restore-thread-id", pid, lambda: d.cuCheckpointProcessGetRestoreThreadId(pid)
        )
        return int(tid)

    def checkpoint_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        async def lock(pid: int) -> None:
            await self.lock(pid, lock_timeout_ms)

        return (Step("lock", lock, self.unlock), Step("checkpoint", self.checkpoint, self.restore))

    def restore_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        async def relock(pid: int) -> None:
            await self.lock(pid, lock_timeout_ms)

        return (Step("restore", self.restore, self.checkpoint), Step("unlock", self.unlock, relock))

    async def check(self) -> None:
        """Raise :class:`CudaUnavailable` unless the driver still answers (cuDriverGetVersion)."""
        err, _ = await asyncio.to_thread(self._driver.cuDriverGetVersion)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise CudaUnavailable(
                f"the NVIDIA driver does not answer cuDriverGetVersion ({_error_name(err)}); "
                "check the driver installation (nvidia-smi) on this node"
            )


_STATE_BY_NAME = {s.name: s for s in ProcessState}


def _has_symbol(module: Any, dotted: str) -> bool:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


def _bindings_version() -> str:
    """The version of the cuda.bindings package that was imported (the one that runs)."""
    version = getattr(sys.modules.get("cuda.bindings"), "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _error_name(err: Any) -> str:
    name = getattr(err, "name", None)
    return str(name) if name else f"CUresult {int(err)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ----- the cuda-checkpoint binary -------------------------------------------------------------


class CheckpointCli:
    """The ``cuda-checkpoint`` binary: one toggle moves a process between running and saved."""

    mechanism = "cli"

    def __init__(self, binary: str) -> None:
        found = shutil.which(binary)
        if found is None:
            raise CudaUnavailable(
                f"{binary} not found on PATH (put NVIDIA's cuda-checkpoint there, or name it "
                "with --cuda-checkpoint-bin)"
            )
        self.binary = found

    def check(self) -> None:
        """Raise :class:`CudaUnavailable` unless the binary is still there to run."""
        if not os.access(self.binary, os.X_OK):
            raise CudaUnavailable(
                f"{self.binary} is not executable by the agent (uid {os.geteuid()}); fix its "
                "mode, or name another cuda-checkpoint with --cuda-checkpoint-bin"
            )

    async def _run(self, step: str, pid: int, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            self.binary,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(_CLI_SECONDS):
                out, err = await proc.communicate()
        except BaseException:
            if proc.returncode is None:
                # Let the toggle finish rather than kill it midway: a killed toggle leaves the
                # process in a state nobody knows. Wait for it, then report.
                out, err = await asyncio.shield(proc.communicate())
            raise
        if proc.returncode != 0:
            detail = (err or out).decode(errors="replace").strip() or f"exit {proc.returncode}"
            raise CudaCallError(step, pid, f"cuda-checkpoint: {detail.splitlines()[-1]}")
        return out.decode(errors="replace").strip()

    async def state(self, pid: int) -> ProcessState:
        try:
            text = await self._run("get-state", pid, "--get-state", "--pid", str(pid))
        except CudaCallError as exc:
            # The binary prints cuGetErrorString's text, "initialization error" for
            # CUDA_ERROR_NOT_INITIALIZED: the same "no CUDA here" answer as on the API path.
            if "initialization error" in exc.error or "CUDA_ERROR_NOT_INITIALIZED" in exc.error:
                raise NoCudaState(exc.step, pid, exc.error) from None
            raise
        try:
            return ProcessState(text.split()[-1].lower())
        except (ValueError, IndexError):
            raise CudaCallError("get-state", pid, f"unexpected output {text!r}") from None

    async def _toggle_to(self, pid: int, want: ProcessState, step: str) -> None:
        if await self.state(pid) is want:
            return  # idempotent: a retried toggle must not flip the process back
        await self._run(step, pid, "--toggle", "--pid", str(pid))

    async def suspend(self, pid: int) -> None:
        await self._toggle_to(pid, ProcessState.CHECKPOINTED, "toggle")

    async def resume(self, pid: int) -> None:
        await self._toggle_to(pid, ProcessState.RUNNING, "toggle")

    def checkpoint_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        return (Step("toggle", self.suspend, self.resume),)

    def restore_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        return (Step("toggle", self.resume, self.suspend),)


def open_driver(settings: CudaSettings) -> CheckpointDriver:
    """The driver path ``settings`` asks for; raises :class:`CudaUnavailable` naming the gap."""
    if settings.path is CudaPath.CLI:
        return CheckpointCli(settings.binary)
    try:
        return DriverApi()
    except CudaUnavailable as exc:
        if settings.path is CudaPath.DRIVER:
            raise
        try:
            cli = CheckpointCli(settings.binary)
        except CudaUnavailable as cli_exc:
            raise CudaUnavailable(f"{exc}; and {cli_exc}") from None
        log.warning("cuda: driver API unavailable (%s); using %s", exc, cli.binary)
        return cli


# ----- the backend ------------------------------------------------------------------------------


TargetCheck = Callable[[JobContext, tuple[int, ...]], Awaitable[None]]
"""Raises :class:`BackendRefused` unless the pids are still the job's pinned processes."""


@dataclass
class _Outcome:
    step: Step
    done: list[int]
    failure: CudaCallError | None


class CudaBackend(Backend):
    """Whole-process checkpoint of every process of a job (see the module docstring)."""

    name = "cuda"
    emulated = False
    frees_device_memory = True

    def __init__(
        self,
        driver: CheckpointDriver,
        *,
        lock_timeout_ms: int = 10_000,
        targets: TargetCheck | None = None,
    ) -> None:
        self._driver = driver
        self._lock_timeout_ms = lock_timeout_ms
        self._own_pid = os.getpid()
        # Tests of the step logic with a fake driver and invented pids replace the check.
        self._targets: TargetCheck = check_targets if targets is None else targets

    @property
    def mechanism(self) -> str:
        return self._driver.mechanism

    async def preflight(self) -> None:
        """The driver was opened by :func:`create` (libcuda loadable, every checkpoint entry
        point present, cuInit done, CUDA 12.8 or newer; or the cuda-checkpoint binary found),
        which refuses the start naming what is missing; here it must still answer."""
        driver = self._driver
        if isinstance(driver, DriverApi):
            await driver.check()
        elif isinstance(driver, CheckpointCli):
            driver.check()

    def _pids(self, job: JobContext, pids: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """``pids`` (default: all of the job's), refusing pid 1 and the agent itself."""
        chosen = job.pids if pids is None else pids
        for pid in chosen:
            if pid <= 1 or pid == self._own_pid:
                raise BackendRefused(f"job {job.job_id}: refusing to checkpoint pid {pid}")
        return chosen

    def admit_checkpoint(self, job: JobContext) -> None:
        self._pids(job)

    def admit_restore(self, job: JobContext) -> None:
        self._pids(job)

    async def _cuda_pids(self, job: JobContext) -> tuple[int, ...]:
        """The job's processes that have CUDA state to checkpoint.

        A registered process without a CUDA context (the one that calls acquire, a helper)
        has nothing to move and would fail the lock; the driver tells them apart. Should the
        driver wrongly skip a process that holds memory, the NVML check after the checkpoint
        still fails the directive.
        """
        pids = self._pids(job)
        await self._targets(job, pids)
        states = await asyncio.gather(
            *(self._driver.state(p) for p in pids), return_exceptions=True
        )
        chosen = []
        for pid, state in zip(pids, states, strict=True):
            if isinstance(state, NoCudaState):
                log.info(
                    "cuda: pid %d of job %s has no CUDA state (%s); left alone",
                    pid,
                    job.job_id,
                    state.error,
                )
            elif isinstance(state, CudaCallError):
                # Not "no CUDA": a refused or broken API. Saying so now beats NVML reporting
                # ten seconds later that the checkpoint freed nothing.
                raise BackendError(
                    f"cuda checkpoint of job {job.job_id} failed at step get-state for pid "
                    f"{pid}: {state.error}; no pid had moved [{self.mechanism}]"
                )
            elif isinstance(state, BaseException):
                raise state
            else:
                chosen.append(pid)
        return tuple(chosen)

    async def checkpoint(self, job: JobContext) -> Transfer:
        pids = await self._cuda_pids(job)
        steps = self._driver.checkpoint_steps(self._lock_timeout_ms)
        transfer = await self._move(job, "checkpoint", pids, steps)
        return Transfer(transfer.bytes_moved, transfer.elapsed_seconds, moved_pids=pids)

    async def restore(self, job: JobContext) -> Transfer:
        # Only what the checkpoint moved: a process that joined the job since is running.
        pids = self._pids(job, job.saved_pids)
        await self._targets(job, pids)
        steps = self._driver.restore_steps(self._lock_timeout_ms)
        return await self._move(job, "restore", pids, steps)

    async def _move(
        self, job: JobContext, what: str, pids: tuple[int, ...], steps: Sequence[Step]
    ) -> Transfer:
        started = time.monotonic()
        finished: list[_Outcome] = []
        try:
            for step in steps:
                outcome = await _apply(step, pids, finished)
                if outcome.failure is not None:
                    raise outcome.failure
        except CudaCallError as exc:
            await run_to_completion(_roll_back(finished))
            raise BackendError(
                f"cuda {what} of job {job.job_id} failed at step {exc.step} for pid {exc.pid}: "
                f"{exc.error}; {_rolled_back(finished)} [{self.mechanism}]"
            ) from None
        except asyncio.CancelledError:
            # The deadline ended the move: _apply waited for the calls in flight; put every
            # process back before the cancellation goes on, however often it is repeated.
            await run_to_completion(_roll_back(finished))
            raise
        elapsed = time.monotonic() - started
        log.info(
            "cuda %s of job %s: pids %s in %.3f s [%s]",
            what,
            job.job_id,
            list(pids),
            elapsed,
            self.mechanism,
        )
        # The API does not say how many bytes moved; the agent measures them with NVML.
        return Transfer(bytes_moved=job.state_bytes, elapsed_seconds=elapsed)

    async def reconcile(self, job: SavedJob) -> str | None:
        ctx = JobContext(
            job.job_id, job.group_id, saved_pids=job.saved_pids, identities=job.identities
        )
        try:
            await self._targets(ctx, job.saved_pids)
        except BackendRefused as exc:
            return exc.reason
        for pid in job.saved_pids:
            try:
                state = await self._driver.state(pid)
            except CudaCallError as exc:
                return f"cannot read the checkpoint state of pid {pid}: {exc.error}"
            if state is not ProcessState.CHECKPOINTED:
                return f"pid {pid} is {state.value}, not checkpointed"
        return None

    def devices(self, discovered: list[Device]) -> list[Device]:
        return discovered


async def _apply(step: Step, pids: Sequence[int], finished: list[_Outcome]) -> _Outcome:
    """Run ``step`` for every pid concurrently and append the outcome to ``finished``.

    Cancellation does not interrupt the calls (a driver call cannot be); it waits for them,
    records which pids passed, and re-raises so the caller rolls back.
    """
    tasks: dict[asyncio.Future[None], int] = {
        asyncio.ensure_future(step.do(pid)): pid for pid in pids
    }
    try:
        if tasks:
            await run_to_completion(asyncio.wait(tasks))
    finally:
        finished.append(_collect(step, tasks))
    return finished[-1]


def _collect(step: Step, tasks: dict[asyncio.Future[None], int]) -> _Outcome:
    done: list[int] = []
    failure: CudaCallError | None = None
    for task, pid in tasks.items():
        exc = task.exception()
        if exc is None:
            done.append(pid)
        elif failure is None:
            failure = (
                exc if isinstance(exc, CudaCallError) else CudaCallError(step.name, pid, repr(exc))
            )
    return _Outcome(step, sorted(done), failure)


async def _roll_back(finished: list[_Outcome]) -> None:
    """Undo, newest step first, every pid each finished step moved; log what cannot be undone."""
    for outcome in reversed(finished):
        if not outcome.done:
            continue
        results = await asyncio.gather(
            *(outcome.step.undo(pid) for pid in outcome.done), return_exceptions=True
        )
        for pid, result in zip(outcome.done, results, strict=True):
            if isinstance(result, BaseException):
                log.error(
                    "cuda: rolling back %s of pid %d failed: %r", outcome.step.name, pid, result
                )


def _rolled_back(finished: list[_Outcome]) -> str:
    moved = sorted({pid for o in finished for pid in o.done})
    return f"rolled back pids {moved}" if moved else "no pid had moved"


def create(config: AgentConfig) -> CudaBackend:
    """The backend for ``--backend cuda``; raises :class:`CudaUnavailable` naming the gap."""
    return CudaBackend(open_driver(config.cuda), lock_timeout_ms=config.cuda.lock_timeout_ms)
