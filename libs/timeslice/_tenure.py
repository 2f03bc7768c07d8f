"""This client's tenure of each group: an explicit state machine, one per group.

A tenure is everything the client has under way for one group, from the acquire that asks
for it, through the hold, to the release that lands, or the clean-up after an acquire that
was aborted. (Not a *hold*: that is the orchestrator's record of who holds a group, and
:class:`timeslice.integrations._hold.GroupHold` is a framework phase's use of one.)

::

    IDLE -------> ACQUIRING --> HELD | SWEEPING | IDLE
    HELD -------> IDLE          (yielded, or the grant went with the session)
    HELD -------> RELEASING     (the yield was not confirmed: sent again in the background)
    IDLE -------> RELEASING     (the same, for a grant the session took away meanwhile)
    RELEASING --> RELEASED      (that release ended before the job's retry of its yield)
    RELEASED ---> IDLE          (the retry heard how it ended, once)
    RELEASING | RELEASED | SWEEPING --> ACQUIRING

The ordering rules of the group are these transitions:

- An acquire is refused while the group is held or being acquired (``AlreadyExists``).
- An acquire first waits out the clean-up it found (a release still being sent, a sweep), so
  the job never queues behind its own stale hold; from then on the release is no longer the
  job's to retry: a ``yield_`` is of the hold the acquire gets.
- A ``yield_`` acts on the grant (HELD), or is the job's retry of a yield that was not
  confirmed (RELEASING: wait for it; RELEASED: hear how it ended, once); anything else is
  refused (``NotHolder``), with no call made.
- A yield in flight leaves the tenure HELD until the orchestrator answers: the grant is the
  job's until then.

Background work (a release, a sweep) ends on its own; its end is recorded the next time the
tenure is looked at (:attr:`Tenure.state`), so no transition acts on a stale state. A move
the table does not allow is a bug in the client: it raises ``InternalError`` and changes
nothing.

The calls that move tenures are :class:`timeslice._core.ClientCore`'s; this module makes no
call and starts no task, so every transition is tested without a server.
"""

from __future__ import annotations

import asyncio
import enum

from timeslice._release import PendingRelease
from timeslice._session import Session
from timeslice._types import Grant
from timeslice.errors import AlreadyExists, InternalError, NotHolder


class TenureState(enum.Enum):
    """Where this client stands with one group."""

    IDLE = "idle"
    """Nothing held, nothing under way."""
    ACQUIRING = "acquiring"
    """An acquire is under way (first waiting out the clean-up it found)."""
    HELD = "held"
    """Granted: the grant is recorded."""
    RELEASING = "releasing"
    """The job's yield was not confirmed; it is sent again in the background until the
    orchestrator answers, and the job's retry of the yield waits for it."""
    RELEASED = "released"
    """That release ended before the job retried its yield: the retry hears how, once."""
    SWEEPING = "sweeping"
    """Clean-up the job does not wait for: what an aborted acquire left on the server (a
    grant it saw too late or never saw, its queue entry), or a release the job has moved
    past. The next acquire waits for it first."""


_ALLOWED: dict[TenureState, frozenset[TenureState]] = {
    TenureState.IDLE: frozenset({TenureState.ACQUIRING, TenureState.RELEASING}),
    TenureState.ACQUIRING: frozenset({TenureState.HELD, TenureState.SWEEPING, TenureState.IDLE}),
    TenureState.HELD: frozenset({TenureState.IDLE, TenureState.RELEASING}),
    TenureState.RELEASING: frozenset({TenureState.ACQUIRING, TenureState.RELEASED}),
    TenureState.RELEASED: frozenset({TenureState.ACQUIRING, TenureState.IDLE}),
    TenureState.SWEEPING: frozenset({TenureState.ACQUIRING, TenureState.IDLE}),
}


def can_transition(src: TenureState, dst: TenureState) -> bool:
    """Whether ``src -> dst`` is a legal move."""
    return dst in _ALLOWED[src]


