"""A caller that gives up just as its acquire succeeds on the client's own loop.

The client lives on a loop in another thread; the caller waits from its own loop (an async
function decorated by the sync client) or blocks (Ctrl-C). When the caller gives up at the
moment the grant arrives over there, the result is dropped on its way back: without a hand-off,
the grant stayed recorded and held on the server, and nobody yielded it.

The client's own acquire (the runner's calls) is wrapped only to hold its loop for a moment
after the grant, which is where the caller gives up.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.sdk.fakes import FakeOrchestrator
from timeslice import Grant, TimeSliceOrchestratorClient
from timeslice.runner import ClientRunner, GroupCalls

GROUP = "g1"


class _HoldingTheLoop:
    """The runner's calls, made to call ``give_up`` once granted and then hold the client's
    loop briefly, so the caller gives up before the result can travel back to it."""

    def __init__(self, calls: GroupCalls, give_up: Callable[[], object]) -> None:
        self._calls = calls
        self._give_up = give_up

    async def acquire(self, *args: Any) -> Grant:
        grant = await self._calls.acquire(*args)
        self._give_up()
        time.sleep(0.3)  # blocks the client's loop: the result is not back yet
        return grant

    async def yield_(self, group: str) -> None:
        await self._calls.yield_(group)


def _after_the_grant(runner: ClientRunner, give_up: Callable[[], object]) -> None:
    runner._calls = _HoldingTheLoop(runner._calls, give_up)


def _given_back(orch: FakeOrchestrator, client: TimeSliceOrchestratorClient) -> None:
    """Released on the server, and forgotten by the client (once the Yield's answer is read:
    the server's state changes a moment before)."""
    orch.wait_for(lambda s: s.holder_of(GROUP) is None and not client.grants(), timeout=20)


async def test_a_cancelled_caller_on_another_loop_gets_its_grant_given_back(
    orch: FakeOrchestrator, job_env: str
) -> None:
    client = TimeSliceOrchestratorClient(orch.target)
    try:
        here = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Grant]] = []
        _after_the_grant(client.aio.runner, lambda: here.call_soon_threadsafe(tasks[0].cancel))
        tasks.append(asyncio.create_task(client.aio.acquire(GROUP, timeout=10)))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        await asyncio.to_thread(_given_back, orch, client)
    finally:
        await asyncio.to_thread(client.close)


def test_an_interrupted_blocking_caller_gets_its_grant_given_back(
    orch: FakeOrchestrator, job_env: str
) -> None:
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with (
        TimeSliceOrchestratorClient(orch.target) as client,
        contextlib.ExitStack() as restore,
    ):
        restore.callback(signal.signal, signal.SIGINT, previous)
        _after_the_grant(client.aio.runner, _thread.interrupt_main)
        with pytest.raises(KeyboardInterrupt):
            client.acquire(GROUP, timeout=10)
        _given_back(orch, client)
