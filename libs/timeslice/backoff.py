"""Exponential backoff: the one helper every timeslice retry loop uses.

The SDK's failover, the worker registration and the agent's orchestrator link use it with
jitter, so that many clients that lost the same replica do not come back in lockstep; the
orchestrator's own retry loops (store watch, driver, relay) use it without jitter, where a
single task retries and a predictable delay is easier to reason about.
"""

from __future__ import annotations

import random

__all__ = ["BACKOFF_INITIAL", "BACKOFF_MAX", "Backoff"]

BACKOFF_INITIAL = 0.05
"""The first delay, in seconds, unless a caller chooses another."""
BACKOFF_MAX = 1.0
"""The delay never grows past this many seconds, unless a caller chooses another cap."""

# One generator for every Backoff: seeding one per Backoff reads the OS's entropy, and the
# SDK makes a Backoff per call.
_SHARED_RNG = random.Random()


class Backoff:
    """Delays that double from ``initial`` up to ``maximum`` seconds; :meth:`reset` starts over.

    With ``jitter`` (the default) each delay is drawn from ``[d/2, d]`` around the doubling
    value ``d``; without it the delays are exactly ``initial, 2*initial, ...``. ``rng`` makes
    the jitter reproducible in tests.
    """

    def __init__(
        self,
        initial: float = BACKOFF_INITIAL,
        maximum: float = BACKOFF_MAX,
        *,
        jitter: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self._initial = initial
        self._maximum = maximum
        self._jitter = jitter
        self._rng = rng if rng is not None else _SHARED_RNG
        self._next = initial

    def reset(self) -> None:
        """Start again from the initial delay (after a success)."""
        self._next = self._initial

    def next_delay(self) -> float:
        """The delay before the next retry, in seconds; the one after it doubles (up to the cap)."""
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        if not self._jitter:
            return delay
        # Full jitter over the upper half: spread out, yet never much shorter than planned.
        return delay * (0.5 + 0.5 * self._rng.random())
