"""The dashboard's placement pools: each pool's groups (expected vs measured duty) and its
assignments with their reasons (docs/placement.md).

Pools live in etcd under keys the replica's mirror does not follow (:mod:`.store.pools`), so
the dashboard reads them itself: on demand, under a deadline, and at most every
``refresh_seconds`` (:class:`PoolsPanel`). The event stream never waits for a read: it sends
the last one (and a ``pools`` event when a read changes it); a read that fails or runs past
its deadline leaves its reason on the page ("pools unavailable: <reason>") and the next read
tries again. The dashboard is for operators: jobs are named as everywhere on the page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from timeslice.errors import TimeSliceError
from timeslice_orchestrator.dashboard_story import group_color
from timeslice_orchestrator.store.etcd.errors import StoreError
from timeslice_orchestrator.store.pools import PoolState
from timeslice_orchestrator.store.records import CorruptRecord

__all__ = ["DutySource", "PoolReader", "PoolsConfig", "PoolsPanel", "pool_json"]


class PoolReader(Protocol):
    """What the panel reads of :class:`~.store.pools.PoolStore`."""

    async def pools(self) -> list[str]: ...
    async def read(self, pool: str) -> PoolState | None: ...


class DutySource(Protocol):
    """The figures of ``timeslice_placement_duty_ratio`` (:class:`~.placements.DutyBook`): the
    page shows the metric's numbers, not a second computation of them."""

    def seen(self, state: PoolState) -> None: ...
    def measured(self, state: PoolState, group: str) -> float: ...


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """Limits of the panel; see the module docstring."""

    refresh_seconds: float = 5.0
    """A page open sees pools at most this old; no page open, no reads."""
    deadline_seconds: float = 2.0
    """One refresh (every pool's keys) gives up after this long."""
    max_pools: int = 20
    """Pools shown at most (by name); the rest are counted."""
    max_assignments: int = 200
    """Assignments listed per pool at most (the groups' job lists stay whole)."""

    def __post_init__(self) -> None:
        if self.refresh_seconds <= 0 or self.deadline_seconds <= 0:
            raise ValueError("refresh_seconds and deadline_seconds must be positive")
        if self.max_pools < 1 or self.max_assignments < 0:
            raise ValueError("max_pools must be positive and max_assignments not negative")


def pool_json(state: PoolState, duty: DutySource, max_assignments: int) -> dict[str, Any]:
    """One pool as the page shows it."""
    config = state.config
    assigned = state.assignments.jobs
    rows = [
        {
            "job": job,
            "role": role,
            "group": a.group,
            "decision": a.decision,
            "reason": a.reason,
            "source": a.profile.source,
            "provisional": a.profile.source != "measured",
            "placed_at": a.placed_at,
        }
        for job, slots in sorted(assigned.items())
        for role, a in sorted(slots.items())
    ]
    return {
        "name": state.pool,
        "cap": config.cap,
        "groups": [
            {
                "name": g,
                "color": group_color(g),
                "expected": round(state.assignments.expected.get(g, 0.0), 4),
                "measured": round(duty.measured(state, g), 4),
                "drained": g in config.drained,
                "claim": config.claims.get(g, ""),
                "jobs": [
                    f"{job}/{role}"
                    for job, slots in sorted(assigned.items())
                    for role, a in sorted(slots.items())
                    if a.group == g
                ],
            }
            for g in config.groups
        ],
        "pins": [f"{p.job}/{p.role} -> {p.group}" for p in config.pins],
        "excluded": [" + ".join(pair) for pair in config.excluded],
        "assignments": rows[:max_assignments],
        "omitted_assignments": max(0, len(rows) - max_assignments),
    }


class PoolsPanel:
    """The pools as last read, and the reads (one at a time; see the module docstring)."""

    def __init__(
        self,
        reader: PoolReader,
        duty: DutySource,
        config: PoolsConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or PoolsConfig()
        self._reader = reader
        self._duty = duty
        self._clock = clock
        self._wall = wall
        self._lock = asyncio.Lock()
        self._read_at: float | None = None  # clock() of the last read, failed or not
        self._shown: dict[str, Any] = {"at": 0.0, "error": "", "pools": [], "omitted": 0}
        self.reads = 0
        """Reads made so far (tests: no page, no reads)."""

    def json(self) -> dict[str, Any]:
        """What the page shows now: ``pools``, ``omitted`` (pools not shown), ``at`` (wall
        clock of the last read; 0: none yet) and ``error`` (why the last read failed)."""
        return self._shown

    async def fresh(self) -> bool:
        """Read the pools unless the last read is under ``refresh_seconds`` old (a read in
        progress is waited for, not repeated); whether what is shown changed."""
        async with self._lock:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self.config.refresh_seconds:
                return False
            before = self._shown
            self._shown = await self._read()
            self._read_at = self._clock()
            return _content(self._shown) != _content(before)

    async def _read(self) -> dict[str, Any]:
        cfg = self.config
        self.reads += 1
        try:
            async with asyncio.timeout(cfg.deadline_seconds):
                names = await self._reader.pools()
                states = [await self._reader.read(name) for name in names[: cfg.max_pools]]
        except TimeoutError:
            reason = f"etcd did not answer within {cfg.deadline_seconds:g} s"
            return {**self._shown, "at": self._wall(), "error": reason}
        except (TimeSliceError, StoreError, CorruptRecord, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            return {**self._shown, "at": self._wall(), "error": reason}
        pools = []
        for state in states:
            if state is None:
                continue  # deleted between the listing and the read
            self._duty.seen(state)  # the metric follows what the page shows
            pools.append(pool_json(state, self._duty, cfg.max_assignments))
        return {
            "at": self._wall(),
            "error": "",
            "pools": pools,
            "omitted": max(0, len(names) - cfg.max_pools),
        }


def _content(shown: dict[str, Any]) -> tuple[Any, ...]:
    # What a page would draw differently (not when it was read).
    return shown["error"], shown["pools"], shown["omitted"]
