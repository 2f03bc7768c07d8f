"""Recorded histories of a run and the invariant checks of DESIGN.md section 5.

Clients record every acquire they start, every grant and every yield (monotonic clock of the
recording process); agents record every directive they finish in their journals. The checks
take those records and raise AssertionError with the offending items. The benchmarks reuse
them to prove their runs were correct, not only fast.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from timeslice_agent.journal import JournalEntry

EXECUTED = ("ok", "failed")  # the agent acted; stale_epoch and refused mean it did not


@dataclass(frozen=True, slots=True)
class Hold:
    job: str
    group: str
    epoch: int
    ticket: int
    granted_at: float  # after the grant arrived
    released_at: float  # before the yield was sent


@dataclass(frozen=True, slots=True)
class Attempt:
    job: str
    group: str
    started_at: float
    granted_at: float | None  # None: never granted (an error ended it, or the run did)
    error: str = ""


@dataclass
class Recorder:
    """Thread-safe collector shared by the jobs of one run."""

    holds: list[Hold] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, item: Hold) -> None:
        with self._lock:
            self.holds.append(item)

    def attempt(self, item: Attempt) -> None:
        with self._lock:
            self.attempts.append(item)

    @staticmethod
    def now() -> float:
        return time.monotonic()


def _by_group(holds: Iterable[Hold]) -> dict[str, list[Hold]]:
    groups: dict[str, list[Hold]] = defaultdict(list)
    for h in holds:
        groups[h.group].append(h)
    for items in groups.values():
        items.sort(key=lambda h: h.epoch)
    return groups


def check_mutual_exclusion(holds: list[Hold]) -> None:
    """No two holds of a group overlap, and no epoch is granted twice."""
    for group, items in _by_group(holds).items():
        epochs = [h.epoch for h in items]
        assert len(set(epochs)) == len(epochs), f"{group}: an epoch was granted twice"
        for a, b in itertools.pairwise(items):
            assert b.granted_at >= a.released_at, (
                f"{group}: {b.job} (epoch {b.epoch}) granted at {b.granted_at:.6f} while "
                f"{a.job} (epoch {a.epoch}) held it until {a.released_at:.6f}"
            )


def check_fifo(holds: list[Hold]) -> None:
    """Under FIFO, grants in epoch order serve queue tickets in increasing order."""
    for group, items in _by_group(holds).items():
        out_of_order = [
            (a.job, a.ticket, b.job, b.ticket)
            for a, b in itertools.pairwise(items)
            if b.ticket <= a.ticket
        ]
        assert not out_of_order, f"{group}: grants out of enqueue order: {out_of_order[:5]}"


def check_fencing(entries: list[JournalEntry]) -> None:
    """No agent executes a directive older than one it already executed for that group."""
    streams: dict[tuple[str, str], list[JournalEntry]] = defaultdict(list)
    for e in entries:
        if e.status in EXECUTED:
            streams[(e.node, e.group)].append(e)
    for (node, group), items in streams.items():
        items.sort(key=lambda e: e.started_at)
        newest = 0
        for e in items:
            assert e.epoch >= newest, (
                f"{node}/{group}: executed {e.directive_id} (epoch {e.epoch}) after epoch {newest}"
            )
            newest = e.epoch


def check_two_phase(entries: list[JournalEntry]) -> None:
    """Within each switch (epoch), every checkpoint finished before any restore started."""
    switches: dict[tuple[str, int], list[JournalEntry]] = defaultdict(list)
    for e in entries:
        if e.status in EXECUTED:
            switches[(e.group, e.epoch)].append(e)
    for (group, epoch), items in switches.items():
        checkpoints = [e for e in items if e.kind == "checkpoint"]
        restores = [e for e in items if e.kind == "restore"]
        if not checkpoints or not restores:
            continue
        last_checkpoint = max(e.finished_at for e in checkpoints)
        first_restore = min(e.started_at for e in restores)
        assert first_restore >= last_checkpoint, (
            f"{group} epoch {epoch}: a restore started at {first_restore:.6f} before the last "
            f"checkpoint finished at {last_checkpoint:.6f}"
        )


def check_nothing_lost(attempts: list[Attempt], expected_grants: dict[str, int]) -> None:
    """Every job got every grant it needed; no acquire was left hanging without an error."""
    granted: dict[str, int] = defaultdict(int)
    for a in attempts:
        if a.granted_at is not None:
            granted[a.job] += 1
    missing = {job: (granted[job], n) for job, n in expected_grants.items() if granted[job] < n}
    assert not missing, f"jobs short of grants (got, expected): {missing}"


def wait_times(attempts: list[Attempt]) -> list[float]:
    return sorted(a.granted_at - a.started_at for a in attempts if a.granted_at is not None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
