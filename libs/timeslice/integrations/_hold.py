"""One job's hold of one group, taken and given back around a framework's phases.

The adapters (:mod:`timeslice.integrations.trl`, :mod:`timeslice.integrations.verl`) hook a
framework's own methods; each hook only says "the phase begins" (:meth:`GroupHold.enter`) or
"the gap begins" (:meth:`GroupHold.leave`). Both are idempotent, so nested or repeated hooks
(gradient accumulation, a retry) never acquire twice, and every hold is recorded with its times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from timeslice._types import Grant
from timeslice.ids import validate_group_id


class Acquirer(Protocol):
    """What a hold needs of a client (:class:`~timeslice.TimeSliceOrchestratorClient` has it)."""

    @property
    def job_id(self) -> str: ...

    def acquire(self, group_id: str, *, timeout: float | None = None) -> Grant: ...

    def yield_(self, group_id: str) -> None: ...


@dataclass
class Hold:
    """One hold of the group: why it was taken, when it was asked for, granted, given back."""

    reason: str  # the phase: "generation", "training", "init", "step", "hold"
    requested_at: float  # time.time()
    granted_at: float
    restored: bool  # the grant brought this job's state back to the devices
    released_at: float = 0.0  # 0 while held


class GroupHold:
    """Holds ``group_id`` for ``client``'s job between :meth:`enter` and :meth:`leave`.

    Thread-safe: a framework's trainer thread and another (a saver, the agent's hooks) may both
    call it; the acquire itself runs under the lock, so two callers never both acquire.
    """

    def __init__(
        self,
        client: Acquirer,
        group_id: str,
        *,
        timeout: float | None = None,
        on_grant: Callable[[str, Grant], None] | None = None,
    ) -> None:
        self.client = client
        self.group_id = validate_group_id(group_id)
        self.timeout = timeout
        self.holds: list[Hold] = []
        """Every hold, in order."""
        self._on_grant = on_grant
        self._held = False
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """True while the job holds the group through this object."""
        return self._held

    def enter(self, reason: str) -> None:
        """Hold the group (no-op when already held); ``reason`` names the phase."""
        with self._lock:
            if self._held:
                return
            asked = time.time()
            grant = self.client.acquire(self.group_id, timeout=self.timeout)
            self._held = True
            self.holds.append(Hold(reason, asked, time.time(), grant.restored))
        if self._on_grant is not None:
            self._on_grant(reason, grant)

    def leave(self) -> None:
        """Give the group back (no-op when not held)."""
        with self._lock:
            if not self._held:
                return
            self._held = False
            self.client.yield_(self.group_id)
            self.holds[-1].released_at = time.time()

    @contextmanager
    def hold(self, reason: str = "hold") -> Iterator[None]:
        """Hold the group for a block outside the framework's phases (saving, evaluating the
        final model); a no-op inside a phase."""
        already = self._held
        self.enter(reason)
        try:
            yield
        finally:
            if not already:
                self.leave()
