"""Slime phase callback: each phase of a Slime RL loop takes the time-slicing locks it needs.

A drop-in for the llm-d reference's Slime integration: the same object shape
(``on_phase_begin`` / ``on_phase_end`` / ``close``), configured by the same environment
variables, the same phase-to-locks table and the same lock order. It runs on this SDK, so a
hold lives on a session that lapses when the process dies, the queue is FIFO in etcd, and a
replica may fail over under a waiting phase.

Environment (all four needed; with any unset the callback does nothing at all):

==========================  ==============================================================
``TIMESLICE_JOB_ID``        the job (one per RL run)
``TIMESLICE_ORCH_ADDR``     the orchestrator, ``host:port`` (several: comma-separated)
``TIMESLICE_TRAINER_GROUP`` the trainer pool's group
``TIMESLICE_SAMPLER_GROUP`` the sampler (rollout) pool's group
==========================  ==============================================================

``TIMESLICE_ACQUIRE_TIMEOUT`` (seconds, default 600) bounds each acquire; TLS comes from the
SDK's own ``TIMESLICE_TLS_*`` / ``TIMESLICE_INSECURE`` variables.

Phases: ``init`` and ``weight_sync`` take both groups; ``generate``, ``offload``, ``onload``
and ``eval`` the sampler group; ``train`` and ``create`` the trainer group. Locks are taken
trainer first, then sampler, and given back in reverse, so two jobs can never wait on each
other. Asking for the trainer lock while holding only the sampler lock would break that order:
it raises :class:`LockOrderError`. Acquire and release are idempotent. Held locks are given
back at process exit. A phase not in the table takes no lock (logged once per name).

Synchronous RL points both jobs at the same two groups; asynchronous RL shares only the trainer
group (each job's sampler group is its own).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from timeslice._types import Grant
from timeslice.client import TimeSliceOrchestratorClient
from timeslice.errors import InvalidArgument

log = logging.getLogger("timeslice.integrations.slime")

JOB_ENV = "TIMESLICE_JOB_ID"
ADDRESS_ENV = "TIMESLICE_ORCH_ADDR"
TRAINER_ENV = "TIMESLICE_TRAINER_GROUP"
SAMPLER_ENV = "TIMESLICE_SAMPLER_GROUP"
TIMEOUT_ENV = "TIMESLICE_ACQUIRE_TIMEOUT"
DEFAULT_TIMEOUT = 600.0

TRAINER = "trainer"
SAMPLER = "sampler"

PHASE_CALLBACK_PATH = "timeslice.integrations.slime.SlimePhaseCallback"
"""The value of Slime's ``--phase-callback-path`` (the phase-callback fork, aishukamal/slime
``feat/phase-callbacks``): Slime imports the module, takes the attribute and calls it with no
arguments, once per driver process."""

# Which pools each phase needs (the reference's table).
PHASE_LOCKS: Mapping[str, tuple[str, ...]] = {
    "init": (TRAINER, SAMPLER),
    "weight_sync": (TRAINER, SAMPLER),
    "generate": (SAMPLER,),
    "offload": (SAMPLER,),
    "onload": (SAMPLER,),
    "eval": (SAMPLER,),
    "train": (TRAINER,),
    "create": (TRAINER,),
}


class LockOrderError(InvalidArgument):
    """The trainer lock was asked for while only the sampler lock is held (a deadlock risk)."""


class _Client(Protocol):
    """What the callback needs of a client (TimeSliceOrchestratorClient has it)."""

    def acquire(self, group_id: str, *, timeout: float | None = None) -> Grant: ...

    def yield_(self, group_id: str) -> None: ...

    def close(self) -> None: ...


class SlimePhaseCallback:
    """Takes and gives back the time-slicing locks around each Slime phase.

    ``env`` defaults to ``os.environ``; ``client`` (mostly for tests) replaces the client the
    callback would build from it. Thread-safe: Slime may call it from several threads.
    """

    def __init__(
        self, env: Mapping[str, str] | None = None, *, client: _Client | None = None
    ) -> None:
        env = os.environ if env is None else env
        names = (JOB_ENV, ADDRESS_ENV, TRAINER_ENV, SAMPLER_ENV)
        missing = [name for name in names if not env.get(name)]
        self.enabled = not missing
        self._groups: dict[str, str] = {}
        self._held: list[str] = []  # pools, in the order taken
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self._client: _Client | None = None
        if not self.enabled:
            log.debug("time-slicing off: %s unset", ", ".join(missing))
            return
        self._groups = {TRAINER: env[TRAINER_ENV], SAMPLER: env[SAMPLER_ENV]}
        try:
            self.timeout = float(env.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        except ValueError as exc:
            raise InvalidArgument(f"{TIMEOUT_ENV} must be a number of seconds") from exc
        if self.timeout <= 0:
            raise InvalidArgument(f"{TIMEOUT_ENV} must be positive")
        self._client = client or TimeSliceOrchestratorClient(env[ADDRESS_ENV], job_id=env[JOB_ENV])
        atexit.register(self.close)

    @property
    def client(self) -> _Client | None:
        """The client the locks are taken through (None when the callback is off or closed)."""
        return self._client

    @property
    def held(self) -> list[str]:
        """The groups held now, in the order they were taken."""
        with self._lock:
            return [self._groups[pool] for pool in self._held]

    def on_phase_begin(self, phase: str, role: Any = None, context: Any = None) -> None:
        """Take the locks ``phase`` needs (those already held are kept; nothing is re-taken)."""
        pools = self._pools(phase)
        with self._lock:
            if TRAINER in pools and TRAINER not in self._held and SAMPLER in self._held:
                raise LockOrderError(
                    f"phase {phase!r} needs the trainer lock while only the sampler lock is "
                    "held: locks are taken trainer first; end the sampler phase first"
                )
            for pool in (TRAINER, SAMPLER):  # the one order every job takes them in
                if pool in pools and pool not in self._held:
                    assert self._client is not None
                    self._client.acquire(self._groups[pool], timeout=self.timeout)
                    self._held.append(pool)

    def on_phase_end(self, phase: str, role: Any = None, context: Any = None) -> None:
        """Give back the locks ``phase`` took, in reverse order (idempotent)."""
        pools = self._pools(phase)
        with self._lock:
            for pool in reversed(list(self._held)):
                if pool in pools:
                    self._release(pool)

    def close(self) -> None:
        """Give back every held lock (reverse order) and close the client; idempotent."""
        with self._lock:
            for pool in reversed(list(self._held)):
                try:
                    self._release(pool)
                except Exception:  # at exit: the session's lease gives it back anyway
                    log.exception("could not give back %s", self._groups[pool])
            if self._client is not None:
                client, self._client = self._client, None
                client.close()
                atexit.unregister(self.close)

    def _pools(self, phase: str) -> tuple[str, ...]:
        if not self.enabled:
            return ()
        pools = PHASE_LOCKS.get(phase)
        if pools is None:
            if phase not in self._warned:
                self._warned.add(phase)
                log.warning("phase %r is not in the phase-to-locks table: it takes no lock", phase)
            return ()
        return pools

    def _release(self, pool: str) -> None:
        # Forgotten first: a yield that fails is re-sent by the client until it lands, and a
        # later acquire of the group waits for it (timeslice._release), so the lock must not
        # count as held any more.
        self._held.remove(pool)
        assert self._client is not None
        self._client.yield_(self._groups[pool])
