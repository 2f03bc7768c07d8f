"""The driver's rate-limited work queue: dedup, backoff, forget, one worker per key, shutdown."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from timeslice_orchestrator.workqueue import KeyedBackoff, WorkQueue

# Generous bounds: these tests share two cores with etcd and whole clusters.
SOON = 5.0


class Recorder:
    """A handler that records every call, may block per key, and tracks concurrency."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.times: dict[str, list[float]] = {}
        self.active: Counter[str] = Counter()
        self.most_at_once = 0
        self.most_per_key = 0
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, BaseException] = {}
        self.called = asyncio.Event()

    async def __call__(self, key: str) -> None:
        self.calls.append(key)
        self.times.setdefault(key, []).append(asyncio.get_running_loop().time())
        self.called.set()
        self.active[key] += 1
        self.most_per_key = max(self.most_per_key, self.active[key])
        self.most_at_once = max(self.most_at_once, sum(self.active.values()))
        try:
            gate = self.gates.get(key)
            if gate is not None:
                await gate.wait()
            else:
                await asyncio.sleep(0)
            if key in self.fail:
                raise self.fail[key]
        finally:
            self.active[key] -= 1

    async def until(self, count: int, key: str | None = None) -> None:
        """Wait until the handler was called ``count`` times (for ``key``, if given)."""

        def seen() -> int:
            return len(self.calls) if key is None else self.calls.count(key)

        async with asyncio.timeout(SOON):
            while seen() < count:
                self.called.clear()
                await self.called.wait()


def make(
    handler: Recorder, workers: int = 2, base: float = 0.05, cap: float = 0.2
) -> WorkQueue[str]:
    return WorkQueue(handler, workers=workers, backoff=KeyedBackoff(base, cap), name="test")


async def settle() -> None:
    """Let every ready worker run (several loop turns, no real time)."""
    for _ in range(20):
        await asyncio.sleep(0)


# -- backoff ----------------------------------------------------------------------------------


def test_backoff_doubles_per_failure_up_to_the_cap() -> None:
    backoff: KeyedBackoff[str] = KeyedBackoff(0.1, 0.5)
    assert [backoff.when("a") for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])
    assert backoff.failures("a") == 6


def test_backoff_is_per_key_and_forget_resets_it() -> None:
    backoff: KeyedBackoff[str] = KeyedBackoff(0.1, 10.0)
    backoff.when("a")
    backoff.when("a")
    assert backoff.when("b") == pytest.approx(0.1), "another key's failures do not count"
    assert backoff.when("a") == pytest.approx(0.4)
    backoff.forget("a")
    assert backoff.failures("a") == 0
    assert backoff.when("a") == pytest.approx(0.1)
    assert backoff.failures("b") == 1


