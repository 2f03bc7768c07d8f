"""What one ``Place`` decides, as pure functions: profiles from declarations and the usage
ledger, the optimizer's inputs from a pool's record, the plan, and an operator's rule change.

No I/O: :mod:`.placements` (the handlers) reads the pool and the mirror, calls these, and
writes the result in one transaction. docs/placement.md says what a pool, an assignment and a
restart point are.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from timeslice import placement as opt
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_id, validate_job_id
from timeslice_orchestrator import visibility
from timeslice_orchestrator.store.pools import PoolChange, PoolState
from timeslice_orchestrator.store.records import (
    AuditEntryRecord,
    DeclaredProfile,
    JobUsageRecord,
    PoolAssignmentsRecord,
    PoolPin,
    PoolRecord,
    RoleAssignment,
)
from timeslice_proto.timeslice.placement.v1 import (
    GroupClaim,
    Mode,
    RoleProfile,
    RuleKind,
    UpdatePoolRequest,
)

MIN_HOLDS = 3
"""Holds since a role was placed before its measured profile replaces the declared one."""
MEASURED_CV = 0.3
"""Phase-to-phase variation of a measured profile whose ledger has too few samples since the
placement (or was written by a replica from before the ledger's phase sums): a middle value
(the default profile assumes 0.5)."""
DEFAULT_CAP = 0.9
MAX_ROLES = 16
MAX_GROUPS = 256
_MODES = {Mode.UNSPECIFIED: opt.Mode.SYNC, Mode.SYNC: opt.Mode.SYNC}
_MODES[Mode.ASYNC] = opt.Mode.ASYNC
MAX_CLAIM = 253
# A Kubernetes object name (a ResourceClaim's): a DNS-1123 subdomain, lower-case letters,
# digits, '-' and '.', starting and ending with a letter or digit (RFC 1123 labels between dots).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


# -- launcher handles -----------------------------------------------------------------------------


def validate_claim(name: str, where: str) -> str:
    """``name`` if it can name a Kubernetes ResourceClaim (a DNS-1123 subdomain, each label
    at most 63 characters), else InvalidArgument naming ``where`` (the field)."""
    if (
        not name
        or len(name) > MAX_CLAIM
        or not _DNS_SUBDOMAIN.fullmatch(name)
        or any(len(label) > 63 for label in name.split("."))
    ):
        raise InvalidArgument(
            f"{where}: {name!r} is not a Kubernetes object name (a DNS-1123 subdomain: "
            f"lower-case letters, digits, '-' and '.', at most {MAX_CLAIM} characters, "
            "starting and ending with a letter or digit)"
        )
    return name


def claims_of(groups: Sequence[str], claims: Sequence[GroupClaim]) -> dict[str, str]:
    """CreatePool's claims as group -> claim: each names a group of the pool, at most once,
    and no two groups share a claim (one ResourceClaim per group: two groups on one claim
    would put both groups' processes on the same devices)."""
    found: dict[str, str] = {}
    for i, c in enumerate(claims):
        where = f"claims[{i}]"
        if c.group_id not in groups:
            raise InvalidArgument(
                f"{where}.group_id: {c.group_id!r} is not a group of the pool ({', '.join(groups)})"
            )
        if c.group_id in found:
            raise InvalidArgument(f"{where}.group_id: group {c.group_id!r} has two claims")
        found[c.group_id] = validate_claim(c.claim, f"{where}.claim")
    _distinct(found)
    return found


def _distinct(claims: Mapping[str, str]) -> None:
    seen: dict[str, str] = {}
    for group, claim in claims.items():
        if claim in seen:
            raise InvalidArgument(
                f"claim: {claim!r} is already the claim of group {seen[claim]!r}, "
                f"not also of {group!r} (one ResourceClaim per group)"
            )
        seen[claim] = group


# -- profiles ---------------------------------------------------------------------------------


def declared_profile(profile: RoleProfile) -> DeclaredProfile:
    """A declared profile from the wire, checked by the optimizer's own rules."""
    checked = opt.JobProfile(
        busy=profile.busy,
        period_seconds=profile.period_seconds,
        cv=profile.cv,
        mode=_MODES.get(profile.mode, opt.Mode.SYNC),
        switch_seconds=profile.switch_seconds,
        source=opt.Source.DECLARED,
    )
    return _record_of(checked)


def _record_of(p: opt.JobProfile) -> DeclaredProfile:
    return DeclaredProfile(
        busy=p.busy,
        period_seconds=p.period_seconds,
        cv=p.cv,
        mode=p.mode.value,
        switch_seconds=p.switch_seconds,
        source=p.source.value,
    )


def _profile_of(d: DeclaredProfile) -> opt.JobProfile:
    return opt.JobProfile(
        busy=d.busy,
        period_seconds=d.period_seconds,
        cv=d.cv,
        mode=opt.Mode(d.mode),
        switch_seconds=d.switch_seconds,
        source=opt.Source(d.source),
    )


def measured_profile(assigned: RoleAssignment, usage: JobUsageRecord | None) -> opt.JobProfile:
    """The role's profile from the holds its group recorded for the job since the role was
    placed there (at least :data:`MIN_HOLDS`), else the profile it was placed by.

    The ledger keeps totals: ``n`` holds of ``held`` seconds in all, the job's first grant of
    the group at ``first_seen`` and its last release at ``last_seen``. When every hold of the
    job there came after the placement, first grant to last release is ``n - 1`` periods and
    one hold. Otherwise, from the placement (or the last release before it, if later) to the
    last release is ``n`` periods, the first of them including the job's start-up (which makes
    a restarted job look a little less busy than it is).
    """
    kept = _profile_of(assigned.profile)
    if usage is None:
        return kept
    holds = usage.holds - assigned.holds
    held = usage.held_seconds - assigned.held_seconds
    if holds < MIN_HOLDS or held <= 0:
        return kept
    if assigned.holds == 0 and usage.first_seen >= assigned.placed_at:
        # The job's first holds of the group are all since the placement: from the first
        # grant to the last release is n - 1 periods and one hold, start-up left out.
        hold = held / holds
        period = (usage.last_seen - usage.first_seen - hold) / (holds - 1)
    else:
        period = (usage.last_seen - max(assigned.last_seen, assigned.placed_at)) / holds
    if period <= 0:
        return kept
    return opt.JobProfile(
        busy=min(1.0, held / holds / period),
        period_seconds=period,
        cv=measured_variation(assigned, usage),
        mode=kept.mode,
        switch_seconds=kept.switch_seconds,
        source=opt.Source.MEASURED,
    )


def measured_variation(assigned: RoleAssignment, usage: JobUsageRecord) -> float:
    """The phase-to-phase variation since the placement, as the optimizer's
    :meth:`~timeslice.placement.JobProfile.measured` reads it from single holds: the larger
    coefficient of variation of the hold lengths and of the grant-to-grant intervals. With
    fewer than :data:`MIN_HOLDS` samples of both (or a ledger from before the phase sums),
    :data:`MEASURED_CV`."""
    found = [
        cv
        for cv in (
            _variation(
                usage.holds - assigned.holds,
                usage.held_seconds - assigned.held_seconds,
                usage.held_sq - assigned.held_sq,
            ),
            _variation(
                usage.periods - assigned.periods,
                usage.period_sum - assigned.period_sum,
                usage.period_sq - assigned.period_sq,
            ),
        )
        if cv is not None
    ]
    return min(5.0, max(found)) if found else MEASURED_CV


def _variation(n: int, total: float, squares: float) -> float | None:
    """Coefficient of variation of ``n`` samples from their sum and sum of squares."""
    if n < MIN_HOLDS or total <= 0 or squares <= 0:
        return None
    mean = total / n
    return math.sqrt(max(0.0, squares / n - mean * mean)) / mean


# -- the plan of one Place ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoleResult:
    """One requested role's answer."""

    role: str
    group: str
    decision: opt.Decision
    reason: str
    own_reason: str  # the reason with other jobs' ids replaced (what the job's certificate reads)
    source: opt.Source
    expected_busy: float
    predicted_duty: float
    previous_group: str = ""
    claim: str = ""  # the group's launcher handle (the pool's claims), "" when none

    @property
    def provisional(self) -> bool:
        return self.source is not opt.Source.MEASURED


def own_reason(reason: opt.Reason, job: str) -> str:
    """``reason`` as ``job`` may read it: every other job's id replaced by
    :data:`~.visibility.OTHER_JOB`, as in the group reads (docs/security.md, "Reads")."""

    def named(other: str) -> str:
        return other if other == job else visibility.OTHER_JOB

    scrubbed = dataclasses.replace(
        reason,
        partners=tuple(opt.Slot(named(p.job), p.role) for p in reason.partners),
        blocked=tuple(
            dataclasses.replace(b, other_job=named(b.other_job)) if b.other_job else b
            for b in reason.blocked
        ),
    )
    return str(scrubbed)


def constraints_of(config: PoolRecord) -> opt.Constraints:
    return opt.Constraints(
        cap=config.cap,
        pins={opt.Slot(p.job, p.role): p.group for p in config.pins},
        excluded=frozenset(frozenset(pair) for pair in config.excluded),
        drained=frozenset(config.drained),
    )


def plan_place(
    state: PoolState,
    job: str,
    roles: Sequence[str],
    declared: Mapping[str, DeclaredProfile],
    *,
    usage: Callable[[str, str], JobUsageRecord | None],
    running: bool,
    replica: str,
    now: float,
) -> tuple[PoolChange, list[RoleResult]]:
    """The change a Place makes to ``state`` and each role's answer (pure but for ``usage``,
    the job's usage of a group as the mirror has it; ``running``: the job holds or waits in a
    group of the pool)."""
    config = state.config
    groups = list(config.groups)
    recorded = state.assignments.jobs
    demands: list[opt.Demand] = []
    asked = set(roles)
    for other, slots in sorted(recorded.items()):
        for role, a in sorted(slots.items()):
            if a.group not in groups:
                continue  # the pool no longer has that group: placed again when it asks
            if other == job and role in asked:
                continue
            profile = measured_profile(a, usage(a.group, other))
            demands.append(
                opt.Demand(opt.Slot(other, role), profile, opt.JobState.RUNNING, a.group)
            )
    for role in roles:
        slot = opt.Slot(job, role)
        mine = recorded.get(job, {}).get(role)
        if mine is not None and mine.group in groups:
            profile = measured_profile(mine, usage(mine.group, job))
            if role in declared and profile.source is not opt.Source.MEASURED:
                profile = _profile_of(declared[role])  # a newer declaration wins until measured
            job_state = opt.JobState.RUNNING if running else opt.JobState.AT_RESTART_POINT
            demands.append(opt.Demand(slot, profile, job_state, mine.group))
        else:
            profile = _profile_of(declared[role]) if role in declared else opt.DEFAULT_PROFILE
            demands.append(opt.Demand(slot, profile, opt.JobState.NEW))
    plan = opt.place(groups, demands, constraints_of(config))
    duty = {g.group: g.duty for g in plan.groups}
    profiles = {d.slot: d.profile for d in demands}
    results: list[RoleResult] = []
    jobs = {j: dict(s) for j, s in recorded.items()}
    audit: list[AuditEntryRecord] = []
    for assignment in plan.assignments:
        slot = assignment.slot
        if slot.job != job or slot.role not in asked:
            continue
        reason = assignment.reason
        profile = profiles[slot]
        group = assignment.group or ""
        previous = recorded.get(job, {}).get(slot.role)
        results.append(
            RoleResult(
                role=slot.role,
                group=group,
                decision=reason.decision,
                reason=str(reason),
                own_reason=own_reason(reason, job),
                source=profile.source,
                expected_busy=profile.busy,
                predicted_duty=duty.get(group, 0.0),
                previous_group=reason.previous_group or (previous.group if previous else ""),
                claim=config.claims.get(group, "") if group else "",
            )
        )
        if not group or reason.decision is opt.Decision.KEPT:
            continue  # unplaced (nothing recorded), or running: its record stays as it is
        seen = usage(group, job) or JobUsageRecord()
        jobs.setdefault(job, {})[slot.role] = RoleAssignment(
            group=group,
            decision=reason.decision.value,
            reason=str(reason),
            own_reason=own_reason(reason, job),
            profile=_record_of(profile),
            placed_at=now,
            replica=replica,
            predicted_duty=duty.get(group, 0.0),
            held_seconds=seen.held_seconds,
            holds=seen.holds,
            last_seen=seen.last_seen,
            held_sq=seen.held_sq,
            periods=seen.periods,
            period_sum=seen.period_sum,
            period_sq=seen.period_sq,
        )
        audit.append(
            AuditEntryRecord(
                at=now,
                what=reason.decision.value,
                job=job,
                role=slot.role,
                group=group,
                previous_group=previous.group if previous else "",
                reason=str(reason),
                own_reason=own_reason(reason, job),
                replica=replica,
            )
        )
    if not audit:
        return PoolChange(), results
    expected = {g: duty.get(g, 0.0) for g in groups if g in duty}
    return PoolChange(assignments=PoolAssignmentsRecord(jobs, expected), audit=audit), results


def rule_change(config: PoolRecord, request: UpdatePoolRequest) -> PoolRecord:
    """``config`` with the operator's rule applied (InvalidArgument for a malformed one)."""
    kind = request.kind
    pins = list(config.pins)
    excluded = [list(pair) for pair in config.excluded]
    drained = list(config.drained)
    claims = dict(config.claims)
    if kind in (RuleKind.PIN, RuleKind.UNPIN):
        job = validate_job_id(request.job_id)
        role = validate_id(request.role or "main", "role")
        pins = [p for p in pins if (p.job, p.role) != (job, role)]
        if kind is RuleKind.PIN:
            pins.append(PoolPin(job, role, _pool_group(config, request.group_id)))
    elif kind in (RuleKind.EXCLUDE, RuleKind.INCLUDE):
        pair = sorted((validate_job_id(request.job_id), validate_job_id(request.other_job_id)))
        if pair[0] == pair[1]:
            raise InvalidArgument("an excluded pair names two different jobs")
        excluded = [p for p in excluded if p != pair]
        if kind is RuleKind.EXCLUDE:
            excluded.append(pair)
    elif kind in (RuleKind.DRAIN, RuleKind.UNDRAIN):
        group = _pool_group(config, request.group_id)
        drained = [g for g in drained if g != group]
        if kind is RuleKind.DRAIN:
            drained.append(group)
    elif kind in (RuleKind.CLAIM, RuleKind.UNCLAIM):
        group = _pool_group(config, request.group_id)
        claims.pop(group, None)
        if kind is RuleKind.CLAIM:
            claims[group] = validate_claim(request.claim, "claim")
            _distinct(claims)
    else:
        raise InvalidArgument(f"unknown rule kind {int(kind)}")
    return PoolRecord(
        groups=config.groups,
        cap=config.cap,
        created_at=config.created_at,
        pins=pins,
        excluded=sorted(excluded),
        drained=sorted(drained),
        claims={g: claims[g] for g in config.groups if g in claims},
    )


def _pool_group(config: PoolRecord, group: str) -> str:
    validate_group_id(group)
    if group not in config.groups:
        raise InvalidArgument(f"group {group!r} is not in the pool ({', '.join(config.groups)})")
    return group
