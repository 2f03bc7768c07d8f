"""A group's tenure in the client: every transition and every refused one, without a server.

The releases here are real :class:`PendingRelease` objects whose Yield is a local function;
the sessions are real :class:`Session` objects that never make a call.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest

from timeslice._release import PendingRelease, ReleaseOutcome
from timeslice._session import Session
from timeslice._tenure import _ALLOWED, Tenure, Tenures, TenureState, can_transition
from timeslice._transport import Transport
from timeslice._types import Grant
from timeslice.errors import AlreadyExists, InternalError, NotHolder, Unavailable
from timeslice.targets import targets_from_env

S = TenureState
GROUP = "g1"


def _session() -> Session:
    transport = Transport(targets_from_env("127.0.0.1:1"), None)
    return Session(
        transport,
        "session-1",
        10.0,
        secret="secret",
        call_timeout=1.0,
        on_keepalive=lambda _: None,
        on_lost=lambda _s, _r: None,
    )


def _grant(epoch: int = 7) -> Grant:
    return Grant(GROUP, "job-a", epoch, 0.0, False, None, 0.0)


def _release(
    session: Session | None = None,
    fail: Callable[[], None] | None = None,
    group: str = GROUP,
) -> PendingRelease:
    """A release whose Yield is confirmed at once (or fails with ``fail``), once run."""

    async def send() -> None:
        if fail is not None:
            fail()

    return PendingRelease(group, 7, session or _session(), send)


async def _landed(release: PendingRelease) -> PendingRelease:
    """The release's Yield was confirmed."""
    await release.run()
    assert release.finished and release.outcome is ReleaseOutcome.RELEASED
    return release


def _state(tenure: Tenure) -> TenureState:
    """The state read afresh (each read records what ended meanwhile)."""
    return tenure.state


async def _at(state: TenureState) -> Tenure:
    """A tenure brought to ``state`` by its own transitions (a release it keeps, unfinished
    but in RELEASED)."""
    tenure = Tenure("job-a", GROUP)
    if state is S.IDLE:
        return tenure
    tenure.begin_acquire()
    if state is S.ACQUIRING:
        return tenure
    if state is S.SWEEPING:
        tenure.give_back_later(_release())
        return tenure
    grant = _grant()
    tenure.acquired(grant)
    if state is S.HELD:
        return tenure
    release = _release()
    assert tenure.release_unconfirmed(grant, release)
    if state is S.RELEASED:
        await _landed(release)
    assert _state(tenure) is state
    return tenure


# ---------------------------------------------------------------------- the table


def test_the_table_names_every_state() -> None:
    assert set(_ALLOWED) == set(TenureState)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(TenureState, TenureState)))
async def test_a_move_outside_the_table_raises_and_changes_nothing(
    src: TenureState, dst: TenureState
) -> None:
    tenure = await _at(src)
    if can_transition(src, dst):
        return
    with pytest.raises(InternalError, match=f"illegal transition {src.value} -> {dst.value}"):
        tenure._move(dst)
    assert _state(tenure) is src


@pytest.mark.parametrize("state", [s for s in TenureState if s is not S.ACQUIRING])
async def test_acquire_outcomes_outside_an_acquire_are_bugs(state: TenureState) -> None:
    tenure = await _at(state)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    moves: list[Callable[[], None]] = [
        lambda: tenure.acquired(_grant(9)),
        tenure.acquire_failed,
        lambda: tenure.give_back_later(_release()),
        lambda: tenure.sweep_after_abort(done),
    ]
    for move in moves:
        with pytest.raises(InternalError, match=f"expected acquiring, found {state.value}"):
            move()
        assert _state(tenure) is state
    with pytest.raises(InternalError, match="expected acquiring"):
        await tenure.cleared()


# ------------------------------------------------------------------- acquire