def test_backoff_stays_finite_after_many_failures() -> None:
    backoff: KeyedBackoff[str] = KeyedBackoff(0.1, 2.0)
    for _ in range(5000):
        delay = backoff.when("a")
    assert delay == 2.0


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_rejects_nonsense(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        KeyedBackoff(base, cap)


# -- adding -----------------------------------------------------------------------------------


async def test_add_dedups_waiting_keys() -> None:
    handler = Recorder()
    queue = make(handler)
    for key in ("a", "b", "a", "a", "b", "c"):
        queue.add(key)
    assert len(queue) == 3
    queue.start()
    try:
        await handler.until(3)
        await settle()
        assert sorted(handler.calls) == ["a", "b", "c"]
        assert len(queue) == 0
    finally:
        await queue.shutdown()


async def test_a_key_added_while_it_runs_runs_once_more_after() -> None:
    handler = Recorder()
    handler.gates["a"] = gate = asyncio.Event()
    queue = make(handler, workers=4)
    queue.start()
    try:
        queue.add("a")
        await handler.until(1, "a")
        for _ in range(5):
            queue.add("a")
        await settle()
        assert handler.calls == ["a"], "not on a second worker while the first holds it"
        gate.set()
        await handler.until(2, "a")
        await settle()
        assert handler.calls == ["a", "a"], "five adds during the pass make one more pass"
        assert handler.most_per_key == 1
    finally:
        await queue.shutdown()


async def test_no_two_workers_ever_hold_one_key() -> None:
    handler = Recorder()
    queue = make(handler, workers=8)
    queue.start()
    try:
        for _ in range(50):
            for key in ("a", "b", "c"):
                queue.add(key)
            await asyncio.sleep(0)
        await settle()
        assert handler.most_per_key == 1
        assert set(handler.calls) == {"a", "b", "c"}
    finally:
        await queue.shutdown()


async def test_the_number_of_workers_bounds_passes_at_once() -> None:
    handler = Recorder()
    gate = asyncio.Event()
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        handler.gates[key] = gate
    queue = make(handler, workers=2)
    queue.start()
    try:
        for key in keys:
            queue.add(key)
        await handler.until(2)
        await settle()
        assert len(handler.calls) == 2 and handler.most_at_once == 2
        gate.set()
        await handler.until(5)
        assert sorted(handler.calls) == keys
        assert handler.most_at_once == 2
    finally:
        await queue.shutdown()


async def test_add_after_waits_and_keeps_the_earliest_request() -> None:
    handler = Recorder()
    queue = make(handler)
    queue.start()
    loop = asyncio.get_running_loop()
    try:
        asked = loop.time()
        queue.add_after("a", 30.0)
        queue.add_after("a", 0.1)  # earlier: replaces the first
        queue.add_after("a", 20.0)  # later: ignored
        assert queue.waiting("a") and len(queue) == 0
        await handler.until(1, "a")
        assert handler.times["a"][0] - asked >= 0.1
        assert not queue.waiting("a"), "the later requests were dropped"
    finally:
        await queue.shutdown()


async def test_add_supersedes_a_pending_delayed_add() -> None:
    handler = Recorder()
    queue = make(handler)
    queue.start()
    try:
        queue.add_after("a", 30.0)
        queue.add("a")
        await handler.until(1, "a")
        await settle()
        assert not queue.waiting("a"), "the delayed add went with the immediate one"
    finally:
        await queue.shutdown()


async def test_add_rate_limited_backs_off_per_key_and_forget_resets() -> None:
    handler = Recorder()
    queue = make(handler, base=0.05, cap=0.2)
    queue.start()
    loop = asyncio.get_running_loop()
    try:
        gaps = []
        for n in range(1, 5):
            asked = loop.time()
            queue.add_rate_limited("a")
            await handler.until(n, "a")
            gaps.append(handler.times["a"][-1] - asked)
        assert queue.requeues("a") == 4
        # Each wait is at least its backoff: 0.05, 0.1, 0.2, then the cap.
        for gap, least in zip(gaps, [0.05, 0.1, 0.2, 0.2], strict=True):
            assert gap >= least * 0.95, gaps
        queue.forget("a")
        assert queue.requeues("a") == 0
        asked = loop.time()
        queue.add_rate_limited("a")
        assert queue.requeues("a") == 1
        await handler.until(5, "a")
        assert handler.times["a"][-1] - asked >= 0.05 * 0.95
    finally:
        await queue.shutdown()


# -- failures and supervision -----------------------------------------------------------------


async def test_a_failing_handler_is_reported_and_retried_with_backoff() -> None:
    handler = Recorder()
    handler.fail["bad"] = RuntimeError("boom")
    errors: list[tuple[str, BaseException]] = []
    queue: WorkQueue[str] = WorkQueue(
        handler,
        workers=1,
        backoff=KeyedBackoff(0.05, 0.2),
        name="test",
        on_error=lambda key, exc: errors.append((key, exc)),
    )
    queue.start()
    try:
        queue.add("bad")
        await handler.until(3, "bad")
        assert [k for k, _ in errors[:2]] == ["bad", "bad"]
        assert isinstance(errors[0][1], RuntimeError)
        assert queue.requeues("bad") >= 2
        times = handler.times["bad"]
        assert times[1] - times[0] >= 0.05 * 0.95 and times[2] - times[1] >= 0.1 * 0.95
        # The single worker survived its handler's failures and serves other keys.
        queue.add("good")
        await handler.until(1, "good")
    finally:
        await queue.shutdown()


async def test_cancelled_error_from_inside_a_handler_does_not_kill_the_worker() -> None:
    handler = Recorder()
    handler.fail["odd"] = asyncio.CancelledError()
    errors: list[str] = []
    queue: WorkQueue[str] = WorkQueue(
        handler,
        workers=1,
        backoff=KeyedBackoff(5.0, 5.0),
        name="test",
        on_error=lambda key, exc: errors.append(key),
    )
    queue.start()
    try:
        queue.add("odd")
        await handler.until(1, "odd")
        queue.add("next")
        await handler.until(1, "next")
        assert errors == ["odd"]
        assert queue.waiting("odd"), "retried later, with backoff"
    finally:
        await queue.shutdown()


async def test_a_worker_cancelled_from_outside_is_replaced() -> None:
    handler = Recorder()
    handler.gates["a"] = asyncio.Event()
    queue = make(handler, workers=1)
    queue.start()
    try:
        queue.add("a")
        await handler.until(1, "a")
        (worker,) = [t for t in asyncio.all_tasks() if t.get_name() == "test-worker"]
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await settle()
        queue.add("b")
        await handler.until(1, "b")  # a new worker serves the queue
        queue.add("a")
        await handler.until(2, "a")  # and the interrupted key is not stuck as held
    finally:
        await queue.shutdown()


async def test_shutdown_cancels_passes_drops_waiting_keys_and_ignores_adds() -> None:
    handler = Recorder()
    handler.gates["busy"] = asyncio.Event()
    queue = make(handler, workers=2)
    queue.start()
    queue.add("busy")
    await handler.until(1, "busy")
    queue.add_after("later", 0.05)
    queue.add_rate_limited("limited")
    await queue.shutdown()
    assert handler.active["busy"] == 0, "the pass in flight was cancelled"
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "test-worker"]
    queue.add("after")
    queue.add_after("after", 0.01)
    assert not queue.waiting("after") and not queue.waiting("later")
    await asyncio.sleep(0.2)
    assert handler.calls == ["busy"]
    queue.start()  # a shut-down queue stays shut
    await settle()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "test-worker"]


def test_a_queue_needs_a_worker() -> None:
    with pytest.raises(ValueError):
        WorkQueue(Recorder(), workers=0, backoff=KeyedBackoff(0.1, 1.0))


@pytest.mark.parametrize("then_wait", [False, True])
async def test_shutdown_ends_a_pass_that_swallows_its_cancellation(then_wait: bool) -> None:
    # Python 3.11's wait_for returns a result that lands together with a cancel: the pass goes
    # on as if never cancelled. It may return at once, or wait for something else next.
    entered = asyncio.Event()
    swallowed: list[bool] = []

    async def stubborn(key: str) -> None:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.append(True)
        if then_wait:
            await asyncio.sleep(30)

    queue: WorkQueue[str] = WorkQueue(
        stubborn, workers=1, backoff=KeyedBackoff(0.1, 1.0), name="test"
    )
    queue.start()
    queue.add("a")
    await entered.wait()
    async with asyncio.timeout(SOON):
        await queue.shutdown()
    assert swallowed == [True]
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "test-worker"]
