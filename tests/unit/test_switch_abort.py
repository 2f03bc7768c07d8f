"""Who is faulted after a switch aborted (``switch_abort.py``), without a server: the mirror
and the store are stand-ins that hand out one view and record the writes."""

from __future__ import annotations

import time
from typing import cast

from tests.unit.views import view, waiter
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.retries import RetryLedger
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Authority, Fault, GroupStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import GroupStats, NodeStep, SwitchPhase, SwitchRecord
from timeslice_orchestrator.switch_abort import AbortRule, Culprit


class _Mirror:
    def __init__(self, group: GroupView) -> None:
        self.view = group
        self.revision = 1000

    def group(self, name: str) -> GroupView:
        return self.view

    async def wait_for_revision(self, revision: int, timeout: float) -> None:
        self.revision = max(self.revision, revision)


class _Store:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.faults: list[Fault] = []

    async def note_error(self, group: str, note: str) -> bool:
        self.notes.append(note)
        return True

    async def fault_waiter(
        self, group: str, auth: Authority, fault: Fault, stats: GroupStats
    ) -> int | None:
        self.faults.append(fault)
        return 2000


def _rule(group: GroupView) -> tuple[AbortRule, _Store, RetryLedger]:
    store, retries = _Store(), RetryLedger()
    mirror = cast(Mirror, _Mirror(group))
    config = DriverConfig(replica_id="r1", max_attempts=3, retry_backoff=0.5, max_backoff=2.0)
    rule = AbortRule(
        cast(GroupStore, store), mirror, Authority("r1", 7), Metrics(), config, retries,
        OwnWrites(mirror),
    )  # fmt: skip
    return rule, store, retries


def _switch(
    to_job: str, to_revision: int, attempt: int = 1, prefetch: bool = False, operation: str = ""
) -> SwitchRecord:
    return SwitchRecord(
        switch_id="sw",
        group="g",
        to_job=to_job,
        to_revision=to_revision,
        steps=[NodeStep(node="n1", evict="a", restore=to_job)],
        phase=SwitchPhase.ROLLBACK,
        driver="r1",
        started_at=1.0,
        attempt=attempt,
        prefetch=prefetch,
        operation=operation,
    )


async def test_an_aborted_prefetch_or_operation_is_not_retried_here() -> None:
    rule, store, retries = _rule(view([waiter("b", 11)]))
    culprits = [Culprit("a", "n1", "hook failed")]
    assert await rule.after_abort("g", _switch("b", 11, prefetch=True), culprits) is Next.IDLE
    assert await rule.after_abort("g", _switch("b", 11, operation="op1"), []) is Next.AGAIN
    assert store.faults == [] and len(retries) == 0


async def test_the_job_whose_state_could_not_leave_is_faulted_not_the_waiter() -> None:
    group = view([waiter("a", 10), waiter("b", 11)])
    rule, store, retries = _rule(group)
    culprits = [Culprit("a", "n1", "hook failed")]
    assert await rule.after_abort("g", _switch("b", 11), culprits) is Next.WAIT
    (fault,) = store.faults
    assert fault.waiter.job == "a"
    assert "a is faulted, not b" in fault.reason and "on n1: hook failed" in fault.reason
    retry = retries.get(("g", "b", 11))
    assert retry is not None and retry.attempts == 1
    assert 0 < retry.due - time.monotonic() <= 0.5
    assert store.notes == []  # the note went with the fault's statistics
    assert group.stats.last_error.startswith("b waits: the state of a could not be checkpointed")


async def test_a_culprit_that_does_not_wait_yet_is_named_in_last_error() -> None:
    rule, store, _ = _rule(view([waiter("b", 11)]))
    assert await rule.after_abort("g", _switch("b", 11), [Culprit("a", "n1", "x")]) is Next.WAIT
    assert store.faults == []
    (note,) = store.notes
    assert note.startswith("b waits: the state of a could not be checkpointed (a on n1: x)")


async def test_a_refused_checkpoint_is_retried_then_the_waiter_alone_is_faulted() -> None:
    group = view([waiter("b", 11), waiter("c", 12)])
    group.stats.last_error = "checkpoint refused: host memory"
    rule, store, retries = _rule(group)
    assert await rule.after_abort("g", _switch("b", 11, attempt=1), []) is Next.WAIT
    assert await rule.after_abort("g", _switch("b", 11, attempt=2), []) is Next.WAIT
    assert store.faults == []
    assert await rule.after_abort("g", _switch("b", 11, attempt=3), []) is Next.AGAIN
    (fault,) = store.faults
    assert fault.waiter.job == "b"
    assert fault.reason == "switch to b failed 3 times: checkpoint refused: host memory"
    assert len(retries) == 0
