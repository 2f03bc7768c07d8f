"""The driver's retry ledger: look-ups per group, and forgetting what can never come back."""

from __future__ import annotations

import time

from timeslice_orchestrator.retries import Retry, RetryLedger


def _due_in(seconds: float) -> Retry:
    return Retry(1, time.monotonic() + seconds)


def test_put_get_pop() -> None:
    ledger = RetryLedger()
    assert ledger.get(("g", "a", 5)) is None
    ledger.put(("g", "a", 5), Retry(2, 0.0))
    assert ledger.get(("g", "a", 5)) == Retry(2, 0.0)
    assert ledger.get(("g", "a", 6)) is None and ledger.get(("h", "a", 5)) is None
    ledger.pop(("g", "a", 5))
    ledger.pop(("g", "a", 5))  # popping what is not there is fine
    assert ledger.get(("g", "a", 5)) is None and len(ledger) == 0


def test_wait_is_the_earliest_retry_not_yet_due_in_that_group() -> None:
    ledger = RetryLedger()
    assert ledger.wait("g") == 0.0
    ledger.put(("g", "a", 5), _due_in(30))
    ledger.put(("g", "b", 6), _due_in(2))
    ledger.put(("g", "c", 7), _due_in(-1))  # already due: not waited for
    ledger.put(("h", "d", 8), _due_in(0.5))  # another group
    assert 1.5 < ledger.wait("g") <= 2
    assert 0 < ledger.wait("h") <= 0.5


def test_forget_group() -> None:
    ledger = RetryLedger()
    ledger.put(("g", "a", 5), _due_in(1))
    ledger.put(("h", "a", 5), _due_in(1))
    ledger.forget_group("g")
    ledger.forget_group("nothing")
    assert ledger.get(("g", "a", 5)) is None and ledger.get(("h", "a", 5)) is not None
    assert len(ledger) == 1


def test_forget_ended_keeps_what_can_still_come_back() -> None:
    ledger = RetryLedger()
    kinds = {
        ("g", "b", 10): True,  # switch to waiter b, entry 10: still queued
        ("g", "c", 11): False,  # switch to waiter c, entry 11: left
        ("g", "a", 20): True,  # catch-up of holder a, epoch 20
        ("g", "b", 20): True,  # prefetch of b (queued) during the hold of epoch 20
        ("g", "c", 20): False,  # prefetch of c (left) during the hold of epoch 20
        ("g", "b", 15): False,  # prefetch of b during an earlier hold
        ("g", "e", 15): False,  # catch-up of an earlier holder
        ("h", "c", 11): True,  # another group: untouched
    }
    for key in kinds:
        ledger.put(key, _due_in(1))
    ledger.forget_ended("g", [("b", 10), ("d", 12)], hold=("a", 20))
    assert {k: ledger.get(k) is not None for k in kinds} == kinds
    ledger.forget_ended("g", [], hold=None)  # nobody waits and nobody holds
    assert len(ledger) == 1 and ledger.get(("h", "c", 11)) is not None