def test_acquire_then_yield() -> None:
    tenure = Tenure("job-a", GROUP)
    assert _state(tenure) is S.IDLE
    tenure.begin_acquire()
    assert _state(tenure) is S.ACQUIRING
    grant = _grant()
    tenure.acquired(grant)
    assert (tenure.state, tenure.grant) == (S.HELD, grant)
    assert tenure.begin_yield() is grant
    tenure.yielded(grant)
    assert (tenure.state, tenure.grant) == (S.IDLE, None)


async def test_an_acquire_is_refused_while_held_or_acquiring() -> None:
    held = await _at(S.HELD)
    with pytest.raises(AlreadyExists, match=r"already holds group g1 \(epoch 7\); yield it"):
        held.begin_acquire()
    assert held.state is S.HELD
    acquiring = await _at(S.ACQUIRING)
    with pytest.raises(AlreadyExists, match="already in progress"):
        acquiring.begin_acquire()
    assert acquiring.state is S.ACQUIRING


async def test_a_failed_acquire_with_nothing_left_is_idle() -> None:
    tenure = await _at(S.ACQUIRING)
    tenure.acquire_failed()
    assert _state(tenure) is S.IDLE


async def test_an_aborted_acquire_sweeps_and_the_next_waits_for_the_sweep() -> None:
    tenure = await _at(S.ACQUIRING)
    gate = asyncio.Event()
    sweep = asyncio.create_task(gate.wait())
    tenure.sweep_after_abort(sweep)  # type: ignore[arg-type]
    assert _state(tenure) is S.SWEEPING
    with pytest.raises(NotHolder):
        tenure.begin_yield()  # the job never had what the sweep takes back
    tenure.begin_acquire()
    waiting = asyncio.create_task(tenure.cleared())
    await asyncio.sleep(0.05)
    assert not waiting.done(), "an acquire must not queue before the sweep ended"
    # Given up while the sweep still runs: back to SWEEPING, not IDLE.
    tenure.acquire_failed()
    assert _state(tenure) is S.SWEEPING
    gate.set()
    await asyncio.wait_for(waiting, 5)
    assert _state(tenure) is S.IDLE  # its end is recorded when the tenure is next looked at
    assert tenure.sweep is None


async def test_a_grant_given_back_late_is_sweeping_not_the_jobs_to_retry() -> None:
    tenure = await _at(S.ACQUIRING)
    release = _release()
    tenure.give_back_later(release)
    assert _state(tenure) is S.SWEEPING
    with pytest.raises(NotHolder):
        tenure.begin_yield()
    await _landed(release)
    assert _state(tenure) is S.IDLE


# --------------------------------------------------------------------- yield


@pytest.mark.parametrize("state", [S.IDLE, S.ACQUIRING, S.SWEEPING])
async def test_a_yield_is_refused_without_a_grant_or_a_release_to_retry(state: TenureState) -> None:
    tenure = await _at(state)
    with pytest.raises(NotHolder, match="does not hold group g1"):
        tenure.begin_yield()
    assert _state(tenure) is state


async def test_an_unconfirmed_yield_is_retried_by_the_jobs_next_yield_once() -> None:
    tenure = await _at(S.HELD)
    grant = tenure.grant
    assert grant is not None
    release = _release()
    assert tenure.release_unconfirmed(grant, release)
    assert (tenure.state, tenure.grant) == (S.RELEASING, None)
    assert tenure.begin_yield() is release  # the retry waits for it
    await _landed(release)
    assert _state(tenure) is S.RELEASED
    assert tenure.begin_yield() is release  # the retry hears how it ended...
    tenure.told(release)
    assert _state(tenure) is S.IDLE
    with pytest.raises(NotHolder):  # ...once
        tenure.begin_yield()


