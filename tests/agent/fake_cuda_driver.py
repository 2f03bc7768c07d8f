"""A stand-in for ``cuda.bindings.driver``: the real call shapes, a per-pid driver state machine.

The shapes are copied from cuda-bindings 13.5.0 (the wheel's docstrings, then checked by calling
the compiled 13.5.0 module against a stub ``libcuda.so.1``):

- ``cuCheckpointProcessLock(pid, args: CUcheckpointLockArgs | None) -> (CUresult,)``, and the
  same for ``Checkpoint`` / ``Restore`` / ``Unlock`` with their own Args type; an Args object of
  another type raises ``TypeError``;
- ``cuCheckpointProcessGetState(pid) -> (CUresult, CUprocessState)``,
  ``cuCheckpointProcessGetRestoreThreadId(pid) -> (CUresult, int)``: the value is ``None`` when
  the result is an error;
- ``cuInit(0) -> (CUresult,)``, ``cuDriverGetVersion() -> (CUresult, int)``;
- ``CUresult`` and ``CUprocessState`` are int enums with the driver's values and names.

The state machine is the one the CUDA driver API documents (group CUDA_CHECKPOINT): lock takes
RUNNING to LOCKED, checkpoint LOCKED to CHECKPOINTED, restore CHECKPOINTED to LOCKED, unlock
LOCKED to RUNNING; a call in any other state returns ``CUDA_ERROR_ILLEGAL_STATE`` and changes
nothing. A pid that never initialised CUDA answers ``CUDA_ERROR_NOT_INITIALIZED`` to every call.

:func:`modules` gives the ``sys.modules`` entries under which ``from cuda.bindings import
driver`` finds a stand-in.
"""

from __future__ import annotations

import enum
import threading
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

COPIED_FROM = "cuda-bindings 13.5.0"
DRIVER_VERSION = 13000  # what cuDriverGetVersion reports for an r580 driver (CUDA 13.0)


class CUresult(enum.IntEnum):
    """The CUresult codes the checkpoint API documents, with the driver's values."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class CUprocessState(enum.IntEnum):
    """The driver's process states."""

    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3
    CU_PROCESS_STATE_CHECKPOINTING = 4
    CU_PROCESS_STATE_RESTORING = 5


class CUcheckpointLockArgs:
    """Optional lock arguments: ``timeoutMs`` (0: no timeout)."""

    def __init__(self) -> None:
        self.timeoutMs = 0


class CUcheckpointCheckpointArgs:
    """Optional checkpoint arguments (custom storage, unused here)."""

    def __init__(self) -> None:
        self.customStorageInfo_out: Any = None


class CUcheckpointRestoreArgs:
    """Optional restore arguments (GPU remapping, custom storage; unused here)."""

    def __init__(self) -> None:
        self.gpuPairs: Any = None
        self.gpuPairsCount = 0
        self.customStorageInfo_out: Any = None


class CUcheckpointUnlockArgs:
    """Optional unlock arguments (none defined)."""


RUNNING = CUprocessState.CU_PROCESS_STATE_RUNNING
LOCKED = CUprocessState.CU_PROCESS_STATE_LOCKED
CHECKPOINTED = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED

# call -> (Args type, state it needs, state it leaves)
_TRANSITIONS: dict[str, tuple[type, CUprocessState, CUprocessState]] = {
    "cuCheckpointProcessLock": (CUcheckpointLockArgs, RUNNING, LOCKED),
    "cuCheckpointProcessCheckpoint": (CUcheckpointCheckpointArgs, LOCKED, CHECKPOINTED),
    "cuCheckpointProcessRestore": (CUcheckpointRestoreArgs, CHECKPOINTED, LOCKED),
    "cuCheckpointProcessUnlock": (CUcheckpointUnlockArgs, LOCKED, RUNNING),
}

SYMBOLS = (
    "CUresult",
    "CUprocessState",
    "CUcheckpointLockArgs",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
)
"""Every public name of the stand-in module (all of them exist in the real one)."""


