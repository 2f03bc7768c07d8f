"""Data-movement backends of the agent (see :class:`~timeslice_agent.backends.base.Backend`).

**Adding a backend** touches its own module and one line: the module
``timeslice_agent/backends/<name>.py`` defines its :class:`Backend` subclass and a
``create(config: AgentConfig) -> Backend`` function, and ``<NAME> = "<name>"`` joins
:class:`timeslice_agent.config.BackendKind`, from which the agent's ``--backend`` choices, the
CLI and the dev cluster all take their lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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
from timeslice_agent.backends.cuda import CudaBackend
from timeslice_agent.backends.freeze import FreezeBackend
from timeslice_agent.backends.sim import SimBackend
from timeslice_agent.config import AgentConfig

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
    module = importlib.import_module(f"{__name__}.{config.backend.value}")
    create: Callable[[AgentConfig], Backend] = module.create
    return create(config)
