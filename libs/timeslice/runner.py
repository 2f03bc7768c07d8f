"""Driving a client on the event loop it lives on, from other loops and from blocking code.

An :class:`~timeslice.AsyncTimeSliceClient` lives on one event loop: its connections, its
session and the keepalive task are bound to it. Its :class:`ClientRunner`
(``client.runner``) is the interface everything else uses to drive it:

- :class:`~timeslice.TimeSliceOrchestratorClient` binds the client to a private loop running
  in a daemon thread (:meth:`ClientRunner.bind`) and blocks on acquire and yield;
- :class:`~timeslice.AcceleratorScope` acquires and yields from plain functions and ``with``
  blocks (blocking) and from ``async`` functions and ``async with`` blocks (awaiting).

The client binds to the first loop that uses it, unless :meth:`ClientRunner.bind` chose one.
Called from another running loop while its own loop runs in another thread, a call is
submitted to its own loop and awaited there, so keepalives never depend on the caller's loop
being responsive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from timeslice._acquire import ProgressCallback
from timeslice._loops import Undo, await_in_loop, call_in_loop, current_loop
from timeslice._types import Grant
from timeslice._validate import check_priority, check_seconds
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id

__all__ = ["ClientRunner", "GroupCalls", "ProgressCallback"]

T = TypeVar("T")

log = logging.getLogger("timeslice")


class GroupCalls(Protocol):
    """The acquire and yield a runner drives on the client's loop, arguments checked
    (:class:`timeslice._core.ClientCore` has them)."""

    async def acquire(
        self, group: str, timeout: float | None, priority: int, on_progress: ProgressCallback | None
    ) -> Grant: ...

    async def yield_(self, group: str) -> None: ...


# Slack on top of a call's own bound before a blocked caller gives up on the loop thread.
_SLACK = 1.0


class ClientRunner:
    """Runs one client's calls on that client's event loop; see the module docstring.

    Args:
        job_id: the job the client acts for (for messages).
        call_timeout: the client's bound on unary calls; blocking waits add it as slack.
        calls: the client's acquire and yield (they run on the client's loop).
    """

    def __init__(self, job_id: str, *, call_timeout: float, calls: GroupCalls) -> None:
        self._job_id = job_id
        self._call_timeout = call_timeout
        self._calls = calls
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def job_id(self) -> str:
        """The job the client acts for."""
        return self._job_id

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client is bound to, if it is bound yet."""
        return self._loop

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the client to ``loop`` before its first use (typically a loop in a thread).

        Raises:
            InvalidArgument: the client is already bound to another loop.
        """
        if self._loop is not None and self._loop is not loop:
            raise InvalidArgument("this client is already bound to another event loop")
        self._loop = loop

    # ------------------------------------------------------------------- awaiting

    async def run(self, coro: Coroutine[Any, Any, T], *, undo: Undo[T] | None = None) -> T:
        """Await ``coro`` on the client's loop, from whatever loop is running here.

        ``undo`` takes back a result that the client's loop produced just as the caller here
        was cancelled (see :func:`timeslice._loops.await_in_loop`).
        """
        try:
            here = self._own_loop_here()
        except BaseException:
            coro.close()
            raise
        if here:
            return await coro
        assert self._loop is not None
        return await await_in_loop(self._loop, coro, undo=undo, grace=self._call_timeout)

    async def acquire(
        self,
        group_id: str,
        *,
        timeout: float | None = None,
        priority: int = 0,
        on_progress: ProgressCallback | None = None,
    ) -> Grant:
        """Acquire ``group_id`` (see :meth:`AsyncTimeSliceClient.acquire`), awaiting here."""
        args = _acquire_args(group_id, timeout, priority, on_progress)
        return await self.run(self._calls.acquire(*args), undo=self._give_back)

    async def yield_(self, group_id: str) -> None:
        """Yield ``group_id`` (see :meth:`AsyncTimeSliceClient.yield_`), awaiting here."""
        await self.run(self._calls.yield_(validate_group_id(group_id)))

    # ------------------------------------------------------------------- blocking

    def run_blocking(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        wait: float | None,
        what: str,
        undo: Undo[T] | None = None,
    ) -> T:
        """Run ``coro`` on the client's loop and block this thread until it finishes.

        ``wait`` bounds the wait (``None``: the coroutine bounds itself); see
        :func:`timeslice._loops.call_in_loop` for what an early end does.

        Raises:
            InvalidArgument: the client's loop does not run in another thread (it is not
                bound, stopped, or it is the loop of this very thread).
        """
        loop = self._loop
        problem: str | None = None
        if loop is None or not loop.is_running():
            problem = (
                "blocking use of AsyncTimeSliceClient needs its event loop running in another "
                "thread; use TimeSliceOrchestratorClient in synchronous code, or "
                "`async with client.on_accelerators(...)` / an async function"
            )
        elif current_loop() is loop:
            problem = (
                "this would block the event loop the client runs on; use "
                "`async with client.on_accelerators(...)` or decorate an async function"
            )
        if problem is not None:
            coro.close()
            raise InvalidArgument(problem)
        assert loop is not None
        return call_in_loop(loop, coro, wait=wait, grace=self._call_timeout, what=what, undo=undo)

    def acquire_blocking(
        self,
        group_id: str,
        *,
        timeout: float | None = None,
        priority: int = 0,
        on_progress: ProgressCallback | None = None,
    ) -> Grant:
        """Acquire ``group_id``, blocking this thread until granted, failed or timed out.

        Interrupting the wait (Ctrl-C) cancels the acquire cleanly before it propagates.
        """
        group, wait, prio, progress = _acquire_args(group_id, timeout, priority, on_progress)
        return self.run_blocking(
            self._calls.acquire(group, wait, prio, progress),
            wait=None if wait is None else wait + self._call_timeout + _SLACK,
            what=f"acquire({group})",
            undo=self._give_back,
        )

    def yield_blocking(self, group_id: str) -> None:
        """Yield ``group_id``, blocking this thread until the orchestrator answered."""
        group = validate_group_id(group_id)
        self.run_blocking(
            self._calls.yield_(group), wait=self._call_timeout + _SLACK, what=f"yield({group})"
        )

    # ------------------------------------------------------------------- internal

    async def _give_back(self, grant: Grant) -> None:
        """Yield a grant whose acquire's caller gave up as it arrived (on the client's loop)."""
        try:
            await self._calls.yield_(grant.group_id)
        except Exception as exc:
            # The caller's own error (cancelled, interrupted, timed out) is what propagates.
            log.warning("could not give back %s after its caller left: %s", grant.group_id, exc)

    def _own_loop_here(self) -> bool:
        """True when the running loop is the client's loop (binding it on first use)."""
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = running
        if self._loop is running:
            return True
        if self._loop.is_running() and not self._loop.is_closed():
            return False
        raise InvalidArgument(
            "this client is bound to an event loop that is no longer running; "
            "create one client per event loop"
        )


def _acquire_args(
    group_id: str, timeout: float | None, priority: int, on_progress: ProgressCallback | None
) -> tuple[str, float | None, int, ProgressCallback | None]:
    group = validate_group_id(group_id)
    wait = check_seconds(timeout, "timeout", allow_none=True)
    prio = check_priority(priority)
    if on_progress is not None and not callable(on_progress):
        raise InvalidArgument("on_progress must be callable")
    return group, wait, prio, on_progress
