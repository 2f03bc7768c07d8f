"""A yield the orchestrator does not confirm in time: the client keeps releasing the hold.

Against the fake orchestrator, Yield answers UNAVAILABLE (what a replica answers while etcd
is away) until the test lets it through. The real-etcd scenarios are in
``tests/faults/test_yield_outage.py``.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.sdk.fakes import FakeOrchestrator, OrchestratorState
from timeslice import AsyncTimeSliceClient, NotHolder, Timeout, Unavailable
from timeslice._tenure import TenureState
from timeslice.errors import InvalidArgument, SessionExpired

# Long enough for a first call on a loaded machine (a connection, a session: 1 s was too short
# once, with two suites on the 2 cores); each failed yield waits all of it.
CALL_TIMEOUT = 3.0


def _client(orch: FakeOrchestrator, job: str = "job-a") -> AsyncTimeSliceClient:
    return AsyncTimeSliceClient(orch.target, job_id=job, call_timeout=CALL_TIMEOUT)


def _yield_unavailable(state: OrchestratorState) -> None:
    state.fail["Yield"] = Unavailable("etcd is away").to_grpc()


def _yield_answers(state: OrchestratorState) -> None:
    state.fail.pop("Yield", None)


async def _failed_yield(orch: FakeOrchestrator, client: AsyncTimeSliceClient) -> None:
    orch.do(_yield_unavailable)
    # Unavailable, or Timeout when the last answer came too late for the budget (a loaded
    # machine): either way the release was not confirmed.
    with pytest.raises((Unavailable, Timeout)):
        await client.yield_("g1")
    # The job is done with the grant, but the server still has the hold.
    assert client.grants() == {}
    assert orch.do(lambda s: s.holder_of("g1")) == "job-a"


async def test_an_unconfirmed_yield_is_retried_until_it_lands(orch: FakeOrchestrator) -> None:
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)
        orch.do(_yield_answers)
        # Nobody calls the client again: the release lands on its own.
        await orch.until(lambda s: s.holder_of("g1") is None, timeout=5)


async def test_acquire_after_an_unconfirmed_yield_releases_first(
    orch: FakeOrchestrator,
) -> None:
    async with _client(orch) as client:
        first = await client.acquire("g1")
        await _failed_yield(orch, client)
        again = asyncio.create_task(client.acquire("g1", timeout=5))
        await asyncio.sleep(0.3)
        # Not refused (AlreadyExists), and not granted on top of the old hold either.
        assert not again.done()
        orch.do(_yield_answers)
        second = await asyncio.wait_for(again, 5)
        assert second.epoch > first.epoch
        assert client.grants() == {"g1": second}
        await client.yield_("g1")
        assert orch.do(lambda s: s.holder_of("g1")) is None


async def test_acquire_times_out_while_the_release_cannot_land(orch: FakeOrchestrator) -> None:
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)
        with pytest.raises(Timeout):
            await client.acquire("g1", timeout=0.5)
        assert orch.do(lambda s: s.holder_of("g1")) == "job-a"
        orch.do(_yield_answers)
        await client.acquire("g1", timeout=5)
        await client.yield_("g1")


async def test_yield_again_waits_for_the_pending_release(orch: FakeOrchestrator) -> None:
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)
        # Still failing: the second yield says so too, within its own call timeout.
        with pytest.raises(Unavailable, match="still not confirmed"):
            await client.yield_("g1")
        orch.do(_yield_answers)
        await client.yield_("g1")
        assert orch.do(lambda s: s.holder_of("g1")) is None
        with pytest.raises(NotHolder):
            await client.yield_("g1")


async def _session_ends_after_a_failed_yield(
    orch: FakeOrchestrator, client: AsyncTimeSliceClient
) -> str:
    """Acquire g1, fail its yield, then end the session on the server (its lease expired:
    the hold goes with it); Yield answers again. Returns the session's id."""
    await client.acquire("g1")
    session = client.session_id
    assert session is not None
    await _failed_yield(orch, client)
    orch.do(lambda s: s.end_session(session))
    orch.do(_yield_answers)
    return session


