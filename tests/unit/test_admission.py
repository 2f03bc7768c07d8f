"""Per-client admission (timeslice_orchestrator.admission): buckets, waits, refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from grpclib.const import Status

from timeslice.errors import ResourceExhausted
from timeslice_orchestrator import identity
from timeslice_orchestrator.admission import COSTS, REFUSAL_COST, Admission, _client_key
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.identity import Identity
from timeslice_orchestrator.limits import Limits

T = TypeVar("T")


def _at_once(call: Coroutine[Any, Any, T]) -> T:
    """The call's result, which it must give without once suspending (no wait of any length:
    a wall-clock bound would also count the time a loaded machine keeps this process off)."""
    try:
        call.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    call.close()
    raise AssertionError("the call suspended: it waited instead of being admitted at once")


def _admission(**kwargs: float) -> Admission:
    args: dict[str, float] = {"rate": 100.0, "burst": 10, "max_waiting": 8, "max_wait": 1.0}
    args.update(kwargs)
    return Admission(args["rate"], args["burst"], int(args["max_waiting"]), args["max_wait"])


async def test_within_the_burst_calls_are_admitted_at_once() -> None:
    admission = Admission(100.0, 10, 8, 1.0, clock=lambda: 0.0)  # no refill in between
    for _ in range(10):
        admission.done(_at_once(admission.admit("a", "KeepAlive")), None)
    # The burst spent, the next call waits its turn.
    with pytest.raises(AssertionError, match="suspended"):
        _at_once(admission.admit("a", "KeepAlive"))


async def test_a_connection_in_debt_waits_its_turn_and_others_do_not() -> None:
    admission = _admission(rate=50.0, burst=10)
    for _ in range(10):  # the bucket is spent, and 10 more tokens in debt (one Acquire)
        admission.done(await admission.admit("flood", "KeepAlive"), None)
    admission.done(await admission.admit("flood", "OpenSession"), None)
    order: list[int] = []

    async def flood(i: int) -> None:
        admission.done(await admission.admit("flood", "KeepAlive"), None)
        order.append(i)

    started = time.monotonic()
    tasks = [asyncio.create_task(flood(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    # Another connection: admitted at once while the flood waits.
    admission.done(_at_once(admission.admit("victim", "Acquire")), None)
    assert order == []
    await asyncio.gather(*tasks)
    # 10 tokens of debt at 50 tokens/s: about 0.2 s before the first waiter, in order.
    assert time.monotonic() - started >= 0.18
    assert order == [0, 1, 2]


async def test_too_many_waiting_or_waiting_too_long_is_refused_typed() -> None:
    admission = _admission(rate=10.0, burst=1, max_waiting=2, max_wait=0.2)
    admission.done(await admission.admit("a", "OpenSession"), None)  # 9 tokens in debt
    started = time.monotonic()  # (before the waiters start: their 0.2 s count from then)
    waiting = [asyncio.create_task(admission.admit("a", "KeepAlive")) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted, match=r"2 calls already waiting.*retry in"):
        await admission.admit("a", "KeepAlive")
    # ... but not at once: as late as a waiter, so that a client with more calls in flight
    # than it may queue does not get refusals as fast as it can ask for them.
    assert time.monotonic() - started >= 0.15
    for outcome in await asyncio.gather(*waiting, return_exceptions=True):
        assert isinstance(outcome, ResourceExhausted), outcome  # 0.9 s of debt > 0.2 s
    assert 0.15 <= time.monotonic() - started < 0.85  # refused at max_wait, not after the debt
    # A call whose own deadline is nearer waits only until then: refused after 0.05 s, where
    # without it this call would wait out its 0.9 s of debt and be admitted.
    admission = _admission(rate=10.0, burst=1, max_wait=5.0)
    admission.done(await admission.admit("a", "OpenSession"), None)  # 9 tokens in debt
    started = time.monotonic()
    with pytest.raises(ResourceExhausted):
        await admission.admit("a", "KeepAlive", timeout=0.05)
    assert time.monotonic() - started < 0.6
    assert ResourceExhausted("x").status is Status.RESOURCE_EXHAUSTED


async def test_a_cancelled_waiter_hands_its_turn_on() -> None:
    admission = _admission(rate=50.0, burst=1)
    admission.done(await admission.admit("a", "KeepAlive"), None)
    admission.done(await admission.admit("a", "KeepAlive"), None)  # 0 tokens: in line
    first = asyncio.create_task(admission.admit("a", "KeepAlive"))
    second = asyncio.create_task(admission.admit("a", "KeepAlive"))
    await asyncio.sleep(0)
    first.cancel()
    async with asyncio.timeout(1):
        admission.done(await second, None)


async def test_refusals_cost_more_and_the_debt_is_bounded() -> None:
    admission = _admission(rate=1.0, burst=50)
    ticket = await admission.admit("a", "Acquire")
    assert ticket.tokens == 50 - COSTS["Acquire"]
    admission.done(ticket, Status.RESOURCE_EXHAUSTED)
    assert ticket.tokens == pytest.approx(50 - COSTS["Acquire"] - REFUSAL_COST, abs=0.01)
    for _ in range(20):
        admission.done(ticket, Status.INVALID_ARGUMENT)
    assert ticket.tokens == -50  # never more than a burst in debt
    # Not the client's fault: no surcharge.
    before = ticket.tokens
    admission.done(ticket, Status.UNAVAILABLE)
    assert ticket.tokens == before


async def test_idle_connections_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    admission = Admission(10.0, 5, 4, 1.0, clock=lambda: now[0])
    for i in range(50):
        admission.done(await admission.admit(("10.0.0.1", 1000 + i), "Acquire"), None)
    busy = await admission.admit("busy", "KeepAlive")  # still running
    assert admission.tracked() == 51
    now[0] += 5.0  # every bucket full again; the next call sweeps
    admission.done(await admission.admit("new", "KeepAlive"), None)
    assert admission.tracked() == 2  # the running call's connection and the new one
    admission.done(busy, None)


def test_options_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = Limits()
    assert defaults.client_rate > 0  # on by default
    assert defaults.client_burst >= 10 * COSTS["OpenSession"]
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_CLIENT_RATE", "0")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_CLIENT_MAX_WAIT", "0.5")
    config = parse_args(["--client-burst", "77", "--insecure"])
    assert (config.limits.client_rate, config.limits.client_burst) == (0.0, 77)
    assert config.limits.client_max_wait == 0.5
    assert not Admission.from_limits(config.limits).enabled
    with pytest.raises(ValueError):
        Limits(client_burst=0)
    with pytest.raises(ValueError):
        Limits(client_rate=-1)


def test_a_certificate_identity_is_one_client_over_all_its_connections() -> None:
    def key(who: Identity | None, addr: object) -> object:
        token = identity._current.set(who)
        try:
            return _client_key(addr)
        finally:
            identity._current.reset(token)

    job = Identity(subject="a", job="trainer")
    assert key(job, ("10.0.0.1", 1)) == key(job, ("10.0.0.2", 2)) == ("job", "trainer")
    # Operators, nodes and certificates of no role too, each apart from the others.
    operator = Identity(subject="op", operator=True)
    node = Identity(subject="gpu-1", node="gpu-1")
    nobody = Identity(subject="op")
    keys: set[object] = set()
    for who in (operator, node, nobody):
        assert key(who, ("10.0.0.1", 1)) == key(who, ("10.0.0.2", 2))
        keys.add(key(who, ("10.0.0.1", 1)))
    assert len(keys | {key(job, ("10.0.0.1", 1))}) == 4
    # An operator certificate that also names a job spends the operator's bucket.
    both = Identity(subject="op", job="trainer", operator=True)
    assert key(both, ("10.0.0.3", 3)) == key(operator, ("10.0.0.1", 1))
    # Without TLS (no identity): each connection is its own client.
    assert key(None, ("10.0.0.1", 1)) != key(None, ("10.0.0.1", 2))
