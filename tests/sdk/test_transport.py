"""The SDK's transport: which replica calls go to after failures."""

from __future__ import annotations

import asyncio

import pytest

from timeslice._transport import Transport
from timeslice.errors import Timeout, Unavailable
from timeslice.targets import HostPort

R0, R1, R2 = HostPort("r0", 1), HostPort("r1", 2), HostPort("r2", 3)


def test_loops_that_saw_one_replica_fail_move_away_from_it_once() -> None:
    """The session's keepalive and an Acquire stream share the transport. Both see r0 fail
    (it paused); the second to report it must not move calls on again, back towards r0 in a
    pair of replicas, or past a healthy r1."""
    pair = Transport([R0, R1])
    pair.rotate(R0)  # the keepalive's call timed out on r0
    pair.rotate(R0)  # then the Acquire stream on r0 failed
    assert pair.current == R1

    three = Transport([R0, R1, R2])
    three.rotate(R0)
    three.rotate(R0)
    assert three.current == R1


def test_a_failure_of_the_current_replica_moves_on_round_robin() -> None:
    transport = Transport([R0, R1, R2])
    for failed, then in ((R0, R1), (R1, R2), (R2, R0)):
        transport.rotate(failed)
        assert transport.current == then


async def _serve(transport: Transport, down: set[HostPort]) -> None:
    """One unary call, answered by every target but those ``down`` (they say UNAVAILABLE,
    as a replica cut off from etcd does)."""

    async def call(stub: object, timeout: float) -> None:
        if transport.current in down:
            raise Unavailable(f"{transport.current}: etcd unreachable")

    await transport.unary("KeepAlive", call, budget=2.0)


async def test_a_call_that_fails_on_one_replica_and_works_on_another_is_announced() -> None:
    """What moves a waiting Acquire off a replica cut off from etcd (see failed_over_from)."""
    transport = Transport([R0, R1])
    watching = asyncio.create_task(transport.failed_over_from(R0))
    other = asyncio.create_task(transport.failed_over_from(R1))
    await _serve(transport, down=set())  # works at once: nothing failed over
    await asyncio.sleep(0)
    assert not watching.done()
    await _serve(transport, down={R0})
    await asyncio.wait_for(watching, 1)
    assert transport.current == R1
    await asyncio.sleep(0)
    assert not other.done()  # r1 did not fail
    other.cancel()
    transport.close()


async def test_a_replica_still_failing_is_announced_when_another_works_later() -> None:
    """r0 is cut off while an etcd election makes r1 fail too: the call fails everywhere and
    moves nothing (etcd itself away: a waiter keeps its stream, and its place). The next call
    goes straight to r1 and works: streams on r0, which has not answered since, move then
    (not never)."""
    transport = Transport([R0, R1])
    watching = asyncio.create_task(transport.failed_over_from(R0))
    with pytest.raises(Unavailable):
        await _serve(transport, down={R0, R1})
    await asyncio.sleep(0)
    assert not watching.done()
    await _serve(transport, down={R0})
    await asyncio.wait_for(watching, 1)
    # Once r0 answers again, it is no longer failing: nothing on it moves.
    transport.rotate(R1)  # calls go to r0 again
    await _serve(transport, down=set())
    on_r0 = asyncio.create_task(transport.failed_over_from(R0))
    await _serve(transport, down=set())
    await asyncio.sleep(0)
    assert not on_r0.done()
    on_r0.cancel()
    transport.close()


async def test_a_budget_that_ends_in_a_retry_reports_the_outage_before_it() -> None:
    """The replica answers UNAVAILABLE; the retry, given what is left of the budget, gets no
    answer in time (a loaded machine). The call failed because the replica was unavailable,
    as it said, not because it was slow: a Timeout here failed a clean-clone run once."""
    transport = Transport([R0])
    timeouts: list[float] = []

    async def call(stub: object, timeout: float) -> None:
        timeouts.append(timeout)
        if len(timeouts) == 1:
            raise Unavailable("r0: etcd unreachable")
        await asyncio.sleep(timeout)
        raise TimeoutError

    with pytest.raises(Unavailable, match="etcd unreachable"):
        await transport.unary("GetGroupStatus(g1)", call, budget=0.5)
    assert len(timeouts) == 2 and timeouts[1] < 0.5
    transport.close()


async def test_a_replica_that_never_answers_is_a_timeout() -> None:
    """No answer at all within the budget: a timeout, not an outage."""
    transport = Transport([R0])

    async def call(stub: object, timeout: float) -> None:
        await asyncio.sleep(timeout)
        raise TimeoutError

    with pytest.raises(Timeout):
        await transport.unary("GetGroupStatus(g1)", call, budget=0.3)
    transport.close()
