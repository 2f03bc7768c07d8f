"""timeslice: co-operative accelerator time-slicing for RL post-training jobs.

A job wraps each accelerator phase in ``acquire`` / ``yield_`` (or ``on_accelerators``); the
orchestrator lets one job at a time use a group's accelerators and moves device state between
jobs while they wait::

    from timeslice import TimeSliceOrchestratorClient
    orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train_phase(model, trajectories):
        return model.update(trajectories)

:class:`AsyncTimeSliceClient` is the asyncio flavour of the same API; :func:`register`
announces a GPU worker process to its node's agent. Errors are the typed exceptions of
:mod:`timeslice.errors`, re-exported here.
"""

from timeslice._scope import AcceleratorScope
from timeslice._types import AcquireProgress, AcquireStage, Grant
from timeslice.aio import AsyncTimeSliceClient
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import (
    AlreadyExists,
    Cancelled,
    ErrorKind,
    FailedPrecondition,
    GroupFaulted,
    InternalError,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    ResourceExhausted,
    SessionExpired,
    Timeout,
    TimeSliceError,
    Unauthenticated,
    Unavailable,
)
from timeslice.worker import HookResult, WorkerRegistration, register
from timeslice_proto.timeslice.v1 import GroupEvent, GroupStatus, GroupSummary

__all__ = [
    "AcceleratorScope",
    "AcquireProgress",
    "AcquireStage",
    "AlreadyExists",
    "AsyncTimeSliceClient",
    "Cancelled",
    "ErrorKind",
    "FailedPrecondition",
    "Grant",
    "GroupEvent",
    "GroupFaulted",
    "GroupStatus",
    "GroupSummary",
    "HookResult",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "NotHolder",
    "PermissionDenied",
    "ResourceExhausted",
    "SessionExpired",
    "TimeSliceError",
    "TimeSliceOrchestratorClient",
    "Timeout",
    "Unauthenticated",
    "Unavailable",
    "WorkerRegistration",
    "register",
]