async def test_an_acquire_waits_out_the_release_and_is_then_past_it() -> None:
    tenure = await _at(S.RELEASING)
    release = tenure.release
    assert release is not None
    tenure.begin_acquire()
    assert _state(tenure) is S.ACQUIRING
    with pytest.raises(NotHolder):
        tenure.begin_yield()  # a yield now is of the hold this acquire gets
    waiting = asyncio.create_task(tenure.cleared())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert release._wake.is_set(), "waited for: retried now, not after its pause"
    # Given up while the release still runs: it is clean-up now, not the job's retry.
    tenure.acquire_failed()
    assert _state(tenure) is S.SWEEPING
    with pytest.raises(NotHolder):
        tenure.begin_yield()
    await _landed(release)
    await asyncio.wait_for(waiting, 5)
    assert (tenure.state, tenure.release) == (S.IDLE, None)


async def test_an_acquire_after_the_release_ended_drops_it() -> None:
    tenure = await _at(S.RELEASED)
    tenure.begin_acquire()
    assert (tenure.state, tenure.release) == (S.ACQUIRING, None)
    tenure.acquire_failed()
    assert _state(tenure) is S.IDLE
    with pytest.raises(NotHolder):
        tenure.begin_yield()


async def test_told_after_an_acquire_began_changes_nothing() -> None:
    tenure = await _at(S.RELEASED)
    release = tenure.release
    assert release is not None
    tenure.begin_acquire()
    tenure.told(release)
    assert _state(tenure) is S.ACQUIRING


async def test_a_stale_yield_answer_leaves_a_newer_grant_alone() -> None:
    tenure = await _at(S.HELD)
    old = tenure.grant
    assert old is not None
    tenure.drop_grant()  # the session took it away
    tenure.begin_acquire()
    new = _grant(8)
    tenure.acquired(new)
    tenure.yielded(old)
    assert (tenure.state, tenure.grant) == (S.HELD, new)
    # Nor does an unconfirmed yield of the old grant make the new one a release.
    assert not tenure.release_unconfirmed(old, _release())
    assert (tenure.state, tenure.grant, tenure.release) == (S.HELD, new, None)


@pytest.mark.parametrize("state", [S.ACQUIRING, S.RELEASING, S.RELEASED, S.SWEEPING])
async def test_an_unconfirmed_yield_of_a_grant_the_group_moved_past_is_nobodys(
    state: TenureState,
) -> None:
    tenure = await _at(state)
    before = (tenure.release, tenure.sweep)
    assert not tenure.release_unconfirmed(_grant(3), _release())
    assert _state(tenure) is state and (tenure.release, tenure.sweep) == before


async def test_an_unconfirmed_yield_after_the_session_took_the_grant_is_the_jobs_to_retry() -> None:
    tenure = await _at(S.HELD)
    grant = tenure.grant
    assert grant is not None
    tenure.drop_grant()
    assert _state(tenure) is S.IDLE
    assert tenure.release_unconfirmed(grant, _release())
    assert _state(tenure) is S.RELEASING


# ------------------------------------------------------------ sessions, the table


async def test_a_lost_session_drops_the_grants_and_wakes_its_releases() -> None:
    tenures = Tenures("job-a")
    session = _session()
    for group in ("a", "b", "c"):
        tenures[group].begin_acquire()
        tenures[group].acquired(Grant(group, "job-a", 1, 0.0, False, None, 0.0))
    grant_c = tenures["c"].grant
    assert grant_c is not None

    def unavailable() -> None:
        raise Unavailable("away")

    release = _release(session, unavailable, group="c")
    assert tenures["c"].release_unconfirmed(grant_c, release)
    other = _release()
    tenures["d"].begin_acquire()
    tenures["d"].give_back_later(other)
    assert set(tenures.grants()) == {"a", "b"}
    assert tenures.session_lost(session) == ["a", "b"]
    assert tenures.grants() == {}
    assert [tenures.state_of(g) for g in "abcd"] == [S.IDLE, S.IDLE, S.RELEASING, S.SWEEPING]
    assert release._wake.is_set() and not other._wake.is_set()


def test_the_table_knows_every_group_as_idle_first() -> None:
    tenures = Tenures("job-a")
    assert tenures.state_of("never") is S.IDLE
    assert tenures["never"] is tenures["never"]
    assert tenures.drop_grants() == []
