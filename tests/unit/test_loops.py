"""Running a coroutine on an event loop in another thread (timeslice._loops), as the sync client
does: results and errors come back, a deadline cancels the work before the caller hears of it,
and a result that lands as its caller gives up is taken back instead of left behind."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Iterator

import pytest

from timeslice._loops import _Handoff, await_in_loop, call_in_loop, current_loop
from timeslice.errors import Cancelled, NotFound, Timeout


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop running in a thread of its own, stopped and closed after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


async def _value(value: int) -> int:
    return value


async def _fails() -> int:
    raise NotFound("no such group")


def test_the_result_or_the_error_comes_back(loop: asyncio.AbstractEventLoop) -> None:
    assert call_in_loop(loop, _value(3), wait=10, grace=1, what="t") == 3
    with pytest.raises(NotFound, match="no such group"):
        call_in_loop(loop, _fails(), wait=10, grace=1, what="t")


def test_a_deadline_cancels_the_work_before_the_caller_hears(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cleaned_up = threading.Event()

    async def forever() -> int:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned_up.set()
        return 0

    with pytest.raises(Timeout, match=r"slow: no result within 0\.05s"):
        call_in_loop(loop, forever(), wait=0.05, grace=10, what="slow")
    # The work's own clean-up ran within the grace, before Timeout reached the caller.
    assert cleaned_up.is_set()


def test_a_closed_loop_is_a_cancel_and_the_work_never_starts() -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    started = []

    async def work() -> int:
        started.append(1)
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Cancelled, match="the client's event loop is closed"):
            call_in_loop(closed, work(), wait=1, grace=1, what="t")
        gc.collect()
    assert not started
    # Neither the work nor the wrapper that would have run it is left un-awaited (a
    # RuntimeWarning at garbage collection, far from the call that caused it).
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_await_in_loop_brings_back_the_other_loops_result(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def where() -> asyncio.AbstractEventLoop | None:
        return current_loop()

    assert await await_in_loop(loop, where(), grace=1) is loop
    with pytest.raises(NotFound):
        await await_in_loop(loop, _fails(), grace=1)


def test_current_loop_is_none_outside_a_loop() -> None:
    assert current_loop() is None


async def test_a_result_handed_over_before_the_give_up_is_the_callers_to_undo() -> None:
    undone: list[int] = []

    async def undo(value: int) -> None:
        undone.append(value)

    handoff = _Handoff(undo)
    assert await handoff.run(_value(5)) == 5
    taking_back = handoff.abandon()
    assert taking_back is not None and not undone
    await taking_back
    assert undone == [5]


async def test_a_result_that_comes_after_the_give_up_is_undone_where_it_was_made() -> None:
    undone: list[int] = []

    async def undo(value: int) -> None:
        undone.append(value)

    handoff = _Handoff(undo)
    assert handoff.abandon() is None  # nothing handed over yet: the call undoes its own
    await handoff.run(_value(6))
    assert undone == [6]


async def test_without_an_undo_nothing_is_taken_back() -> None:
    handoff: _Handoff[int] = _Handoff(None)
    await handoff.run(_value(1))
    assert handoff.abandon() is None
