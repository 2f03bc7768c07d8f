"""The SDK's plain value types (timeslice._types) and their one mapping to the wire."""

from __future__ import annotations

from timeslice._types import AcquireStage, Grant
from timeslice_proto.timeslice.v1 import AcquireEvent, AcquireState


def test_every_stage_goes_to_the_wire_and_back() -> None:
    assert [s.to_wire() for s in AcquireStage] == [
        AcquireState.QUEUED,
        AcquireState.SWITCHING,
        AcquireState.GRANTED,
    ]
    for stage in AcquireStage:
        assert AcquireStage.from_wire(stage.to_wire()) is stage
        assert AcquireStage.from_wire(int(stage.to_wire())) is stage


def test_a_wire_state_this_version_does_not_know_is_none() -> None:
    known = {int(s.to_wire()) for s in AcquireStage}
    unknown = max(known) + 1
    assert AcquireStage.from_wire(unknown) is None
    assert AcquireStage.from_wire(AcquireState.UNSPECIFIED) is None


def test_a_grant_is_read_from_its_event() -> None:
    event = AcquireEvent(
        state=AcquireState.GRANTED,
        epoch=41,
        waited_seconds=1.5,
        restored=True,
        previous_job_id="job-b",
        switch_seconds=0.25,
        ticket=7,
        warning="group g is not known",
    )
    grant = Grant.from_event("g", "job-a", event)
    assert grant == Grant(
        group_id="g",
        job_id="job-a",
        epoch=41,
        waited_seconds=1.5,
        restored=True,
        previous_job_id="job-b",
        switch_seconds=0.25,
        ticket=7,
        warning="group g is not known",
    )


def test_an_empty_previous_job_means_no_switch() -> None:
    # proto3 strings have no null: "" on the wire is no previous job, not a job named "".
    grant = Grant.from_event("g", "job-a", AcquireEvent(state=AcquireState.GRANTED, epoch=3))
    assert grant.previous_job_id is None
    assert (grant.restored, grant.ticket, grant.warning) == (False, 0, "")