class Tenure:
    """This client's tenure of one group; see the module docstring.

    Owns what the group's state needs: the grant (HELD), the release being sent (RELEASING,
    RELEASED, or as clean-up) and the sweep task (as clean-up).
    """

    def __init__(self, job_id: str, group: str) -> None:
        self.job_id = job_id
        self.group = group
        self._state = TenureState.IDLE
        self.grant: Grant | None = None
        self.release: PendingRelease | None = None
        self.sweep: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"Tenure({self.group!r}, {self.state.value})"

    @property
    def state(self) -> TenureState:
        """The state, with the end of any background work recorded first."""
        self._settle()
        return self._state

    def _settle(self) -> None:
        # A release or sweep ends in its own task: its end is recorded here, when the
        # tenure is next looked at (no callback, so no window where the two disagree).
        if self._state is TenureState.RELEASING:
            assert self.release is not None
            if self.release.finished:
                self._move(TenureState.RELEASED)
        elif self._state in (TenureState.SWEEPING, TenureState.ACQUIRING) and self._cleaned():
            self.release = self.sweep = None
            if self._state is TenureState.SWEEPING:
                self._move(TenureState.IDLE)

    # ----------------------------------------------------------------- acquire

    def begin_acquire(self) -> None:
        """An acquire begins: ACQUIRING, keeping what it must wait out (:meth:`cleared`).

        Raises:
            AlreadyExists: the group is held, or an acquire of it is under way.
        """
        state = self.state
        if state is TenureState.HELD:
            assert self.grant is not None
            raise AlreadyExists(
                f"job {self.job_id} already holds group {self.group} "
                f"(epoch {self.grant.epoch}); yield it first"
            )
        if state is TenureState.ACQUIRING:
            raise AlreadyExists(
                f"an acquire of group {self.group} by job {self.job_id} is already in "
                "progress in this client"
            )
        # A release found here is the acquire's to wait out from now on, not the job's to
        # retry: in ACQUIRING no yield acts on it (and one that ended is dropped).
        self._move(TenureState.ACQUIRING)

    async def cleared(self) -> None:
        """Until the clean-up the acquire found has ended: a release still being sent
        (retried now, not after its pause), then a sweep. The caller bounds the wait."""
        self._expect(TenureState.ACQUIRING)
        release, sweep = self.release, self.sweep
        if release is not None:
            await release.wait()
        if sweep is not None:
            await asyncio.wait((sweep,))

    def acquired(self, grant: Grant) -> None:
        """The acquire was granted: HELD."""
        self._expect(TenureState.ACQUIRING)
        self._move(TenureState.HELD)
        self.grant = grant
        self.release = self.sweep = None  # the acquire waited them out

    def acquire_failed(self) -> None:
        """The acquire ended without a grant and left nothing to take back: back to the
        clean-up it found if that still runs (SWEEPING), else IDLE."""
        self._settle()
        self._expect(TenureState.ACQUIRING)
        self._move(TenureState.IDLE if self._cleaned() else TenureState.SWEEPING)

    def sweep_after_abort(self, sweep: asyncio.Task[None]) -> None:
        """The aborted acquire had sent its request: a grant may have been made unseen, or
        its queue entry outlived it. ``sweep`` looks the group up: SWEEPING."""
        self._expect(TenureState.ACQUIRING)
        self._move(TenureState.SWEEPING)
        self.sweep, self.release = sweep, None

    def give_back_later(self, release: PendingRelease) -> None:
        """A grant that raced the abort of its acquire could not be given back at once:
        ``release`` keeps sending it. The job never had it: SWEEPING, not RELEASING."""
        self._expect(TenureState.ACQUIRING)
        self._move(TenureState.SWEEPING)
        self.release, self.sweep = release, None

    # ------------------------------------------------------------------- yield

    def begin_yield(self) -> Grant | PendingRelease:
        """What a ``yield_`` acts on: the grant to give back (HELD), or the release that
        the job's retry of its yield waits for or hears of (RELEASING, RELEASED).

        Raises:
            NotHolder: none of those: nothing is the job's to yield.
        """
        state = self.state
        if state is TenureState.HELD:
            assert self.grant is not None
            return self.grant
        if state in (TenureState.RELEASING, TenureState.RELEASED):
            assert self.release is not None
            return self.release
        raise NotHolder(
            f"job {self.job_id} does not hold group {self.group} (no grant recorded by this client)"
        )

    def yielded(self, grant: Grant) -> None:
        """The orchestrator confirmed the yield of ``grant``, or said it is not ours: IDLE.
        Nothing changes when ``grant`` is no longer the recorded one (the session took it
        away, and the group may have been acquired again since)."""
        if self.state is TenureState.HELD and self.grant is grant:
            self._move(TenureState.IDLE)
            self.grant = None

    def release_unconfirmed(self, grant: Grant, release: PendingRelease) -> bool:
        """The yield of ``grant`` was not confirmed: RELEASING, with ``release`` sending it
        again. Also from IDLE, when the session took the grant away meanwhile (the job's
        retry then hears that). False, and nothing changes, when the group has moved on
        since (acquired again): that grant's release is nobody's to wait for."""
        state = self.state
        if not (state is TenureState.IDLE or (state is TenureState.HELD and self.grant is grant)):
            return False
        self._move(TenureState.RELEASING)
        self.grant, self.release, self.sweep = None, release, None
        return True

    def told(self, release: PendingRelease) -> None:
        """The job's retry of its yield heard how ``release`` ended: IDLE, so that no later
        yield is that retry again. Nothing changes once an acquire has begun since."""
        if self.state is TenureState.RELEASED and self.release is release:
            self._move(TenureState.IDLE)
            self.release = None

    # ---------------------------------------------------------------- sessions

    def drop_grant(self) -> str | None:
        """The session is gone (or the client closed), and its holds with it: a HELD tenure
        becomes IDLE. Returns the group when it was held."""
        if self.state is not TenureState.HELD:
            return None
        self._move(TenureState.IDLE)
        self.grant = None
        return self.group

    # ---------------------------------------------------------------- internal

    def _cleaned(self) -> bool:
        return (self.release is None or self.release.finished) and (
            self.sweep is None or self.sweep.done()
        )

    def _expect(self, state: TenureState) -> None:
        if self._state is not state:
            raise InternalError(
                f"tenure of group {self.group}: expected {state.value}, found {self._state.value}"
            )

    def _move(self, dst: TenureState) -> None:
        if not can_transition(self._state, dst):
            raise InternalError(
                f"tenure of group {self.group}: illegal transition {self._state.value} -> "
                f"{dst.value}"
            )
        self._state = dst


