"""Who may read which group, and how much of it (docs/security.md, "Reads").

The group reads (``ListGroups``, ``GetGroupStatus``, ``WatchGroup``, and their v1alpha1
twins) are scoped by the caller's identity, decided here once and applied by the handlers:

- **Everything** (:attr:`Reach.ALL`): an operator (certificate ``timeslice://operator`` or
  the operator token) and a plaintext caller. Plaintext (``--insecure``) has no identity: a
  plaintext client may claim any job, so scoping its reads by the job it claims would protect
  nothing. Tenant isolation needs mutual TLS, for reads as for acting.
- **Its own groups** (:attr:`Reach.JOB`): a job certificate. A group is the job's when the
  group records the job in any way (:func:`group_jobs`): it holds the group or waits in its
  queue, a switch moves it, it has a fault or an operator operation there, its state is
  resident on one of the group's nodes, one of its workers is registered for the group on an
  agent, or the group's usage ledger has it (it held the group before). The ledger makes the
  membership last from the first grant until the group is removed as idle, so a job's tooling
  keeps seeing its group between two holds. Another group answers NOT_FOUND with the message
  a group that does not exist gets: a job cannot tell the two apart.
  In a group of its own, every other job's id becomes :data:`OTHER_JOB` (the holder, queue
  entries, residents, the switch's jobs, faulted jobs), while what is no one's identity stays:
  the hold's epoch and start, queue positions, priorities and times, node names, counts.
  Free text that can name other jobs (``last_error``, other jobs' fault reasons) is left out,
  and so are other jobs' usage entries (their accounting). A grant's ``previous_job_id``
  (Acquire) is replaced the same way.
- **Nothing** (:attr:`Reach.NONE`): a node (agent) certificate, or one with no timeslice role.
  An agent's stream needs no group reads; PERMISSION_DENIED.

The marker is not a valid job id (ids start with a letter or digit), so it never names a real
job, and a group held by another job never looks free (as an empty holder would).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from timeslice.errors import NotFound, PermissionDenied
from timeslice_orchestrator.identity import Identity
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import AgentRecord
from timeslice_proto.timeslice.v1 import (
    FaultedJob,
    GroupStatus,
    GroupSummary,
)
from timeslice_proto.timeslice_orchestrator.v1alpha1 import GetGroupStatusResponse

__all__ = [
    "EVERYTHING",
    "OTHER_JOB",
    "Reach",
    "Viewer",
    "group_jobs",
    "hidden",
    "scoped_status",
    "scoped_summary",
    "scoped_v1alpha1",
    "viewer_of",
]

OTHER_JOB = "(other job)"
"""What a job reads in place of another job's id."""


class Reach(enum.Enum):
    """How much of the groups a caller may read."""

    ALL = "all"
    JOB = "job"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Viewer:
    """A caller of the group reads, as far as they are concerned."""

    reach: Reach
    job: str = ""
    """The job of a :attr:`Reach.JOB` viewer."""
    who: str = ""
    """The certificate, for messages."""

    def name(self, job: str) -> str:
        """``job`` as this viewer reads it: itself, or :data:`OTHER_JOB` for another job."""
        if self.reach is Reach.ALL or not job or job == self.job:
            return job
        return OTHER_JOB

    def check_reads(self, what: str) -> None:
        """Refuse a caller that reads no groups (a node's certificate)."""
        if self.reach is Reach.NONE:
            raise PermissionDenied(
                f"{what}: the client certificate {self.who} reads no groups (only jobs, their "
                "own groups, and operators do)"
            )

    def sees(self, view: GroupView, agents: Mapping[str, AgentRecord]) -> bool:
        """Whether this viewer may read ``view`` at all (it exists, and is its own)."""
        if not view.exists or self.reach is Reach.NONE:
            return False
        return self.reach is Reach.ALL or self.job in group_jobs(view, agents)


