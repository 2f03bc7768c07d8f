"""HoldTracker: duty cycle over a sliding window, held seconds and hold lengths."""

from __future__ import annotations

import pytest

from timeslice_orchestrator.holds import Duty, HoldTracker, duty_over


def test_duty_cycle_counts_the_held_part_of_the_window() -> None:
    t = HoldTracker(window=10, started=100)
    assert t.observe("g", 5, now=100) is None  # the first hold starts tracking
    assert t.duty_cycle("g", now=104) == 1.0
    assert t.observe("g", 0, now=104) == 4.0  # released: a 4 s hold
    assert t.duty_cycle("g", now=108) == pytest.approx(0.5)  # 4 of 8 s watched
    assert t.observe("g", 9, now=108) is None
    # Window [102, 112]: held 102-104 and 108-112 -> 6 of 10 s.
    assert t.duty_cycle("g", now=112) == pytest.approx(0.6)
    assert t.held_seconds("g", now=112) == pytest.approx(8.0)
    assert t.hold_age("g", now=112) == pytest.approx(4.0)


def test_a_new_epoch_ends_the_previous_hold() -> None:
    t = HoldTracker(window=60, started=0)
    t.observe("g", 5, now=0)
    assert t.observe("g", 5, now=1) is None  # same hold: nothing ends
    assert t.observe("g", 7, now=3) == 3.0  # handed over in one transaction
    assert t.held("g") and t.hold_age("g", now=4) == 1.0


def test_groups_idle_for_a_whole_window_are_forgotten() -> None:
    t = HoldTracker(window=10, started=0)
    assert t.observe("never", 0, now=0) is None
    assert t.groups() == []  # never held: not tracked
    t.observe("g", 1, now=0)
    t.observe("g", 0, now=2)
    t.observe("busy", 3, now=0)
    t.expire(now=11)
    assert sorted(t.groups()) == ["busy", "g"]  # g's hold ended 9 s ago: still in the window
    t.expire(now=13)
    assert t.groups() == ["busy"]  # held for ever: kept
    assert t.duty_cycle("g", now=13) == 0.0
    t.forget("busy")
    assert t.groups() == []


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HoldTracker(window=0)


def test_a_group_first_held_late_was_free_before() -> None:
    # Watched from 0 with g there; g free for 240 s, then held for 10 s: a 10 s share of the
    # 60 s window, not 100%.
    t = HoldTracker(window=60)
    t.begin(0, ["g"])
    t.observe("g", 7, now=240)
    assert t.duty_cycle("g", now=250) == pytest.approx(10 / 60)
    # Seen early: only the time watched counts.
    early = HoldTracker(window=60)
    early.begin(0, ["g"])
    early.observe("g", 7, now=20)
    assert early.duty("g", now=30) == Duty(pytest.approx(10 / 30), 30)  # type: ignore[arg-type]


def test_a_new_group_is_watched_from_when_it_appeared() -> None:
    """Watched for 10 min, a group appears and is held 18 of its 30 s: 60% over 30 s, not
    18 s of the 300 s window (6%), which it did not exist for."""
    t = HoldTracker(window=300)
    t.begin(0, ["old"])
    t.observe("new", 0, now=600)  # created free (an operator's group, a first waiter)
    for k in range(3):  # held 6 s of every 10 s
        t.observe("new", 10 + k, now=600 + 10 * k)
        t.observe("new", 0, now=606 + 10 * k)
    duty = t.duty("new", now=630)
    assert duty.ratio == pytest.approx(0.6) and duty.seconds == pytest.approx(30)
    # Created by its own grant (no free moment seen): watched from that grant.
    t.observe("born-held", 5, now=620)
    assert t.duty("born-held", now=630) == Duty(1.0, 10)
    # There at the start and first held late: watched since the start, at most the window.
    t.observe("old", 4, now=600)
    assert t.duty("old", now=630) == Duty(pytest.approx(30 / 300), 300)  # type: ignore[arg-type]


def test_a_group_idle_for_a_window_and_held_again_counts_the_idle_window() -> None:
    t = HoldTracker(window=60)
    t.begin(0, [])
    t.observe("g", 1, now=100)
    t.observe("g", 0, now=110)
    t.expire(now=200)
    assert t.groups() == []  # idle for the window: no longer tracked
    t.observe("g", 0, now=250)  # a change while free (a waiter came and went)
    t.observe("g", 2, now=300)
    assert t.duty("g", now=306) == Duty(pytest.approx(6 / 60), 60)  # type: ignore[arg-type]
    # Removed, then a group of that name created again: a new group.
    t.observe("g", 0, now=310)
    t.forget("g")
    t.observe("g", 3, now=400)
    assert t.duty("g", now=404) == Duty(1.0, 4)


def test_duty_over_is_the_held_share_of_the_watched_part_of_the_window() -> None:
    # Watched from 50; window [40, 100] -> [50, 100]: held 45-60 (10 s of it) and 90-now.
    d = duty_over([(45, 60)], open_since=90, watched_from=50, now=100, window=60)
    assert d == Duty(pytest.approx(20 / 50), 50)  # type: ignore[arg-type]
    assert duty_over([], None, watched_from=100, now=100, window=60) == Duty(0.0, 0.0)
    assert duty_over([], 100, watched_from=100, now=100, window=60) == Duty(1.0, 0.0)
    # Holds entirely before the watched span count for nothing (never negative).
    assert duty_over([(0, 10)], None, watched_from=20, now=30, window=60) == Duty(0.0, 10)
