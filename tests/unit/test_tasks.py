"""The task supervisor: which ends of a critical task are fatal."""

from __future__ import annotations

import asyncio

from timeslice.tasks import Supervisor


async def _forever() -> None:
    await asyncio.Event().wait()


async def _fatal_within(supervisor: Supervisor, seconds: float) -> BaseException | None:
    try:
        return await asyncio.wait_for(supervisor.wait_fatal(), seconds)
    except TimeoutError:
        return None


async def test_a_critical_task_cancelled_from_below_is_fatal() -> None:
    """A CancelledError nobody asked for (a gRPC call whose channel was closed) ends the task
    as if cancelled; silent, the process would stay up without it."""
    supervisor = Supervisor("test")

    async def cancelled_from_below() -> None:
        await asyncio.sleep(0.01)
        raise asyncio.CancelledError

    supervisor.spawn(cancelled_from_below(), "mirror", critical=True)
    fatal = await _fatal_within(supervisor, 2)
    assert isinstance(fatal, RuntimeError) and "cancelled from below" in str(fatal)


async def test_stopping_tasks_through_the_supervisor_is_not_fatal() -> None:
    supervisor = Supervisor("test")
    one = supervisor.spawn(_forever(), "one", critical=True)
    supervisor.spawn(_forever(), "two", critical=True)
    supervisor.cancel(one)
    await asyncio.wait({one})
    assert await _fatal_within(supervisor, 0.1) is None
    await supervisor.cancel_all(timeout=1)
    assert await _fatal_within(supervisor, 0.1) is None
    assert supervisor.running() == []


async def _end(fails: bool) -> None:
    await asyncio.sleep(0)
    if fails:
        raise ValueError("boom")


async def test_a_critical_task_that_fails_or_returns_is_fatal() -> None:
    for outcome in ("fails", "returns"):
        supervisor = Supervisor("test")
        supervisor.spawn(_end(outcome == "fails"), "t", critical=True)
        fatal = await _fatal_within(supervisor, 2)
        assert fatal is not None
        assert ("boom" in repr(fatal)) == (outcome == "fails")
