"""Quotas of one deployment: how much of the store any client may make the replicas keep.

Every limit is an option (``--max-groups`` or ``TIMESLICE_ORCHESTRATOR_MAX_GROUPS``, ...) and
every refusal is typed: RESOURCE_EXHAUSTED (:class:`~timeslice.errors.ResourceExhausted`)
with the limit in its message, and nothing written.

The counts come from this replica's mirror of etcd, kept by :class:`~timeslice_orchestrator.
store.owners.OwnerIndex` as keys come and go, so a check is a dictionary lookup however large
the store is. They are as fresh as the mirror: replicas creating at the same moment can
overshoot a limit by the calls in flight, never by more, and the next call sees the total.
A limit is there to bound what a client can pile up, not to be a transactional counter
(one would be a key every Acquire and OpenSession contends on).

A group counts against the job whose Acquire created it (``--max-groups-per-job``), so that
one job cannot take every group slot of ``--max-groups`` from the others. The job is recorded
in the group's ``meta`` key when the group is created (in etcd: every replica counts it, and
it survives restarts), and the count falls when the idle clean-up removes the group. With
mutual TLS that job is the caller's certificate's (a job certificate acts as its job only;
an operator acting as a job spends that job's quota); in plaintext it is the job the session
was opened for, a claim. Groups an operator creates by pinning members count only in
``--max-groups``: they are configuration, never idle, and an operator may act as any job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeslice.errors import ResourceExhausted
from timeslice.ids import MAX_ID_LENGTH, validate_group_id, validate_job_id, validate_node
from timeslice.wire import DEFAULT_MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from timeslice_orchestrator.store.follower import Mirror


@dataclass(frozen=True, slots=True)
class Limits:
    max_groups: int = 10_000
    # Groups one job's Acquires created that still exist (until the idle clean-up removes
    # them): one job may not take every group slot from the others. A job waits for or holds
    # at most max_entries_per_session groups per session; this leaves room for groups it
    # renamed or left behind within the idle TTL. Operators' groups (SetGroupMembers) count
    # in max_groups only.
    max_groups_per_job: int = 256
    max_sessions: int = 10_000
    max_sessions_per_job: int = 256
    # Queue entries and holds of one session over all groups (a free group is granted at
    # once, without an entry: holds count too, or one session could take every group).
    max_entries_per_session: int = 64
    max_id_length: int = MAX_ID_LENGTH
    max_members: int = 256
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Seconds a group stays idle before the clean-up removes it; 0 keeps groups forever.
    idle_group_ttl: float = 3600.0
    # Groups one clean-up pass may remove (the rest wait for the next pass).
    cleanup_batch: int = 500
    # Admission per client (admission.py: a certificate's identity, or a plaintext
    # connection): tokens a second (0: no admission control), the bucket's size, calls that
    # may wait for tokens, and for how long at most.
    # A call pays 1 to 10 tokens by method, 10 more when refused for the client's fault: a
    # job doing a handful of calls per step uses a few tokens a second.
    client_rate: float = 500.0
    client_burst: int = 1000
    client_max_waiting: int = 64
    client_max_wait: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "max_groups",
            "max_groups_per_job",
            "max_sessions",
            "max_sessions_per_job",
            "max_entries_per_session",
            "max_members",
            "max_message_bytes",
            "cleanup_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 1 <= self.max_id_length <= MAX_ID_LENGTH:
            raise ValueError(f"max_id_length must be between 1 and {MAX_ID_LENGTH}")
        if self.idle_group_ttl < 0:
            raise ValueError("idle_group_ttl must not be negative")
        for name in ("client_rate", "client_max_waiting", "client_max_wait"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.client_burst < 1:
            raise ValueError("client_burst must be at least 1")


class Quotas:
    """The checks each RPC makes before it writes anything."""

    def __init__(self, limits: Limits, mirror: Mirror) -> None:
        self.limits = limits
        self._mirror = mirror

    def _id(self, value: str, what: str) -> None:
        # Past 253 characters an id is malformed (INVALID_ARGUMENT, from timeslice.ids);
        # below that, past this deployment's limit, it is over quota.
        if len(value) > self.limits.max_id_length and len(value) <= MAX_ID_LENGTH:
            raise ResourceExhausted(
                f"{what} is {len(value)} characters long; this deployment's limit is "
                f"{self.limits.max_id_length} (--max-id-length)"
            )

    def open_session(self, job: str) -> None:
        validate_job_id(job)
        self._id(job, "job_id")
        lim = self.limits
        if self._mirror.session_count() >= lim.max_sessions:
            raise ResourceExhausted(
                f"{lim.max_sessions} sessions are open; the limit is {lim.max_sessions} "
                "(--max-sessions)"
            )
        if self._mirror.sessions_of(job) >= lim.max_sessions_per_job:
            raise ResourceExhausted(
                f"job {job} has {lim.max_sessions_per_job} sessions open; the limit is "
                f"{lim.max_sessions_per_job} per job (--max-sessions-per-job)"
            )

    def acquire(self, session_id: str, job: str, group: str) -> None:
        validate_job_id(job)
        validate_group_id(group)
        self._id(job, "job_id")
        self._id(group, "group_id")
        self._new_group(group, job)
        lim = self.limits
        if self._mirror.entries_of(session_id) >= lim.max_entries_per_session:
            view = self._mirror.group(group)
            holder = view.holder
            mine = (holder is not None and holder.record.session == session_id) or any(
                q.entry.record.session == session_id for q in view.queue
            )
            if not mine:  # a retry re-attaches to what it has: no new entry
                raise ResourceExhausted(
                    f"session {session_id} waits for or holds {lim.max_entries_per_session} "
                    f"groups; the limit is {lim.max_entries_per_session} per session "
                    "(--max-entries-per-session)"
                )

    def set_members(self, group: str, nodes: list[str]) -> None:
        validate_group_id(group)
        self._id(group, "group_id")
        if len(nodes) > self.limits.max_members:
            raise ResourceExhausted(
                f"{len(nodes)} nodes pinned; the limit is {self.limits.max_members} per group "
                "(--max-members)"
            )
        for node in nodes:
            validate_node(node)
            self._id(node, "node")
        self._new_group(group)

    def _new_group(self, group: str, job: str | None = None) -> None:
        """Refuse creating ``group`` past the deployment's limit, or past ``job``'s (the job
        whose Acquire would create it; None: an operator's SetGroupMembers, not counted)."""
        lim = self.limits
        if self._mirror.has_group(group):
            return
        if job is not None and self._mirror.groups_of(job) >= lim.max_groups_per_job:
            raise ResourceExhausted(
                f"job {job} created {self._mirror.groups_of(job)} groups that still exist; "
                f"the limit is {lim.max_groups_per_job} per job (--max-groups-per-job; idle "
                "groups are removed after --idle-group-ttl)"
            )
        if self._mirror.group_count() >= lim.max_groups:
            raise ResourceExhausted(
                f"{self._mirror.group_count()} groups exist; the limit is {lim.max_groups} "
                "(--max-groups; idle groups are removed after --idle-group-ttl)"
            )
