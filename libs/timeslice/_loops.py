"""Running coroutines on an event loop that lives in another thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from timeslice.errors import Cancelled, Timeout

T = TypeVar("T")

_SLICE = 0.25


def call_in_loop(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    *,
    wait: float | None,
    grace: float,
    what: str,
) -> T:
    """Run ``coro`` on ``loop`` (running in another thread) and block until it finishes.

    ``wait`` bounds the wait (``None``: the coroutine bounds itself, e.g. an acquire without a
    timeout). If the wait ends early (deadline, or KeyboardInterrupt in the caller) the work is
    cancelled and given up to ``grace`` seconds to clean up (an acquire then cancels its stream
    and gives back a grant that raced the cancel) before the caller sees the error.
    """
    finished = threading.Event()

    async def runner() -> T:
        try:
            return await coro
        finally:
            finished.set()

    try:
        future = asyncio.run_coroutine_threadsafe(runner(), loop)
    except RuntimeError:
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
        future.cancel()
        finished.wait(grace)
        raise
    if not future.done():
        future.cancel()
        finished.wait(grace)
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