EVERYTHING = Viewer(Reach.ALL)
"""An operator's (or a plaintext caller's) view: every group, as it is."""


def viewer_of(who: Identity | None, *, operator: bool = False) -> Viewer:
    """The viewer a caller is: ``who`` its certificate's identity (None: plaintext),
    ``operator`` whether it proved to be an operator otherwise (the token)."""
    if who is None or operator or who.operator:
        return EVERYTHING
    if who.job:
        return Viewer(Reach.JOB, who.job, str(who))
    return Viewer(Reach.NONE, who=str(who))


def group_jobs(view: GroupView, agents: Mapping[str, AgentRecord]) -> set[str]:
    """Every job ``view`` records (the members whose group it is, for the reads)."""
    jobs: set[str] = {q.job for q in view.queue}
    if view.holder is not None:
        jobs.add(view.holder.record.job)
    if view.switch is not None:
        jobs.add(view.switch.record.to_job)
        jobs.update(view.switch.record.from_jobs)
    jobs.update(view.faults)
    jobs.update(o.record.job for o in view.operations.values())
    for resident in view.residency().nodes.values():
        jobs.update(resident)
    for agent in agents.values():
        jobs.update(agent.jobs_of(view.group))
    if view.usage is not None:
        jobs.update(view.usage.record.jobs)
    jobs.discard("")
    return jobs


def hidden(group: str, viewer: Viewer) -> NotFound:
    """The NOT_FOUND a job gets for a group that is not its own, or that does not exist: the
    same message for both."""
    return NotFound(f"group {group} does not exist or job {viewer.job} has no part in it")


def _names(viewer: Viewer, jobs: Iterable[str]) -> list[str]:
    return [viewer.name(j) for j in jobs]


def scoped_summary(viewer: Viewer, summary: GroupSummary) -> GroupSummary:
    """A listing's line as ``viewer`` reads it."""
    if viewer.reach is Reach.ALL:
        return summary
    return dataclasses.replace(summary, holder_job_id=viewer.name(summary.holder_job_id))


def scoped_status(viewer: Viewer, status: GroupStatus) -> GroupStatus:
    """A group's status as ``viewer`` reads it (a copy; ``status`` is left as it is)."""
    if viewer.reach is Reach.ALL:
        return status
    mine = viewer.job
    switch = status.switch
    if switch is not None:
        switch = dataclasses.replace(
            switch,
            from_job_id=",".join(_names(viewer, switch.from_job_id.split(",")))
            if switch.from_job_id
            else "",
            to_job_id=viewer.name(switch.to_job_id),
        )
    return dataclasses.replace(
        status,
        holder_job_id=viewer.name(status.holder_job_id),
        queue=[dataclasses.replace(q, job_id=viewer.name(q.job_id)) for q in status.queue],
        nodes=[
            dataclasses.replace(
                n,
                resident_job_id=viewer.name(n.resident_job_id),
                resident_jobs=_names(viewer, n.resident_jobs),
            )
            for n in status.nodes
        ],
        switch=switch,
        faulted=[
            f if f.job_id == mine else FaultedJob(job_id=OTHER_JOB, reason="")
            for f in status.faulted
        ],
        last_error="",
        usage=[u for u in status.usage if u.job_id == mine],
    )


def scoped_v1alpha1(viewer: Viewer, response: GetGroupStatusResponse) -> GetGroupStatusResponse:
    """A v1alpha1 GetGroupStatus answer as ``viewer`` reads it (a copy)."""
    if viewer.reach is Reach.ALL:
        return response
    group = response.group
    if group is not None:
        group = dataclasses.replace(
            group,
            locking_job=viewer.name(group.locking_job),
            active_job=viewer.name(group.active_job),
            loaded_job=viewer.name(group.loaded_job),
        )
    return dataclasses.replace(
        response,
        group=group,
        agent_job_states=[
            dataclasses.replace(s, job_id=viewer.name(s.job_id)) for s in response.agent_job_states
        ],
    )