@dataclass
class StandInDriver:
    """The driver's side: per-pid states, every call recorded, errors where a test plants them.

    ``calls`` holds ``(function name, pid)`` in the order the calls reached the driver (the agent
    makes them from worker threads). ``no_cuda``: pids that never initialised CUDA. ``errors``:
    ``(function name, pid) -> CUresult`` returned instead of acting. ``lock_timeouts``: the
    ``timeoutMs`` each lock of a pid carried.
    """

    states: dict[int, CUprocessState] = field(default_factory=dict)
    no_cuda: set[int] = field(default_factory=set)
    errors: dict[tuple[str, int], CUresult] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    lock_timeouts: dict[int, list[int]] = field(default_factory=dict)
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def calls_of(self, pid: int) -> list[str]:
        """The functions called for ``pid``, in order, without the ``cuCheckpointProcess``."""
        return [name.removeprefix("cuCheckpointProcess") for name, p in self.calls if p == pid]

    def state(self, pid: int) -> CUprocessState:
        """The state the driver holds for ``pid`` (RUNNING until a call changes it)."""
        return self.states.get(pid, RUNNING)

    def _enter(self, name: str, pid: object) -> CUresult | None:
        if not isinstance(pid, int):
            raise TypeError(f"an integer is required for pid, got {type(pid).__name__}")
        self.calls.append((name, pid))
        if (name, pid) in self.errors:
            return self.errors[name, pid]
        if pid in self.no_cuda:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        return None

    def _transition(self, name: str, pid: int, args: object) -> tuple[CUresult]:
        args_type, needs, leaves = _TRANSITIONS[name]
        if args is not None and not isinstance(args, args_type):
            raise TypeError(
                f"Argument 'args' has incorrect type (expected {args_type.__name__}, "
                f"got {type(args).__name__})"
            )
        with self._mutex:
            error = self._enter(name, pid)
            if error is not None:
                return (error,)
            if self.state(pid) is not needs:
                return (CUresult.CUDA_ERROR_ILLEGAL_STATE,)
            if isinstance(args, CUcheckpointLockArgs):
                self.lock_timeouts.setdefault(pid, []).append(args.timeoutMs)
            self.states[pid] = leaves
            return (CUresult.CUDA_SUCCESS,)

    def cuInit(self, flags: int) -> tuple[CUresult]:
        return (CUresult.CUDA_SUCCESS if flags == 0 else CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuDriverGetVersion(self) -> tuple[CUresult, int]:
        return (CUresult.CUDA_SUCCESS, DRIVER_VERSION)

    def cuCheckpointProcessLock(self, pid: int, args: CUcheckpointLockArgs | None) -> Any:
        return self._transition("cuCheckpointProcessLock", pid, args)

    def cuCheckpointProcessCheckpoint(
        self, pid: int, args: CUcheckpointCheckpointArgs | None
    ) -> Any:
        return self._transition("cuCheckpointProcessCheckpoint", pid, args)

    def cuCheckpointProcessRestore(self, pid: int, args: CUcheckpointRestoreArgs | None) -> Any:
        return self._transition("cuCheckpointProcessRestore", pid, args)

    def cuCheckpointProcessUnlock(self, pid: int, args: CUcheckpointUnlockArgs | None) -> Any:
        return self._transition("cuCheckpointProcessUnlock", pid, args)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[CUresult, CUprocessState | None]:
        with self._mutex:
            error = self._enter("cuCheckpointProcessGetState", pid)
            return (error, None) if error is not None else (CUresult.CUDA_SUCCESS, self.state(pid))

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[CUresult, int | None]:
        with self._mutex:
            error = self._enter("cuCheckpointProcessGetRestoreThreadId", pid)
            return (error, None) if error is not None else (CUresult.CUDA_SUCCESS, pid)

    def module(self, *, missing: Iterable[str] = ()) -> types.ModuleType:
        """A ``cuda.bindings.driver`` module over this driver, less the names in ``missing``."""
        module = types.ModuleType("cuda.bindings.driver")
        module.__doc__ = f"Stand-in for cuda.bindings.driver, shapes of {COPIED_FROM}."
        absent = set(missing)
        for name in SYMBOLS:
            if name not in absent:
                setattr(
                    module, name, getattr(self, name) if name.startswith("cu") else globals()[name]
                )
        return module


def modules(
    driver: StandInDriver, *, version: str = "13.5.0", missing: Iterable[str] = ()
) -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries that make ``from cuda.bindings import driver`` find ``driver``.

    ``version`` becomes ``cuda.bindings.__version__``; ``missing`` names are left out of the
    driver module, as a cuda-bindings release built without them would.
    """
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.__version__ = version  # type: ignore[attr-defined]
    module = driver.module(missing=missing)
    cuda.bindings = bindings  # type: ignore[attr-defined]
    bindings.driver = module  # type: ignore[attr-defined]
    return {"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.driver": module}
