"""The one backoff every retry loop uses: doubling, capped, jittered within [d/2, d]."""

from __future__ import annotations

import random

from timeslice.backoff import BACKOFF_INITIAL, BACKOFF_MAX, Backoff


def test_without_jitter_the_delays_double_up_to_the_cap() -> None:
    backoff = Backoff(0.1, 1.0, jitter=False)
    assert [backoff.next_delay() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_reset_starts_over_from_the_initial_delay() -> None:
    backoff = Backoff(0.05, 5.0, jitter=False)
    for _ in range(4):
        backoff.next_delay()
    backoff.reset()
    assert backoff.next_delay() == 0.05


def test_jitter_stays_in_the_upper_half_of_each_planned_delay() -> None:
    backoff = Backoff(0.1, 0.8, rng=random.Random(7))
    planned = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    for delay in planned:
        drawn = backoff.next_delay()
        assert delay / 2 <= drawn <= delay


def test_jitter_spreads_clients_that_failed_together() -> None:
    draws = {Backoff(rng=random.Random(seed)).next_delay() for seed in range(20)}
    assert len(draws) > 10


def test_the_same_seed_gives_the_same_delays() -> None:
    first = Backoff(rng=random.Random(3))
    second = Backoff(rng=random.Random(3))
    assert [first.next_delay() for _ in range(5)] == [second.next_delay() for _ in range(5)]


def test_defaults() -> None:
    backoff = Backoff(jitter=False)
    assert backoff.next_delay() == BACKOFF_INITIAL
    for _ in range(40):
        last = backoff.next_delay()
    assert last == BACKOFF_MAX
