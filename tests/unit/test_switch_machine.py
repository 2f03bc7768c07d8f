"""The switch's phases as a transition table (``switch_machine.py``)."""

from __future__ import annotations

import pytest

from timeslice_orchestrator.directives import NodeResult
from timeslice_orchestrator.store.records import SwitchPhase
from timeslice_orchestrator.switch_machine import SwitchFailed, can_move

CHECKPOINT, RESTORE, ROLLBACK = SwitchPhase.CHECKPOINT, SwitchPhase.RESTORE, SwitchPhase.ROLLBACK


def test_a_checkpoint_goes_on_to_restore_or_rolls_back() -> None:
    assert can_move(CHECKPOINT, RESTORE)
    assert can_move(CHECKPOINT, ROLLBACK)
    assert not can_move(CHECKPOINT, CHECKPOINT)
    assert not can_move(CHECKPOINT, None)  # a switch never ends before its checkpoint


@pytest.mark.parametrize("phase", [RESTORE, ROLLBACK])
def test_restore_and_rollback_only_end(phase: SwitchPhase) -> None:
    assert can_move(phase, None)
    assert not any(can_move(phase, other) for other in SwitchPhase)


def test_a_failed_phase_names_every_node_that_failed() -> None:
    failures = [NodeResult("n1", False, "boom", 0, 0.1), NodeResult("n2", False, "oom", 0, 0.2)]
    error = SwitchFailed(RESTORE, failures)
    assert str(error) == "restore failed on 2 node(s): n1: boom; n2: oom"
    assert error.phase is RESTORE and error.failures == failures
