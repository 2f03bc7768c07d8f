"""Running coroutines on an event loop that lives in another thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from timeslice.errors import Cancelled, Timeout
from timeslice.tasks import run_to_completion

T = TypeVar("T")

Undo = Callable[[T], Awaitable[object]]
"""Takes back what a call produced when its caller gave up as it finished (a grant: yield it)."""

_SLICE = 0.25


class _Handoff(Generic[T]):
    """Who gets the result of a call run on another thread's loop: its caller, or its undo.

    A caller that gives up (cancelled, interrupted, out of time) cancels the call, but the
    call may finish at that very moment, on the other thread: its result is then dropped by
    the cancelled future, and what it did (a grant, recorded in the client) stays done with
    nobody told. One lock decides: a result handed over before the caller gave up is the
    caller's to undo; one that comes after is undone where it was made.
    """

    def __init__(self, undo: Undo[T] | None) -> None:
        self._undo = undo
        self._lock = threading.Lock()
        self._abandoned = False
        # The result, once handed over to the caller (None is a result too): emptied when
        # the caller gives up and takes it to undo.
        self._handed: list[T] = []

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (on the call's own loop) and hand its result over."""
        result = await coro
        with self._lock:
            if not self._abandoned:
                self._handed.append(result)
                return result
        if self._undo is not None:
            await run_to_completion(self._undo(result))
        return result

    def abandon(self) -> Coroutine[Any, Any, object] | None:
        """The caller gives up: the undo it must run (on the call's loop), if the call had
        already finished with a result; None when the call will undo its own, or has none."""
        with self._lock:
            self._abandoned = True
            if self._undo is None or not self._handed:
                return None
            result = self._handed.pop()
        return _as_coroutine(self._undo(result))


async def _as_coroutine(work: Awaitable[object]) -> object:
    return await work


def _undo_in(
    loop: asyncio.AbstractEventLoop, taking_back: Coroutine[Any, Any, object] | None
) -> concurrent.futures.Future[object] | None:
    """Schedule an undo on ``loop``; None when there is none, or the loop is gone (the client
    was closed meanwhile, and its grants with it): the caller's own error goes on."""
    if taking_back is None:
        return None
    try:
        return asyncio.run_coroutine_threadsafe(taking_back, loop)
    except RuntimeError:
        taking_back.close()
        return None


async def await_in_loop(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    *,
    undo: Undo[T] | None = None,
    grace: float,
) -> T:
    """Await ``coro`` on ``loop`` (running in another thread) from the loop running here.

    A caller cancelled as the call finishes does not leave its result done behind its back:
    ``undo`` takes it back (given up to ``grace`` seconds before the cancellation goes on).
    """
    handoff = _Handoff(undo)
    future = asyncio.run_coroutine_threadsafe(handoff.run(coro), loop)
    try:
        return await asyncio.wrap_future(future)
    except BaseException:
        undone = _undo_in(loop, handoff.abandon())
        if undone is not None:
            await asyncio.wait([asyncio.wrap_future(undone)], timeout=grace)
        raise


def call_in_loop(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    *,
    wait: float | None,
    grace: float,
    what: str,
    undo: Undo[T] | None = None,
) -> T:
    """Run ``coro`` on ``loop`` (running in another thread) and block until it finishes.

    ``wait`` bounds the wait (``None``: the coroutine bounds itself, e.g. an acquire without a
    timeout). If the wait ends early (deadline, or KeyboardInterrupt in the caller) the work is
    cancelled and given up to ``grace`` seconds to clean up (an acquire then cancels its stream
    and gives back a grant that raced the cancel) before the caller sees the error. Work that
    finished just as the caller gave up is taken back with ``undo``, within the same grace.
    """
    finished = threading.Event()
    handoff = _Handoff(undo)

    async def runner() -> T:
        try:
            return await handoff.run(coro)
        finally:
            finished.set()

    def give_up() -> None:
        future.cancel()
        undone = _undo_in(loop, handoff.abandon())
        if undone is not None:
            concurrent.futures.wait([undone], grace)
        else:
            finished.wait(grace)

    work = runner()
    try:
        future = asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:
        # Neither coroutine will run: close both, or each warns "never awaited" when collected.
        work.close()
        coro.close()
        raise Cancelled(f"{what}: the client's event loop is closed") from None
    deadline = None if wait is None else time.monotonic() + wait
    try:
        # Wait in slices: a signal handler (Ctrl-C) runs between them even where the signal
        # does not interrupt a blocked lock wait (another thread got it, interrupt_main()).
        while not future.done():
            left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
            if left <= 0:
                break
            concurrent.futures.wait([future], timeout=left)
    except BaseException:
        # Interrupted while waiting: the work must not outlive the caller's interest in it.
        give_up()
        raise
    if not future.done():
        give_up()
        raise Timeout(f"{what}: no result within {wait:g}s")
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        raise Cancelled(f"{what}: cancelled (the client was closed)") from None


def current_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
