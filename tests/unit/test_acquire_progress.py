"""What an Acquire reports at each state of its group: LockService._progress on real records.

The entry under test is job ``c``'s, created at revision 30 by session ``s-c``.
"""

from __future__ import annotations

from typing import cast

import pytest

from tests.unit.views import holder, stored, switch_to, view, waiter
from timeslice import AcquireStage
from timeslice.errors import Cancelled, GroupFaulted, SessionExpired
from timeslice_orchestrator.locks import LockService, Progress
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.policy import Policy
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import QueuedJob, SessionRecord, Stored
from timeslice_proto.timeslice.v1 import AcquireState

SESSION, JOB, ENTRY = "s-c", "c", 30


class Sessions:
    """The one part of the mirror that _progress reads besides the view: live sessions."""

    def __init__(self, *alive: str) -> None:
        self.alive = set(alive)

    def session(self, session_id: str) -> Stored[SessionRecord] | None:
        if session_id not in self.alive:
            return None
        return stored(SessionRecord(job=JOB, host="h", pid=1, opened_at=0.0), 3)


def progress(
    group: GroupView, policy: Policy = Policy.FIFO, *, session_alive: bool = True
) -> Progress:
    sessions = Sessions(SESSION) if session_alive else Sessions()
    # _progress is pure given the view: it never touches the store.
    locks = LockService(cast(GroupStore, None), cast(Mirror, sessions), Metrics(), 10, policy)
    return locks._progress(group, SESSION, JOB, ENTRY)


def line() -> list[QueuedJob]:
    return [waiter("a", 10, priority=1), waiter("b", 20, priority=5), waiter(JOB, ENTRY, 3)]


def test_queued_reports_the_place_in_the_order_the_policy_serves() -> None:
    group = view(line(), holding=holder("x", 5))
    assert progress(group) == Progress(AcquireStage.QUEUED, 2)
    assert progress(group, Policy.PRIORITY) == Progress(AcquireStage.QUEUED, 1)  # b, c, a
    assert progress(group, Policy.FAIR) == Progress(AcquireStage.QUEUED, 2)  # all 0 s: FIFO


def test_the_head_is_queued_at_position_zero() -> None:
    group = view([waiter(JOB, ENTRY)])
    assert progress(group) == Progress(AcquireStage.QUEUED, 0)


def test_a_switch_towards_the_job_reports_switching() -> None:
    group = view(line(), switch=switch_to(JOB, ENTRY, 40))
    assert progress(group) == Progress(AcquireStage.SWITCHING, 0)


def test_a_switch_towards_another_job_leaves_it_queued() -> None:
    group = view(line(), switch=switch_to("a", 10, 40))
    assert progress(group) == Progress(AcquireStage.QUEUED, 2)


def test_granted_when_the_holder_is_this_job_and_session_written_after_the_entry() -> None:
    # The grant transaction removes the queue entry: GRANTED must not need it.
    group = view([waiter("a", 10)], holding=holder(JOB, 50, session=SESSION))
    assert progress(group) == Progress(
        AcquireStage.GRANTED,
        epoch=50,
        waited_seconds=0.5,
        restored=True,
        previous_job="x",
        switch_seconds=0.25,
    )


def test_a_hold_by_another_session_of_the_same_job_is_not_this_grant() -> None:
    group = view(line(), holding=holder(JOB, 50, session="s-other"))
    assert progress(group).stage is AcquireStage.QUEUED


def test_a_hold_older_than_the_entry_is_not_this_grant() -> None:
    # The same session still holding from before it queued again (a re-acquire).
    group = view(line(), holding=holder(JOB, 25, session=SESSION))
    assert progress(group) == Progress(AcquireStage.QUEUED, 2)


def test_a_fault_after_the_entry_fails_the_acquire_with_its_reason() -> None:
    # Faulting removes the entry too: the fault, not a cancellation, is the answer.
    group = view([waiter("a", 10)], faults={JOB: ("restore failed on n1", 45)})
    with pytest.raises(GroupFaulted, match="restore failed on n1"):
        progress(group)


def test_a_fault_from_before_the_entry_is_ignored() -> None:
    group = view(line(), faults={JOB: ("an old failure", 12)})
    assert progress(group) == Progress(AcquireStage.QUEUED, 2)


def test_the_entry_gone_with_the_session_alive_is_a_cancellation() -> None:
    with pytest.raises(Cancelled, match="queue entry of c in g was removed"):
        progress(view([waiter("a", 10)]))


def test_an_entry_replaced_by_a_newer_one_is_a_cancellation() -> None:
    # Another Acquire of the same job queued afresh: this one's entry is gone.
    with pytest.raises(Cancelled):
        progress(view([waiter("a", 10), waiter(JOB, 60)]))


def test_the_entry_gone_with_the_session_is_an_expiry() -> None:
    with pytest.raises(SessionExpired, match="expired while waiting for g"):
        progress(view([waiter("a", 10)]), session_alive=False)


def test_a_live_entry_does_not_need_a_live_session_in_the_mirror() -> None:
    # The session is only consulted once the entry is gone (to tell why).
    assert progress(view(line()), session_alive=False) == Progress(AcquireStage.QUEUED, 2)


@pytest.mark.parametrize(
    ("stage", "wire"),
    [
        (AcquireStage.QUEUED, AcquireState.QUEUED),
        (AcquireStage.SWITCHING, AcquireState.SWITCHING),
        (AcquireStage.GRANTED, AcquireState.GRANTED),
    ],
)
def test_each_stage_has_one_wire_state_and_back(stage: AcquireStage, wire: AcquireState) -> None:
    assert stage.to_wire() == wire
    assert AcquireStage.from_wire(wire) is stage
    assert AcquireStage.from_wire(int(wire)) is stage


def test_an_unknown_wire_state_has_no_stage() -> None:
    assert AcquireStage.from_wire(AcquireState.UNSPECIFIED) is None
    assert AcquireStage.from_wire(99) is None