class Tenures:
    """The client's tenures, one per group it has dealt with (kept for the client's life:
    a late answer to an old call finds its group's tenure, and the grant it names, or not)."""

    def __init__(self, job_id: str) -> None:
        self._job_id = job_id
        self._by_group: dict[str, Tenure] = {}

    def __getitem__(self, group: str) -> Tenure:
        tenure = self._by_group.get(group)
        if tenure is None:
            tenure = self._by_group[group] = Tenure(self._job_id, group)
        return tenure

    def state_of(self, group: str) -> TenureState:
        """The group's state (IDLE for a group this client never dealt with)."""
        tenure = self._by_group.get(group)
        return TenureState.IDLE if tenure is None else tenure.state

    def grants(self) -> dict[str, Grant]:
        """The grants held, keyed by group id."""
        held = {}
        for group, tenure in self._by_group.items():
            if tenure.state is TenureState.HELD:
                assert tenure.grant is not None
                held[group] = tenure.grant
        return held

    def drop_grants(self) -> list[str]:
        """Every HELD tenure becomes IDLE (:meth:`Tenure.drop_grant`); returns their groups."""
        return sorted(g for t in self._by_group.values() if (g := t.drop_grant()) is not None)

    def session_lost(self, session: Session) -> list[str]:
        """``session`` is gone, with its holds: the grants are dropped, and releases sent
        under it are woken to see that there is nothing left to release. Returns the groups
        that were held."""
        for tenure in self._by_group.values():
            if tenure.release is not None and tenure.release.session is session:
                tenure.release.wake()
        return self.drop_grants()
