"""HoldTracker: duty cycle over a sliding window, held seconds and hold lengths."""

from __future__ import annotations

import pytest

from timeslice_orchestrator.holds import HoldTracker


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
    # Watched from 0; the group free for 240 s, then held for 10 s: a 10 s share of the
    # 60 s window, not 100%.
    t = HoldTracker(window=60, started=0)
    t.observe("g", 7, now=240)
    assert t.duty_cycle("g", now=250) == pytest.approx(10 / 60)
    # Seen early: only the time watched counts.
    early = HoldTracker(window=60, started=0)
    early.observe("g", 7, now=20)
    assert early.duty_cycle("g", now=30) == pytest.approx(10 / 30)