async def test_losing_the_session_ends_a_pending_release(orch: FakeOrchestrator) -> None:
    async with AsyncTimeSliceClient(
        orch.target, job_id="job-a", call_timeout=CALL_TIMEOUT, session_ttl=0.6
    ) as client:
        # The client learns of the session's end at its next keepalive.
        session = await _session_ends_after_a_failed_yield(orch, client)
        grant = await client.acquire("g1", timeout=5)
        assert client.session_id != session
        assert client.grants() == {"g1": grant}


async def test_yield_again_after_the_session_ended_says_so(
    orch: FakeOrchestrator, caplog: pytest.LogCaptureFixture
) -> None:
    """The release ended because the session did, not because the orchestrator confirmed
    it: the job's retry of the yield must not return as if it had (the hold goes with the
    session, but the job has lost every other hold of it too)."""
    async with AsyncTimeSliceClient(
        orch.target, job_id="job-a", call_timeout=CALL_TIMEOUT, session_ttl=60
    ) as client:
        await _session_ends_after_a_failed_yield(orch, client)
        with caplog.at_level(logging.WARNING, logger="timeslice"):
            with pytest.raises(SessionExpired, match="ended before the release of group g1"):
                await client.yield_("g1")
        assert any("ends with its session" in r.message for r in caplog.records)
        # Answered once: the next yield has nothing to give back.
        with pytest.raises(NotHolder):
            await client.yield_("g1")


async def test_yield_again_after_the_release_failed_for_good_raises_why(
    orch: FakeOrchestrator,
) -> None:
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)

        def refuse(state: OrchestratorState) -> None:
            state.fail["Yield"] = InvalidArgument("a bug on one side").to_grpc()

        orch.do(refuse)
        with pytest.raises(InvalidArgument, match="a bug on one side"):
            await client.yield_("g1")
        # The server still has the hold: nothing said otherwise.
        assert orch.do(lambda s: s.holder_of("g1")) == "job-a"


async def test_close_ends_a_pending_release_quietly(
    orch: FakeOrchestrator, caplog: pytest.LogCaptureFixture
) -> None:
    client = _client(orch)
    await client.acquire("g1")
    await _failed_yield(orch, client)
    with caplog.at_level(logging.WARNING, logger="timeslice"):
        await asyncio.wait_for(client.close(), 5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Closing is not the session ending under the job.
    assert not [r for r in caplog.records if "ends with its session" in r.message]
    # CloseSession ended the session, and its hold with it.
    assert orch.do(lambda s: s.holder_of("g1")) is None


async def _release_ended(client: AsyncTimeSliceClient, group: str) -> None:
    """Until the client's background release of ``group`` has ended (internal state: the
    orchestrator shows the hold gone before the client has heard the answer)."""
    async with asyncio.timeout(5):
        while client._core.tenures.state_of(group) is TenureState.RELEASING:
            await asyncio.sleep(0.01)


async def test_yield_again_after_the_release_landed_returns_once(orch: FakeOrchestrator) -> None:
    """The job's retry of its failed yield comes after the background release landed: it
    returns, as it does when it comes sooner (above); the next yield has nothing to give."""
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)
        orch.do(_yield_answers)
        await orch.until(lambda s: s.holder_of("g1") is None, timeout=5)
        await _release_ended(client, "g1")
        await client.yield_("g1")
        with pytest.raises(NotHolder):
            await client.yield_("g1")


async def test_a_yield_after_an_acquire_of_the_group_is_not_a_retry(
    orch: FakeOrchestrator,
) -> None:
    """Once the job tried to acquire the group again, the failed yield is behind it: a yield
    of the group without a grant is refused, whether the release is still pending or not."""
    async with _client(orch) as client:
        await client.acquire("g1")
        await _failed_yield(orch, client)
        with pytest.raises(Timeout):
            await client.acquire("g1", timeout=0.3)
        with pytest.raises(NotHolder):
            await client.yield_("g1")  # the release still pending
        orch.do(_yield_answers)
        await orch.until(lambda s: s.holder_of("g1") is None, timeout=5)
        await _release_ended(client, "g1")
        with pytest.raises(NotHolder):
            await client.yield_("g1")  # and after it landed
