"""The soak's wait bounds: a wait over its bound is a violation, with the faults it overlapped."""

from __future__ import annotations

from bench.soak import FaultEvent, FaultWaits, WaitBounds, wait_violations, waits_by_fault
from timeslice_tools.history import Attempt

T0 = 1000.0
KILL = FaultEvent("kill", "replica-1", 50.0, 51.0)


def _attempt(start_s: float, wait_s: float | None, job: str = "job-0") -> Attempt:
    granted = None if wait_s is None else T0 + start_s + wait_s
    return Attempt(job, "soak", T0 + start_s, granted)


def test_waits_within_their_bounds_pass() -> None:
    attempts = [_attempt(10.0, 9.0), _attempt(45.0, 19.0), _attempt(200.0, None)]
    assert wait_violations(attempts, [KILL], T0, WaitBounds(any_s=20, quiet_s=10)) == []


def test_a_long_wait_with_no_fault_overlapping_is_a_violation() -> None:
    found = wait_violations([_attempt(100.0, 11.0, "job-3")], [KILL], T0, WaitBounds(20, 10))
    assert found == [
        "wait_bound: job-3 waited 11.0 s from 100.0 s, with no fault overlapping (bound 10 s)"
    ]


def test_a_wait_over_the_outer_bound_is_a_violation_even_during_a_fault() -> None:
    # The 31 s waits a lost agent stream caused, after a replica kill.
    found = wait_violations([_attempt(49.0, 31.6)], [KILL], T0, WaitBounds(20, 10))
    assert found == [
        "wait_bound: job-0 waited 31.6 s from 49.0 s, during kill replica-1 50.0-51.0 (bound 20 s)"
    ]


def test_the_default_bounds_are_20_s_and_15_s_without_a_fault() -> None:
    quiet = [_attempt(100.0, 14.9), _attempt(200.0, 15.1, "job-1")]
    during = [_attempt(49.0, 19.9), _attempt(50.5, 20.1, "job-2")]
    found = wait_violations(quiet + during, [KILL], T0, WaitBounds())
    assert [v.split(" waited")[0] for v in found] == ["wait_bound: job-1", "wait_bound: job-2"]


def test_waits_are_split_by_the_kind_of_fault_they_overlapped() -> None:
    pause = FaultEvent("etcd", "etcd", 100.0, 101.0)
    attempts = [
        _attempt(10.0, 0.5),  # quiet
        _attempt(20.0, 1.5),  # quiet
        _attempt(49.0, 4.2),  # the kill
        _attempt(50.5, 3.0, "job-1"),  # the kill
        _attempt(99.0, 2.5),  # the pause
        _attempt(49.9, 51.0, "job-2"),  # both: counted under each
        _attempt(300.0, None),  # never granted: not a wait
    ]
    split = waits_by_fault(attempts, [KILL, pause], T0)
    assert set(split) == {"kill", "etcd", "none"}
    assert split["none"] == FaultWaits(waits=2, over_2s=0, p50_s=0.5, p99_s=1.5, max_s=1.5)
    assert (split["kill"].waits, split["kill"].over_2s, split["kill"].max_s) == (3, 3, 51.0)
    assert (split["etcd"].waits, split["etcd"].over_2s, split["etcd"].p50_s) == (2, 2, 2.5)
