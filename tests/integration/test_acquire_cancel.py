"""An Acquire whose caller leaves while its write is in flight leaves nothing behind.

The call's stream can end at any await of the handler (the client's deadline, a reset):
after the take-free or enqueue transaction committed, but before the handler learned so, or
while it waits for its mirror to show that write. A hold or queue entry left there sits on the
client's live session and blocks the group until the session ends, while the client, told
nothing was granted, gets AlreadyExists from its next Acquire.

In-process LockService over a real etcd and a real mirror; the store and the mirror are
wrapped only to hold the handler at the await where the caller leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.integration.groupstore import holder, snapshot
from timeslice import AcquireStage
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore


@contextlib.asynccontextmanager
async def _service(store: GroupStore) -> AsyncIterator[tuple[LockService, Mirror]]:
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        yield LockService(store, mirror, Metrics(), 30), mirror
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


class _Held:
    """Wraps an async method: the real call runs to its end, then the wrapper waits for the
    test to let it return (the caller is cancelled meanwhile)."""

    def __init__(self, real: Callable[..., Awaitable[Any]]) -> None:
        self.real = real
        self.done = asyncio.Event()
        self.gate = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.real(*args, **kwargs)
        self.done.set()
        await self.gate.wait()
        return result


async def _first_step(stages: AsyncGenerator[Progress, None]) -> Progress:
    return await stages.__anext__()


async def _leave_at(step: asyncio.Task[Progress], held: _Held) -> None:
    """Cancel ``step`` once ``held``'s real call has finished, then let the call return."""
    async with asyncio.timeout(10):
        await held.done.wait()
        step.cancel()
        await asyncio.sleep(0.05)  # the cancellation lands on the held await
        held.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await step


async def _queue_keys(store: GroupStore, job: str) -> list[str]:
    return [k for k in await snapshot(store) if "/queue/" in k and k.endswith(f"/{job}")]


async def _until_gone(check: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(10):
        while not await check():
            await asyncio.sleep(0.02)


async def test_leaving_as_a_free_group_is_taken_gives_it_back(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _service(store) as (locks, mirror):
        sid, secret, _ = await locks.open_session("b", 30, "host", 1)
        held = _Held(store.take_free)
        monkeypatch.setattr(store, "take_free", held)
        step = asyncio.create_task(_first_step(locks.acquire(sid, "b", "g", 0, secret=secret)))
        await _leave_at(step, held)

        async def free() -> bool:
            return await holder(store) is None

        await _until_gone(free)
        # And the job can take it again (no AlreadyExists from a hold it never got), once
        # this replica's mirror shows the group free as etcd does.
        monkeypatch.undo()

        async def shown_free() -> bool:
            return mirror.holder("g") is None

        await _until_gone(shown_free)
        async with asyncio.timeout(10):
            granted = await _first_step(locks.acquire(sid, "b", "g", 0, secret=secret))
        assert granted.stage is AcquireStage.GRANTED


async def test_leaving_as_the_queue_entry_is_written_withdraws_it(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _service(store) as (locks, _):
        a, a_secret, _ = await locks.open_session("a", 30, "host", 1)
        b, b_secret, _ = await locks.open_session("b", 30, "host", 2)
        async with asyncio.timeout(10):
            first = await _first_step(locks.acquire(a, "a", "g", 0, secret=a_secret))
        assert first.stage is AcquireStage.GRANTED
        held = _Held(store.enqueue)
        monkeypatch.setattr(store, "enqueue", held)
        step = asyncio.create_task(_first_step(locks.acquire(b, "b", "g", 0, secret=b_secret)))
        await _leave_at(step, held)

        async def withdrawn() -> bool:
            return not await _queue_keys(store, "b")

        await _until_gone(withdrawn)
        # The yield finds nobody waiting: the group is free, not granted to a caller gone.
        await locks.release(a, "a", "g", first.epoch, secret=a_secret)
        await asyncio.sleep(0.3)
        assert await holder(store) is None


async def test_leaving_while_the_mirror_catches_up_gives_the_grant_back(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _service(store) as (locks, mirror):
        sid, secret, _ = await locks.open_session("b", 30, "host", 1)
        held = _Held(mirror.wait_for_revision)
        monkeypatch.setattr(mirror, "wait_for_revision", held)
        step = asyncio.create_task(_first_step(locks.acquire(sid, "b", "g", 0, secret=secret)))
        await _leave_at(step, held)
        monkeypatch.undo()

        async def free() -> bool:
            return await holder(store) is None

        await _until_gone(free)
