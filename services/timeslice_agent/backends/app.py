"""The ``app`` backend: the workers move their own device state, through their app hooks.

Each worker of the job registered with app callbacks (``timeslice.worker.register`` with
``on_checkpoint``/``on_restore``, or one of the SDK adapters: ``timeslice.offload`` for
PyTorch, ``timeslice.engines`` for vLLM and SGLang). The executor sends BEFORE_CHECKPOINT
before a checkpoint and AFTER_RESTORE after a restore; the hooks report the bytes they moved.
This backend itself moves nothing: it refuses a job none of whose workers can move anything,
and it declares that device memory must be free afterwards, so the agent checks it with NVML
(each process may keep ``residual_bytes_per_process``: its CUDA context outlives a release).

The hooks reach the workers over the stream each one opened through the agent's worker
socket: without that socket nothing can move. :meth:`AppBackend.preflight` checks at start that
the agent can create it: its directory exists and the agent may write and enter it, or the
nearest existing ancestor is such that the agent can create it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from timeslice_agent.backends.base import (
    Backend,
    BackendRefused,
    BackendUnavailable,
    JobContext,
    SavedJob,
    Transfer,
)
from timeslice_agent.config import AgentConfig
from timeslice_agent.procs import pid_exists
from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)


def socket_dir_refusal(socket: Path) -> str | None:
    """Why this process could not create the unix socket ``socket``, or None (blocking)."""
    directory = socket.parent
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return (
            f"the worker socket {socket}, over which the workers' hooks reach the agent, "
            f"cannot be created: {existing} is not a directory. Pass --worker-socket with a "
            "path in a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "its directory" if existing == directory else f"{directory}'s parent"
        return (
            f"the worker socket {socket}, over which the workers' hooks reach the agent, "
            f"cannot be created: {what} {existing} is not writable by the agent (uid "
            f"{os.geteuid()}). Make {existing} writable by it, or pass --worker-socket with a "
            "path in a directory it may write"
        )
    return None


class AppBackend(Backend):
    """Workers offload and restore their own state (see the module docstring)."""

    name = "app"
    emulated = False
    frees_device_memory = True

    def __init__(
        self,
        *,
        residual_bytes_per_process: int = 2048 * 1024 * 1024,
        worker_socket: Path | None = None,
    ) -> None:
        self.residual_bytes_per_process = residual_bytes_per_process
        # Where the hooks' streams come in (None: not checked, for tests without an agent).
        self._worker_socket = worker_socket

    async def preflight(self) -> None:
        """Refuse to start unless the agent can create the worker socket (the hooks' way)."""
        if self._worker_socket is None:
            return
        refusal = await asyncio.to_thread(socket_dir_refusal, self._worker_socket)
        if refusal is not None:
            raise BackendUnavailable(refusal)

    def admit_checkpoint(self, job: JobContext) -> None:
        if not any(w.app_callbacks for w in job.workers):
            raise BackendRefused(
                f"job {job.job_id}: the app backend needs a worker registered with app "
                "callbacks (timeslice.offload, timeslice.engines or register(on_checkpoint=...)); "
                "none of its workers has one, so nothing would move"
            )

    async def checkpoint(self, job: JobContext) -> Transfer:
        # The BEFORE_CHECKPOINT hooks have already moved the state; their bytes are counted
        # by the executor.
        return Transfer(bytes_moved=0, elapsed_seconds=0.0)

    async def restore(self, job: JobContext) -> Transfer:
        return Transfer(bytes_moved=0, elapsed_seconds=0.0)

    async def reconcile(self, job: SavedJob) -> str | None:
        # The parked state lives in the workers' own host memory: it survives the agent only
        # as long as they do.
        gone = [p for p in job.saved_pids if not pid_exists(p)]
        if gone:
            return f"worker processes {gone} holding the parked state exited"
        log.info("re-adopted job %s: its workers still hold its parked state", job.job_id)
        return None

    def devices(self, discovered: list[Device]) -> list[Device]:
        return discovered


def create(config: AgentConfig) -> AppBackend:
    """The backend for ``--backend app`` (see :mod:`timeslice_agent.backends`)."""
    return AppBackend(
        residual_bytes_per_process=config.device_check.app_residual_bytes,
        worker_socket=config.worker_socket,
    )
