"""Plain value types the SDK hands to its callers (kept free of wire types)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from timeslice_proto.timeslice.v1 import AcquireEvent, AcquireState


class AcquireStage(enum.Enum):
    """Where an :meth:`~timeslice.AsyncTimeSliceClient.acquire` call stands.

    The one name for this, in the SDK and the orchestrator alike; on the wire it travels as the
    protobuf ``AcquireState``, and :meth:`to_wire` / :meth:`from_wire` are the only mapping.
    """

    QUEUED = "queued"
    """Waiting in the group's queue; ``queue_position`` 0 means next to run."""
    SWITCHING = "switching"
    """A context switch towards this job is in progress."""
    GRANTED = "granted"
    """The job holds the group."""

    def to_wire(self) -> AcquireState:
        """This stage as an Acquire event carries it."""
        return _TO_WIRE[self]

    @classmethod
    def from_wire(cls, state: AcquireState | int) -> AcquireStage | None:
        """The stage an Acquire event reports; None for one this version does not know."""
        return _FROM_WIRE.get(state)


_TO_WIRE = {
    AcquireStage.QUEUED: AcquireState.QUEUED,
    AcquireStage.SWITCHING: AcquireState.SWITCHING,
    AcquireStage.GRANTED: AcquireState.GRANTED,
}
_FROM_WIRE: dict[int, AcquireStage] = {int(wire): stage for stage, wire in _TO_WIRE.items()}


@dataclass(frozen=True, slots=True)
class AcquireProgress:
    """One progress report of a pending acquire, passed to ``on_progress``."""

    state: AcquireStage
    queue_position: int


@dataclass(frozen=True, slots=True)
class Grant:
    """Proof that a job holds a group, returned by ``acquire``.

    ``epoch`` is the group's fencing token for this hold (the etcd revision of the grant);
    ``restored`` says whether the job's device state had to be brought back for it, and
    ``previous_job_id`` / ``switch_seconds`` describe the context switch when one happened.
    ``ticket`` is the job's place in line (the create revision of its queue entry): under
    FIFO, grants serve tickets in increasing order. ``warning`` is set when the grant is likely
    not what the job meant: the group is not known (no node serves it and no operator
    created it, e.g. a mistyped name; docs/groups.md); "" when all is well.
    """

    group_id: str
    job_id: str
    epoch: int
    waited_seconds: float
    restored: bool
    previous_job_id: str | None
    switch_seconds: float
    ticket: int = 0
    warning: str = ""

    @classmethod
    def from_event(cls, group_id: str, job_id: str, event: AcquireEvent) -> Grant:
        """Build a grant from the GRANTED event of an Acquire stream."""
        return cls(
            group_id=group_id,
            job_id=job_id,
            epoch=int(event.epoch),
            waited_seconds=float(event.waited_seconds),
            restored=bool(event.restored),
            # proto3 strings have no null: an empty previous job means no switch happened.
            previous_job_id=event.previous_job_id or None,
            switch_seconds=float(event.switch_seconds),
            ticket=int(event.ticket),
            warning=event.warning,
        )
