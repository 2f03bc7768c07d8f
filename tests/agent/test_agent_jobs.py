"""The per-job state machine: legal moves, illegal moves fault (never raise), wire form."""

from __future__ import annotations

import pytest

from timeslice_agent.jobs import Job, JobState, Residency, can_transition
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState


def test_checkpoint_then_restore_cycle() -> None:
    job = Job("j1", "g1")
    assert (job.state, job.residency) == (JobState.IDLE, Residency.DEVICE)
    assert job.transition(JobState.TRANSITIONING)
    assert job.settle_saved(123, (10, 11))
    assert (job.state, job.residency, job.saved_bytes, job.saved_pids) == (
        JobState.SAVED,
        Residency.HOST,
        123,
        (10, 11),
    )
    assert job.transition(JobState.TRANSITIONING)
    assert job.settle_on_device(JobState.RUNNING)
    assert (job.state, job.residency, job.saved_bytes, job.saved_pids) == (
        JobState.RUNNING,
        Residency.DEVICE,
        0,
        (),
    )


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (JobState.IDLE, JobState.SAVED),
        (JobState.IDLE, JobState.RUNNING),
        (JobState.SAVED, JobState.RUNNING),
        (JobState.RUNNING, JobState.SAVED),
        (JobState.TRANSITIONING, JobState.TRANSITIONING),
        (JobState.SAVED, JobState.IDLE),
    ],
)
def test_illegal_transition_faults_with_reason(src: JobState, dst: JobState) -> None:
    assert not can_transition(src, dst)
    job = Job("j1", "g1", state=src)
    assert job.transition(dst) is False
    assert job.state is JobState.FAULTED
    assert f"illegal transition {src.value} -> {dst.value}" in job.reason


@pytest.mark.parametrize("src", list(JobState))
def test_fault_is_always_legal(src: JobState) -> None:
    job = Job("j1", "g1", state=src)
    job.fault("disk on fire")
    assert job.state is JobState.FAULTED
    assert job.reason == "disk on fire"


def test_fault_reason_kept_while_transitioning_and_cleared_on_success() -> None:
    job = Job("j1", "g1")
    job.fault("hook failed")
    assert job.transition(JobState.TRANSITIONING)
    assert job.reason == "hook failed"
    assert job.settle_saved(5, ())
    assert job.reason == ""


def test_report_uses_wire_enum() -> None:
    job = Job("j1", "g1", state=JobState.SAVED, saved_bytes=7, reason="")
    report = job.report()
    assert report.job_id == "j1" and report.group_id == "g1"
    assert report.state == ProtoJobState.SAVED
    assert report.saved_bytes == 7
    assert {s.to_proto() for s in JobState} == {
        ProtoJobState.IDLE,
        ProtoJobState.RUNNING,
        ProtoJobState.TRANSITIONING,
        ProtoJobState.SAVED,
        ProtoJobState.FAULTED,
    }
