"""A release that must land: the Yield of a hold, retried until the orchestrator answers.

``yield_`` sends Yield within the client's call timeout. When no replica confirms it in that
time (etcd away, every replica unreachable), the hold may still be on the server and other
jobs wait behind it. The job has said it is done with the group, so the client keeps sending
the same Yield (same session, same epoch: it is a compare-and-delete, so a repeat cannot
release anything else) in a supervised background task until the orchestrator answers: the
hold is released, or it is already gone. The session ending ends it too, since its holds go
with it.

Meanwhile the group is the job's neither to use nor to hold again: a later ``acquire`` or
``yield_`` of the group first waits for the release (and has it retried at once); the first
``yield_`` after a release that already ended returns at once (it is the job's retry of the
yield that failed). So a job never believes it holds a group that the server released, and
never queues behind its own stale hold.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from timeslice._session import Session
from timeslice.backoff import Backoff
from timeslice.errors import (
    Cancelled,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Timeout,
    TimeSliceError,
    Unavailable,
)

log = logging.getLogger("timeslice")

# Pauses between two Yield calls of a release (each call already retries within its budget).
_RETRY_INITIAL = 0.1
_RETRY_MAX = 1.0


class ReleaseOutcome(enum.Enum):
    """How a pending release ended."""

    PENDING = "pending"
    RELEASED = "released"
    """The orchestrator confirmed the Yield."""
    GONE = "gone"
    """The orchestrator no longer had the hold (a try whose answer was lost had landed)."""
    SESSION_ENDED = "session ended"
    """The session ended first; the orchestrator drops its holds with it."""
    CLIENT_CLOSED = "client closed"
    """The client closed its session, and the session's holds with it."""
    FAILED = "failed"
    """An error a retry does not fix; the hold stays until the session ends."""


class PendingRelease:
    """The release of a hold that its yield could not confirm; see the module docstring.

    Args:
        group, epoch: the hold being given back.
        session: the session it was granted under.
        send: one Yield of the hold, bounded by the client's call timeout.
    """

    def __init__(
        self, group: str, epoch: int, session: Session, send: Callable[[], Awaitable[object]]
    ) -> None:
        self.group = group
        self.epoch = epoch
        self.session = session
        self._send = send
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()
        self.attempts = 0
        self.outcome = ReleaseOutcome.PENDING
        self.error: TimeSliceError | None = None
        """What ended it, when that was not the orchestrator's confirmation."""

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wake(self) -> None:
        """Retry now instead of after the current pause (someone waits, or the session ended)."""
        self._wake.set()

    async def wait(self) -> None:
        """Until the release has ended, however it ended (the caller bounds the wait)."""
        self.wake()
        await self._finished.wait()

    def raise_unless_released(self, job: str) -> None:
        """For the job's retry of the yield, once the release has ended: return when the
        hold is off the orchestrator, raise why it is not (or not known to be) otherwise."""
        if self.outcome in (ReleaseOutcome.RELEASED, ReleaseOutcome.GONE):
            return
        if self.outcome is ReleaseOutcome.SESSION_ENDED:
            reason = f": {self.error}" if self.error is not None else ""
            raise SessionExpired(
                f"the session of job {job} ended before the release of group {self.group} "
                f"(epoch {self.epoch}) was confirmed{reason}; its holds go with it"
            )
        if self.error is not None:
            raise self.error
        # Closed, or its task cancelled (the client is closing) before an answer.
        raise Cancelled(f"the release of group {self.group} was stopped: the client closed")

    async def run(self) -> None:
        """Send Yield until the orchestrator answers it, or the session ends."""
        backoff = Backoff(_RETRY_INITIAL, _RETRY_MAX)
        try:
            while not self.session.done:
                self.attempts += 1
                # Cleared before the call, not after its failure: a wake() while it is under
                # way (someone started waiting) then skips the pause that follows.
                self._wake.clear()
                try:
                    await self._send()
                except (NotHolder, PermissionDenied) as exc:
                    # A previous try landed, or the hold went another way (its session expired
                    # on the server): either way it is no longer ours.
                    self.outcome = ReleaseOutcome.GONE
                    log.info("release of %s: the hold is already gone (%s)", self.group, exc)
                    return
                except SessionExpired as exc:
                    self.error = exc
                    self.session.lose(f"Yield: {exc}")
                    break
                except Cancelled as exc:
                    self.outcome = ReleaseOutcome.CLIENT_CLOSED
                    self.error = exc
                    return
                except (Unavailable, Timeout) as exc:
                    log.warning(
                        "release of %s (epoch %d) not confirmed yet (try %d), retrying: %s",
                        self.group,
                        self.epoch,
                        self.attempts,
                        exc,
                    )
                    try:
                        async with asyncio.timeout(backoff.next_delay()):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                    continue
                except TimeSliceError as exc:
                    # Not something a retry fixes (a bug on one side): say so, and stop.
                    self.outcome = ReleaseOutcome.FAILED
                    self.error = exc
                    log.error(
                        "release of %s (epoch %d) failed for good; the hold stays until the "
                        "session ends: %s",
                        self.group,
                        self.epoch,
                        exc,
                    )
                    return
                self.outcome = ReleaseOutcome.RELEASED
                log.info(
                    "release of %s (epoch %d) confirmed after %d tries",
                    self.group,
                    self.epoch,
                    self.attempts,
                )
                return
            if self.session.lost_reason is None:
                self.outcome = ReleaseOutcome.CLIENT_CLOSED  # closed: its holds with it
                return
            self.outcome = ReleaseOutcome.SESSION_ENDED
            log.warning(
                "release of %s (epoch %d) ends with its session, after %d tries: the "
                "orchestrator drops the session's holds with it",
                self.group,
                self.epoch,
                self.attempts,
            )
        finally:
            self._finished.set()
