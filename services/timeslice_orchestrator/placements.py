"""The Placement service (timeslice.placement.v1): jobs ask for a role in a pool, not a group.

Thin handlers over :mod:`timeslice.placement` (the optimizer, pure) and
:class:`~.store.pools.PoolStore` (the pool's keys in etcd); docs/placement.md says what a
pool, an assignment and a restart point are.

``Place(pool, job, roles)``: for each role, the job's recorded group while the job *runs*
(holds or waits in a group of the pool: it is never moved then), else a placement made now
with every other assignment of the pool fixed where it is: a *new* role is placed; a role
already recorded is at its *restart point* (its job asks again while it holds and waits for
nothing in the pool: a new process or session of the job) and may move, once measured, when
the optimizer finds a better group. A role is placed by its measured profile when the usage
its group recorded since the role was placed there has at least :data:`MIN_HOLDS` holds, else
by the profile it declared, else by the optimizer's conservative default (provisional).

Who may call what: a job's certificate places only its own job and reads only its own
assignments; operators (certificate or token, :mod:`.authz`) place anyone, read everything and
alone may create pools and change their rules. Plaintext (``--insecure``) callers have no
identity and are treated as every other call treats them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpclib.server
from grpclib.const import Handler
from opentelemetry.trace import Tracer
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from timeslice import placement as opt
from timeslice.errors import (
    ErrorKind,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TimeSliceError,
)
from timeslice.ids import validate_group_id, validate_id, validate_job_id
from timeslice_orchestrator import identity, visibility
from timeslice_orchestrator.authz import Authorizer, peer_of
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.pool_plans import (
    DEFAULT_CAP,
    MAX_GROUPS,
    MAX_ROLES,
    RoleResult,
    claims_of,
    declared_profile,
    plan_place,
    rule_change,
)
from timeslice_orchestrator.rpc import Call, served
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.pools import PoolChange, PoolState, PoolStore
from timeslice_orchestrator.store.records import (
    AuditEntryRecord,
    DeclaredProfile,
    JobUsageRecord,
)
from timeslice_orchestrator.visibility import Reach
from timeslice_proto.timeslice.placement.v1 import (
    Assignment,
    AuditEntry,
    CreatePoolRequest,
    ExcludedPair,
    GetPoolRequest,
    GroupClaim,
    GroupDuty,
    Pin,
    PlacementBase,
    PlaceRequest,
    PlaceResponse,
    Pool,
    RolePlacement,
    RuleKind,
    UpdatePoolRequest,
)

__all__ = ["DutyBook", "PlacementService"]

log = logging.getLogger(__name__)

_SERVICE = "timeslice.placement.v1.Placement"
_OPERATOR_ONLY = frozenset({"CreatePool", "UpdatePool"})


# -- expected vs measured duty -----------------------------------------------------------------


class DutyBook(Collector):
    """``timeslice_placement_duty_ratio{pool,group,kind}``: each group's duty as the last
    placement this replica made or read expected it, and as the holds of its assigned jobs
    measure it (from the mirror's usage ledger, at scrape time)."""

    def __init__(self, mirror: Mirror) -> None:
        self._mirror = mirror
        self._pools: dict[str, PoolState] = {}

    def seen(self, state: PoolState) -> None:
        """The pool as last read or written by this replica."""
        self._pools[state.pool] = state

    def measured(self, state: PoolState, group: str) -> float:
        """The group's duty measured over the jobs assigned there: the sum of each one's held
        seconds over the time from its first hold to its last release (0: no usage yet)."""
        if not self._mirror.has_group(group):
            return 0.0
        view = self._mirror.group(group)
        ledger = view.usage.record.jobs if view.usage is not None else {}
        jobs = {
            job
            for job, slots in state.assignments.jobs.items()
            if any(a.group == group for a in slots.values())
        }
        total = 0.0
        for job in jobs:
            u = ledger.get(job)
            if u is not None and u.last_seen > u.first_seen:
                total += u.held_seconds / (u.last_seen - u.first_seen)
        return min(1.0, total)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "timeslice_placement_duty_ratio",
            "Duty of a pool's group: kind=expected as the last placement predicted it, "
            "kind=measured from the recorded holds of the jobs assigned there",
            labels=["pool", "group", "kind"],
        )
        for pool, state in sorted(self._pools.items()):
            for group in state.config.groups:
                expected = state.assignments.expected.get(group, 0.0)
                family.add_metric([pool, group, "expected"], expected)
                family.add_metric([pool, group, "measured"], self.measured(state, group))
        yield family


# -- the service -------------------------------------------------------------------------------


