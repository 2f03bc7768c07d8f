"""When each group was held: duty cycle over a sliding window, held seconds, hold lengths.

A pure bookkeeping class fed with the group's hold as the mirror shows it (the epoch of the
holder, 0 when free) and a monotonic clock; it reads nothing and writes nothing. Every replica
sees the same changes through its watch, so every replica computes the same figures (within
its watch's lag).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# How far back the duty cycle looks (a dashboard's "last minutes").
DEFAULT_WINDOW_SECONDS = 300.0


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

    def observe(self, group: str, epoch: int, now: float) -> float | None:
        """The group's hold is now ``epoch`` (0: free). Returns the length of the hold this
        ended, if one ended (a new epoch ends the previous hold as well)."""
        state = self._groups.get(group)
        if state is None:
            if not epoch:
                return None  # never seen held: nothing to track yet
            # Free until now, as far as this replica saw (a new group, or one idle for the
            # whole window since it was last tracked).
            state = self._groups[group] = _Group(since=max(self.started, now - self.window))
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

    def held(self, group: str) -> bool:
        state = self._groups.get(group)
        return bool(state and state.epoch)

    def duty_cycle(self, group: str, now: float) -> float:
        """The fraction of the last ``window`` seconds (or of the time tracked, if shorter) in
        which the group was held."""
        state = self._groups.get(group)
        if state is None:
            return 0.0
        self._prune(state, now)
        start = max(now - self.window, state.since)
        span = now - start
        if span <= 0:
            return 1.0 if state.epoch else 0.0
        busy = sum(min(end, now) - max(begin, start) for begin, end in state.closed)
        if state.epoch:
            busy += now - max(state.started, start)
        return min(1.0, max(0.0, busy / span))

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
