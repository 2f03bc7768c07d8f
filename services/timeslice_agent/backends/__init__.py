"""Data-movement backends of the agent (see :class:`~timeslice_agent.backends.base.Backend`)."""

from __future__ import annotations

from timeslice_agent.backends.app import AppBackend
from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    BackendUnavailable,
    JobContext,
    ResidentJob,
    SavedJob,
    Transfer,
)
from timeslice_agent.backends.cuda import CudaBackend, open_driver
from timeslice_agent.backends.freeze import FreezeBackend
from timeslice_agent.backends.sim import SimBackend
from timeslice_agent.config import AgentConfig, BackendKind

__all__ = [
    "AppBackend",
    "Backend",
    "BackendError",
    "BackendRefused",
    "BackendUnavailable",
    "CudaBackend",
    "FreezeBackend",
    "JobContext",
    "ResidentJob",
    "SavedJob",
    "SimBackend",
    "Transfer",
    "create_backend",
]


def create_backend(config: AgentConfig) -> Backend:
    """The backend ``config`` selects; raises :class:`BackendUnavailable` if it cannot run here."""
    if config.backend is BackendKind.SIM:
        return SimBackend(config.sim)
    if config.backend is BackendKind.CUDA:
        return CudaBackend(open_driver(config.cuda), lock_timeout_ms=config.cuda.lock_timeout_ms)
    if config.backend is BackendKind.APP:
        return AppBackend(residual_bytes_per_process=config.device_check.app_residual_bytes)
    return FreezeBackend()
