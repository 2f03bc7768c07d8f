"""A rate-limited work queue of keys, served by a bounded set of supervised workers.

Modelled on client-go's rate-limited workqueue: whoever sees a change adds the key of what
changed, and a worker later reconciles that key from current state. Because a reconcile pass is
level-triggered, what matters is that a key runs again after it changed, never how often it was
added:

- ``add(key)`` dedups: a key waits in the queue at most once, and a key added while a worker
  holds it runs once more after that worker is done, so no two workers ever hold one key;
- ``add_after(key, delay)`` adds it later, keeping the earliest of several such requests; an
  ``add`` in the meantime supersedes it (the pass it starts decides afresh what comes next);
- ``add_rate_limited(key)`` adds it after a per-key exponential backoff (:class:`KeyedBackoff`,
  one :class:`timeslice.backoff.Backoff` per key); ``forget(key)`` resets that backoff;
- a handler that raises is logged, reported to ``on_error`` and retried with that backoff;
- ``shutdown()`` drops what waits, cancels the passes in flight and ends the workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from timeslice.backoff import Backoff

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

# How often shutdown repeats its cancel to a worker that has not ended yet.
_RECANCEL_SECONDS = 0.5


class KeyedBackoff(Generic[K]):
    """One :class:`timeslice.backoff.Backoff` per key: ``initial * 2**n`` after ``n``
    failures of that key, at most ``maximum``; without jitter, as a single task retries it."""

    def __init__(self, initial: float, maximum: float) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"need 0 < initial <= maximum, got {initial} and {maximum}")
        self._initial = initial
        self._maximum = maximum
        self._keys: dict[K, tuple[Backoff, int]] = {}

    def when(self, key: K) -> float:
        """Count one more failure of ``key`` and return how long it should wait."""
        backoff, failures = self._keys.get(key) or (
            Backoff(self._initial, self._maximum, jitter=False),
            0,
        )
        self._keys[key] = (backoff, failures + 1)
        return backoff.next_delay()

    def forget(self, key: K) -> None:
        """``key`` succeeded: its next failure waits ``initial`` again."""
        self._keys.pop(key, None)

    def failures(self, key: K) -> int:
        """Consecutive failures of ``key`` since it was last forgotten."""
        return self._keys[key][1] if key in self._keys else 0


class WorkQueue(Generic[K]):
    """Keys waiting to be handled, and the workers that handle them (see the module doc)."""

    def __init__(
        self,
        handler: Callable[[K], Awaitable[None]],
        *,
        workers: int,
        backoff: KeyedBackoff[K],
        name: str = "workqueue",
        on_error: Callable[[K, BaseException], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("a work queue needs at least one worker")
        self._handler = handler
        self._size = workers
        self._backoff = backoff
        self._name = name
        self._on_error = on_error
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        # Keys that must run: each is in _ready, or held by a worker and re-queued when done.
        self._dirty: set[K] = set()
        self._active: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False

    # -- adding ---------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """Handle ``key`` as soon as a worker is free (once, however often it is added)."""
        if self._closed:
            return
        self._cancel_timer(key)
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._active:
            self._ready.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` in ``delay`` seconds, unless something adds it earlier."""
        if self._closed:
            return
        if delay <= 0:
            self.add(key)
            return
        if key in self._dirty:
            return  # it runs soon anyway, and that pass decides when to look again
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= due:
                return
            current[1].cancel()
        self._timers[key] = (due, loop.call_later(delay, self._fire, key))

    def add_rate_limited(self, key: K) -> None:
        """Add ``key`` after its backoff, which doubles with each call until ``forget``."""
        self.add_after(key, self._backoff.when(key))

    def forget(self, key: K) -> None:
        """``key`` succeeded: reset its backoff (it does not remove a pending add)."""
        self._backoff.forget(key)

    def requeues(self, key: K) -> int:
        """How many rate-limited adds ``key`` had since it was last forgotten."""
        return self._backoff.failures(key)

    def __len__(self) -> int:
        """Keys ready to run now (not counting delayed ones or those being handled)."""
        return self._ready.qsize()

    def waiting(self, key: K) -> bool:
        """Whether ``key`` is due to run, now or after a delay."""
        return key in self._dirty or key in self._timers

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def _cancel_timer(self, key: K) -> None:
        current = self._timers.pop(key, None)
        if current is not None:
            current[1].cancel()

    # -- running --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (in the running event loop)."""
        if self._started or self._closed:
            return
        self._started = True
        for _ in range(self._size):
            self._spawn()

    async def shutdown(self) -> None:
        """Stop for good: drop waiting keys, cancel passes in flight, wait for the workers."""
        self._closed = True
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        # Cancel until they end: a pass can swallow a cancellation (Python 3.11's wait_for,
        # for one, returns a result that lands together with the cancel) and go on awaiting.
        pending = set(self._workers)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=_RECANCEL_SECONDS)

    def _spawn(self) -> None:
        task = asyncio.create_task(self._work(), name=f"{self._name}-worker")
        self._workers.add(task)
        task.add_done_callback(self._worker_done)

    def _worker_done(self, task: asyncio.Task[None]) -> None:
        # Supervision: a worker only ends on shutdown; if one ends otherwise (a bug here, or
        # someone cancelled it), replace it so the pool keeps its size.
        self._workers.discard(task)
        if self._closed:
            return
        if task.cancelled():
            log.error("%s: a worker was cancelled; starting another", self._name)
        else:
            log.error("%s: a worker died; starting another", self._name, exc_info=task.exception())
        self._spawn()

    async def _work(self) -> None:
        # Checked between passes, not only through cancellation (see shutdown).
        while not self._closed:
            key = await self._ready.get()
            self._dirty.discard(key)
            self._active.add(key)
            try:
                await self._handler(key)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    raise  # shutdown, or this worker was cancelled: let it end
                self._failed(key, asyncio.CancelledError())  # raised inside the handler
            except Exception as exc:
                self._failed(key, exc)
            finally:
                self._active.discard(key)
                if key in self._dirty and not self._closed:
                    self._ready.put_nowait(key)
            # A pass that never awaits, and a get from a non-empty queue, do not give up the
            # loop: without this, a burst of quick passes would starve everything else on it
            # (the replica's lease keepalive among them) until the queue ran dry.
            await asyncio.sleep(0)

    def _failed(self, key: K, exc: BaseException) -> None:
        log.error("%s: handling %r failed; retrying with backoff", self._name, key, exc_info=exc)
        if self._on_error is not None:
            try:
                self._on_error(key, exc)
            except Exception:
                log.exception("%s: on_error failed", self._name)
        self.add_rate_limited(key)
