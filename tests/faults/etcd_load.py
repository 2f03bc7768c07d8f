"""What the etcd fault scenarios share: members brought back after each test, and jobs that
acquire and yield in a loop while etcd members are killed or paused, every call timed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from timeslice import AsyncTimeSliceClient
from timeslice.errors import TimeSliceError
from timeslice_tools.dev.etcd import EtcdCluster
from timeslice_tools.history import Attempt, Hold, Recorder

T = TypeVar("T")

SLACK = 3.0
"""A loaded 2-core machine's scheduling, on top of a call's own deadline."""


@contextlib.asynccontextmanager
async def restored(cluster: EtcdCluster) -> AsyncIterator[None]:
    """Whatever a test does to the members, the next test finds all three up."""
    try:
        yield
    finally:
        for i, member in enumerate(cluster.members):
            member.resume()
            if not member.is_running():
                await asyncio.to_thread(cluster.start_member, i)
        await asyncio.to_thread(cluster.wait_for_leader)


async def timed(what: str, limit: float, coro: Awaitable[T]) -> T:
    """``coro``'s result; it must answer (or fail, typed) within ``limit`` s (+ SLACK)."""
    started = time.monotonic()
    try:
        return await coro
    finally:
        took = time.monotonic() - started
        assert took <= limit + SLACK, f"{what} took {took:.1f} s, past its {limit:g} s deadline"


@dataclass
class Load:
    """The jobs' record: their holds and attempts, typed errors by kind, and the stop signal."""

    recorder: Recorder = field(default_factory=Recorder)
    errors: Counter[str] = field(default_factory=Counter)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Cycle:
    """One job's loop: its group, deadlines and pacing (seconds)."""

    group: str
    acquire_timeout: float
    call_timeout: float
    hold: float = 0.03
    pause: float = 0.01


async def run_job(client: AsyncTimeSliceClient, load: Load, cycle: Cycle) -> None:
    """Acquire, hold, yield until told to stop; every call answers within its deadline, and
    typed errors are counted (anything else fails the test)."""
    job, rec, group = client.job_id, load.recorder, cycle.group
    while not load.stop.is_set():
        started = rec.now()
        try:
            grant = await timed(
                "acquire",
                cycle.acquire_timeout + 2 * cycle.call_timeout,
                client.acquire(group, timeout=cycle.acquire_timeout),
            )
        except TimeSliceError as exc:
            rec.attempt(Attempt(job, group, started, None, repr(exc)))
            load.errors[f"acquire: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)
            continue
        granted = rec.now()
        rec.attempt(Attempt(job, group, started, granted))
        await asyncio.sleep(cycle.hold)
        rec.hold(Hold(job, group, grant.epoch, grant.ticket, granted, rec.now()))
        try:
            await timed("yield", cycle.call_timeout, client.yield_(group))
        except TimeSliceError as exc:
            load.errors[f"yield: {type(exc).__name__}"] += 1
        await asyncio.sleep(cycle.pause)


def longest_gap(holds: list[Hold], start: float, end: float) -> float:
    """The longest time without a grant that overlaps ``[start, end]`` (inf: no two grants)."""
    times = sorted(h.granted_at for h in holds)
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps, default=float("inf"))


async def grants_after(load: Load, moment: float, count: int, timeout: float, what: str) -> None:
    """Wait until ``count`` grants were made after ``moment``; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while sum(h.granted_at > moment for h in load.recorder.holds) < count:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"fewer than {count} grants within {timeout:g} s {what}; "
                f"typed errors {dict(load.errors)}"
            )
        await asyncio.sleep(0.02)
