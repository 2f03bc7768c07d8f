"""Data-movement backends of the agent (see :class:`~timeslice_agent.backends.base.Backend`)."""

from __future__ import annotations

from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    JobContext,
    ResidentJob,
    SavedJob,
    Transfer,
)
from timeslice_agent.backends.freeze import FreezeBackend
from timeslice_agent.backends.sim import SimBackend
from timeslice_agent.config import AgentConfig, BackendKind

__all__ = [
    "Backend",
    "BackendError",
    "BackendRefused",
    "FreezeBackend",
    "JobContext",
    "ResidentJob",
    "SavedJob",
    "SimBackend",
    "Transfer",
    "create_backend",
]


def create_backend(config: AgentConfig) -> Backend:
    """The backend ``config`` selects."""
    if config.backend is BackendKind.SIM:
        return SimBackend(config.sim)
    return FreezeBackend()