class PlacementService(PlacementBase):
    """The handlers; see the module docstring."""

    def __init__(
        self,
        store: PoolStore,
        mirror: Mirror,
        metrics: Metrics,
        tracer: Tracer,
        authz: Authorizer,
        replica: str,
        duty: DutyBook | None = None,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._metrics = metrics
        self._tracer = tracer
        self._authz = authz
        self._replica = replica
        self._duty = duty or DutyBook(mirror)

    def __mapping__(self) -> dict[str, Handler]:
        """Every handler gets the call's stream first: who the caller is decides the rest."""
        mapping = super().__mapping__()
        handlers: dict[str, Callable[[Any, bool], Awaitable[Any]]] = {
            "Place": self._place,
            "GetPool": self._get_pool,
            "CreatePool": self._create_pool,
            "UpdatePool": self._update_pool,
        }
        for method, handler in handlers.items():
            name = f"/{_SERVICE}/{method}"
            generated = mapping[name]
            mapping[name] = Handler(
                self._with_stream(method, handler),
                generated.cardinality,
                generated.request_type,
                generated.reply_type,
            )
        return mapping

    def _with_stream(
        self, method: str, handler: Callable[[Any, bool], Awaitable[Any]]
    ) -> Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]:
        async def handle(stream: grpclib.server.Stream[Any, Any]) -> None:
            operator = self._authz.is_operator(stream)
            if method in _OPERATOR_ONLY and not operator:
                self._metrics.rpc_errors.labels(kind=ErrorKind.PERMISSION_DENIED.value).inc()
                self._authz.refused(method, "no operator identity", peer_of(stream))
                raise PermissionDenied(
                    f"{method} needs an operator identity "
                    "(metadata authorization: Bearer <operator token>)"
                ).to_grpc()
            request = await stream.recv_message()
            assert request is not None
            await stream.send_message(await handler(request, operator))

        return handle

    # The generated entry points (grpclib calls the stream handlers above instead).
    async def place(self, message: PlaceRequest) -> PlaceResponse:
        return await self._place(message, False)

    async def get_pool(self, message: GetPoolRequest) -> Pool:
        return await self._get_pool(message, False)

    async def create_pool(self, message: CreatePoolRequest) -> Pool:
        raise PermissionDenied("CreatePool needs an operator identity").to_grpc()

    async def update_pool(self, message: UpdatePoolRequest) -> Pool:
        raise PermissionDenied("UpdatePool needs an operator identity").to_grpc()

    def _served(self, method: str, job: str = "") -> Any:
        def refused(exc: TimeSliceError) -> None:
            if exc.kind is ErrorKind.PERMISSION_DENIED:
                self._authz.refused(method, "acting for another job")

        return served(
            Call(_SERVICE, method, job=job), self._tracer, self._metrics, on_error=refused
        )

    async def _place(self, message: PlaceRequest, operator: bool) -> PlaceResponse:
        with self._served("Place", message.job_id):
            pool = validate_id(message.pool, "pool")
            job = validate_job_id(message.job_id)
            if not operator:
                identity.check_job(job, "Place")
            # A job's certificate reads no other job's id (docs/security.md, "Reads").
            hide = visibility.viewer_of(identity.current(), operator=operator).reach is Reach.JOB
            roles = [validate_id(r, "role") for r in message.roles]
            if not roles or len(roles) > MAX_ROLES or len(set(roles)) != len(roles):
                raise InvalidArgument(f"roles: 1 to {MAX_ROLES} distinct roles, got {roles}")
            declared: dict[str, DeclaredProfile] = {}
            for p in message.profiles:
                if p.role not in roles or p.role in declared:
                    raise InvalidArgument(f"profile of role {p.role!r}: not a role asked, or twice")
                declared[p.role] = declared_profile(p)
            now = time.time()

            def change(state: PoolState | None) -> PoolChange:
                assert state is not None  # update() refuses a missing pool first
                running = self._runs_in(job, state.config.groups)
                made, answers = plan_place(
                    state,
                    job,
                    roles,
                    declared,
                    usage=self._usage,
                    running=running,
                    replica=self._replica,
                    now=now,
                )
                results[:] = answers
                return made

            results: list[RoleResult] = []
            state, _ = await self._store.update(pool, change)
            self._duty.seen(state)
            for r in results:
                if r.decision is not opt.Decision.KEPT:
                    log.info("pool %s: %s/%s: %s", pool, job, r.role, r.reason)
            return PlaceResponse(
                pool=pool,
                job_id=job,
                roles=[
                    RolePlacement(
                        role=r.role,
                        group_id=r.group,
                        nodes=self._nodes(r.group),
                        decision=r.decision.value,
                        reason=r.own_reason if hide else r.reason,
                        source=r.source.value,
                        provisional=r.provisional,
                        expected_busy=r.expected_busy,
                        predicted_duty=r.predicted_duty,
                        previous_group_id=r.previous_group,
                        claim=r.claim,
                    )
                    for r in results
                ],
                placed=all(r.group for r in results),
            )

    def _usage(self, group: str, job: str) -> JobUsageRecord | None:
        if not self._mirror.has_group(group):
            return None
        view = self._mirror.group(group)
        return view.usage.record.jobs.get(job) if view.usage is not None else None

    def _runs_in(self, job: str, groups: Sequence[str]) -> bool:
        """Whether ``job`` holds or waits in one of ``groups`` (it is not at a restart point)."""
        for group in groups:
            if not self._mirror.has_group(group):
                continue
            view = self._mirror.group(group)
            if view.holder is not None and view.holder.record.job == job:
                return True
            if view.queued(job) is not None:
                return True
        return False

    def _nodes(self, group: str) -> list[str]:
        if not group or not self._mirror.has_group(group):
            return []
        return list(self._mirror.group(group).static_members)

    async def _get_pool(self, message: GetPoolRequest, operator: bool) -> Pool:
        with self._served("GetPool"):
            pool = validate_id(message.pool, "pool")
            viewer = visibility.viewer_of(identity.current(), operator=operator)
            viewer.check_reads("GetPool")
            state = await self._store.read(pool)
            if state is None:
                raise NotFound(f"no placement pool {pool!r} (timeslice pool create)")
            self._duty.seen(state)
            only = "" if viewer.reach is Reach.ALL else viewer.job
            return self._pool(state, only)

    async def _create_pool(self, message: CreatePoolRequest, operator: bool) -> Pool:
        with self._served("CreatePool"):
            pool = validate_id(message.pool, "pool")
            groups = [validate_group_id(g) for g in message.groups]
            if not groups or len(groups) > MAX_GROUPS or len(set(groups)) != len(groups):
                raise InvalidArgument(f"groups: 1 to {MAX_GROUPS} distinct groups, got {groups}")
            cap = message.cap or DEFAULT_CAP
            if not 0 < cap <= 1:
                raise InvalidArgument(f"cap must be within (0, 1], got {cap!r}")
            claims = claims_of(groups, message.claims)
            state = await self._store.create(pool, groups, cap, self._replica, claims)
            self._duty.seen(state)
            log.info("pool %s: groups %s, cap %g, claims %s", pool, ",".join(groups), cap, claims)
            return self._pool(state)

    async def _update_pool(self, message: UpdatePoolRequest, operator: bool) -> Pool:
        with self._served("UpdatePool"):
            pool = validate_id(message.pool, "pool")

            def change(state: PoolState | None) -> PoolChange:
                assert state is not None
                config = rule_change(state.config, message)
                what = RuleKind(message.kind).name.lower()
                kind_claim = message.kind is RuleKind.CLAIM
                entry = AuditEntryRecord(
                    at=time.time(),
                    what=f"rule:{what}",
                    job=message.job_id,
                    role=message.role,
                    group=message.group_id,
                    reason=f"operator {what}"
                    + (f" with {message.other_job_id}" if message.other_job_id else "")
                    + (f" {message.claim}" if kind_claim else ""),
                    replica=self._replica,
                    own_reason=f"operator {what}",
                )
                return PoolChange(config=config, audit=[entry])

            state, _ = await self._store.update(pool, change)
            self._duty.seen(state)
            return self._pool(state)

    def _pool(self, state: PoolState, only: str = "") -> Pool:
        """The pool on the wire; ``only``: a job's view (its own assignments and audit)."""
        config = state.config

        def mine(job: str) -> bool:
            return not only or job == only

        def hidden(job: str) -> str:
            return job if not only or job == only else visibility.OTHER_JOB

        assigned = state.assignments.jobs
        return Pool(
            pool=state.pool,
            groups=list(config.groups),
            cap=config.cap,
            pins=[Pin(p.job, p.role, p.group) for p in config.pins if mine(p.job)],
            excluded=[
                ExcludedPair(hidden(a), hidden(b))
                for a, b in config.excluded
                if not only or only in (a, b)
            ],
            drained=list(config.drained),
            assignments=[
                Assignment(
                    job_id=job,
                    role=role,
                    group_id=a.group,
                    decision=a.decision,
                    reason=a.own_reason if only else a.reason,
                    source=a.profile.source,
                    provisional=a.profile.source != opt.Source.MEASURED.value,
                    expected_busy=a.profile.busy,
                    placed_at=a.placed_at,
                    replica=a.replica,
                )
                for job, slots in sorted(assigned.items())
                if mine(job)
                for role, a in sorted(slots.items())
            ],
            audit=[
                AuditEntry(
                    at=e.at,
                    what=e.what,
                    job_id=e.job,
                    role=e.role,
                    group_id=e.group,
                    previous_group_id=e.previous_group,
                    reason=e.own_reason if only and e.own_reason else e.reason,
                    replica=e.replica,
                )
                for e in state.audit.entries
                if not only or e.job == only
            ],
            duty=[
                GroupDuty(
                    group_id=g,
                    expected=state.assignments.expected.get(g, 0.0),
                    measured=self._duty.measured(state, g),
                    drained=g in config.drained,
                    jobs=[
                        f"{job}/{role}"
                        for job, slots in sorted(assigned.items())
                        for role, a in sorted(slots.items())
                        if a.group == g and mine(job)
                    ],
                )
                for g in config.groups
            ],
            claims=[GroupClaim(g, config.claims[g]) for g in config.groups if g in config.claims],
        )
