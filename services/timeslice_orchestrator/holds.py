"""When each group was held: duty cycle over a sliding window, held seconds, hold lengths.

A pure bookkeeping class fed with the group's hold as the mirror shows it (the epoch of the
holder, 0 when free) and a monotonic clock; it reads nothing and writes nothing. Every replica
sees the same changes through its watch, so every replica computes the same figures (within
its watch's lag).

The duty cycle is over the time this replica actually watched the group, at most the window:
a group that came into being 30 s ago (or that this replica first saw 30 s ago) and was held
for 18 of them is 60% over 30 s, not 6% of a 5-minute window it did not exist for. A group
that was there when the replica started is watched from the replica's start; one seen to
appear later, from when it appeared (its first change, often its first hold). :class:`Duty`
carries the share with the seconds it is over, so no figure is shown without its span.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# How far back the duty cycle looks (a dashboard's "last minutes").
DEFAULT_WINDOW_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class Duty:
    """A duty cycle and the span it is over."""

    ratio: float
    """The held share of ``seconds``, 0..1."""
    seconds: float
    """How long the share is over: the time watched, at most the window."""


def duty_over(
    closed: Iterable[tuple[float, float]],
    open_since: float | None,
    watched_from: float,
    now: float,
    window: float,
) -> Duty:
    """The held share of the time watched within the last ``window`` seconds before ``now``.

    ``closed``: holds that ended, as (start, end); ``open_since``: when the hold in progress
    started (None: free); ``watched_from``: when watching began (the group appeared, or the
    replica started). Holds before ``watched_from`` or before the window do not count.
    """
    start = max(now - window, watched_from)
    span = now - start
    if span <= 0:
        return Duty(1.0 if open_since is not None else 0.0, 0.0)
    busy = sum(max(0.0, min(end, now) - max(begin, start)) for begin, end in closed)
    if open_since is not None:
        busy += max(0.0, now - max(open_since, start))
    return Duty(min(1.0, max(0.0, busy / span)), span)


@dataclass(slots=True)
class _Group:
    since: float  # when this replica started to track the group
    epoch: int = 0  # the hold in progress (0: free)
    started: float = 0.0
    closed: deque[tuple[float, float]] = field(default_factory=deque)  # within the window
    held_seconds: float = 0.0  # closed holds, since tracked


class HoldTracker:
    """Holds of every group as observed; see the module docstring."""

    def __init__(self, window: float = DEFAULT_WINDOW_SECONDS, started: float = 0.0) -> None:
        """``started``: when this replica began to watch (on the clock ``now`` values use);
        a group first seen held later was free since then, within the window."""
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.started = started
        self._groups: dict[str, _Group] = {}
        # Not tracked (never held, or idle for a whole window): groups there at the start,
        # watched since ``started``, and when each group seen later appeared. Both drop a
        # group when it is first held (its _Group keeps the time) or forgotten.
        self._at_start: set[str] = set()
        self._appeared: dict[str, float] = {}

    def begin(self, now: float, groups: Iterable[str]) -> None:
        """Watching starts at ``now``, with ``groups`` there: they are watched from ``now``;
        any other group is watched from when it is first observed."""
        self.started = now
        self._at_start = set(groups)
        self._appeared.clear()

    def observe(self, group: str, epoch: int, now: float) -> float | None:
        """The group's hold is now ``epoch`` (0: free). Returns the length of the hold this
        ended, if one ended (a new epoch ends the previous hold as well)."""
        state = self._groups.get(group)
        if state is None:
            if not epoch:
                # Never seen held: nothing to track yet, but when it appeared is remembered.
                if group not in self._at_start:
                    self._appeared.setdefault(group, now)
                return None
            # Free until now since it was watched: since the start (there then), since it
            # appeared, or since now (it appears held: created by the grant itself).
            if group in self._at_start:
                self._at_start.discard(group)
                first = self.started
            else:
                first = self._appeared.pop(group, now)
            state = self._groups[group] = _Group(since=max(first, now - self.window))
        if epoch == state.epoch:
            return None
        ended = None
        if state.epoch:
            ended = max(0.0, now - state.started)
            state.held_seconds += ended
            state.closed.append((state.started, now))
        state.epoch, state.started = epoch, now
        self._prune(state, now)
        return ended

    def forget(self, group: str) -> None:
        """The group is gone (removed while idle)."""
        self._groups.pop(group, None)
        self._at_start.discard(group)
        self._appeared.pop(group, None)

    def groups(self) -> list[str]:
        """The groups held now or within the window (after :meth:`expire`)."""
        return list(self._groups)

    def expire(self, now: float) -> None:
        """Stop tracking groups that are free and were not held within the window."""
        for group, state in list(self._groups.items()):
            if not state.epoch:
                self._prune(state, now)
                if not state.closed:
                    del self._groups[group]
                    # Watched (free) for the whole window: held again, that counts.
                    self._appeared[group] = state.since

    def held(self, group: str) -> bool:
        state = self._groups.get(group)
        return bool(state and state.epoch)

    def duty(self, group: str, now: float) -> Duty:
        """The share of the last ``window`` seconds (or of the time the group was watched, if
        shorter) in which the group was held, with that span."""
        state = self._groups.get(group)
        if state is None:
            first = self._appeared.get(group, self.started)
            return Duty(0.0, min(self.window, max(0.0, now - first)))
        self._prune(state, now)
        open_since = state.started if state.epoch else None
        return duty_over(state.closed, open_since, state.since, now, self.window)

    def duty_cycle(self, group: str, now: float) -> float:
        """:meth:`duty`'s share alone (the ``/metrics`` gauge)."""
        return self.duty(group, now).ratio

    def held_seconds(self, group: str, now: float) -> float:
        """Seconds the group was held since this replica started to track it."""
        state = self._groups.get(group)
        if state is None:
            return 0.0
        return state.held_seconds + (now - state.started if state.epoch else 0.0)

    def hold_age(self, group: str, now: float) -> float:
        """How long the hold in progress has lasted (0: free)."""
        state = self._groups.get(group)
        return now - state.started if state is not None and state.epoch else 0.0

    def _prune(self, state: _Group, now: float) -> None:
        horizon = now - self.window
        while state.closed and state.closed[0][1] <= horizon:
            state.closed.popleft()
