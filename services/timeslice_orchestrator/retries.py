"""The driver's record of failed switches: how often each failed, and when the next may start.

A switch towards a waiter, a catch-up of a holder and a prefetch each retry with a backoff.
Each is keyed by the group, the job and a revision that never comes back once its queue
entry or hold has ended: the waiter's entry's create revision, or the hold's epoch. The
entries are kept per group, so that a group's look-ups cost what that group has, and they
are forgotten once the group's view shows that their entry and hold are gone: a replica that
runs for months beside failing nodes does not collect them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

RetryKey = tuple[str, str, int]
"""(group, job, revision): the waiter's queue entry, or the hold's epoch (see the module)."""


@dataclass(slots=True)
class Retry:
    """Failed tries of one switch, and when the next one may start."""

    attempts: int
    due: float  # time.monotonic()


class RetryLedger:
    """The :class:`Retry` of every switch that failed lately, grouped by group."""

    def __init__(self) -> None:
        self._groups: dict[str, dict[tuple[str, int], Retry]] = {}

    def __len__(self) -> int:
        return sum(len(retries) for retries in self._groups.values())

    def get(self, key: RetryKey) -> Retry | None:
        group, job, revision = key
        retries = self._groups.get(group)
        return retries.get((job, revision)) if retries is not None else None

    def put(self, key: RetryKey, retry: Retry) -> None:
        group, job, revision = key
        self._groups.setdefault(group, {})[(job, revision)] = retry

    def pop(self, key: RetryKey) -> None:
        group, job, revision = key
        retries = self._groups.get(group)
        if retries is not None:
            retries.pop((job, revision), None)
            if not retries:
                del self._groups[group]

    def wait(self, group: str) -> float:
        """Seconds until the earliest retry of ``group`` that is not yet due (0: none)."""
        now = time.monotonic()
        waits = [r.due - now for r in self._groups.get(group, {}).values()]
        return min((w for w in waits if w > 0), default=0.0)

    def forget_group(self, group: str) -> None:
        """Nothing to retry in ``group`` any more (no waiter, no switch, no catch-up)."""
        self._groups.pop(group, None)

    def forget_ended(
        self, group: str, entries: Iterable[tuple[str, int]], hold: tuple[str, int] | None
    ) -> None:
        """Keep only the retries of ``group`` that can still come back.

        ``entries`` are the waiters' queue entries, (job, create revision); ``hold`` is the
        holder's (job, epoch). Kept: a waiter's switch (its entry is live), the holder's
        catch-up (its hold is), and the prefetch of a waiter still queued during this hold.
        """
        retries = self._groups.get(group)
        if not retries:
            return
        live = set(entries)
        waiting = {job for job, _ in live}
        if hold is not None:
            live.add(hold)
            live.update((job, hold[1]) for job in waiting)
        for key in [k for k in retries if k not in live]:
            del retries[key]
        if not retries:
            del self._groups[group]
