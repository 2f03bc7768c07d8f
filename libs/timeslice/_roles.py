"""Where a job's roles in placement pools run: asked once, kept for the client's life.

A job may name a role in a pool instead of a group (``on_accelerators(pool=..., role=...)``,
docs/placement.md). The first use asks the orchestrator (``Placement.Place``), which places
the role or answers its recorded group; the answer is kept for the client's life, so every
acquire and yield of the role goes to the same group. A new client (a new process of the
job) asks again: that is the job's restart point, where a re-placement may move it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from timeslice._core import ClientCore
from timeslice._scope import AcceleratorScope, ScopeOwner
from timeslice.errors import InvalidArgument, ResourceExhausted
from timeslice.ids import validate_id
from timeslice.placement import JobProfile, Mode
from timeslice.runner import ClientRunner
from timeslice_proto.timeslice.placement.v1 import Mode as WireMode
from timeslice_proto.timeslice.placement.v1 import (
    PlacementStub,
    PlaceRequest,
    PlaceResponse,
    RoleProfile,
)
from timeslice_proto.timeslice.v1 import TimeSliceStub

log = logging.getLogger("timeslice")

RoleKey = tuple[str, str]
"""(pool, role)."""

DEFAULT_ROLE = "main"


def role_key(group_id: str | None, pool: str | None, role: str | None) -> RoleKey:
    """The (pool, role) a call names, validated; a group and a pool together are refused."""
    if group_id is not None:
        raise InvalidArgument("name either a group_id or a pool and a role, not both")
    if pool is None:
        raise InvalidArgument("a role is asked for in a pool: pass pool=...")
    role_id = DEFAULT_ROLE if role is None else role
    return validate_id(pool, "pool"), validate_id(role_id, "role")


def wire_profile(role: str, profile: JobProfile) -> RoleProfile:
    """A declared profile as ``Placement.Place`` takes it."""
    return RoleProfile(
        role=role,
        busy=profile.busy,
        period_seconds=profile.period_seconds,
        cv=profile.cv,
        mode=WireMode.ASYNC if profile.mode is Mode.ASYNC else WireMode.SYNC,
        switch_seconds=profile.switch_seconds,
    )


class Roles:
    """The groups of one client's roles, and the profiles the job declared for them."""

    def __init__(
        self, job_id: str, runner: ClientRunner, core: ClientCore, call_timeout: float
    ) -> None:
        self._job_id = job_id
        self._runner = runner
        self._core = core
        self._call_timeout = call_timeout
        self._groups: dict[RoleKey, str] = {}
        self._profiles: dict[RoleKey, JobProfile] = {}
        self._lock: asyncio.Lock | None = None  # made on the client's loop, at first use

    def declare(self, key: RoleKey, profile: JobProfile | None) -> None:
        """Use ``profile`` for the role until its holds are measured (None: keep what is)."""
        if profile is not None:
            self._profiles[key] = profile

    def scope(
        self,
        owner: ScopeOwner,
        key: RoleKey,
        profile: JobProfile | None,
        timeout: float | None,
        priority: int,
    ) -> AcceleratorScope:
        """A scope of the role (``on_accelerators(pool=..., role=...)``): it resolves the
        group at its first entry."""
        self.declare(key, profile)
        pool, role = key
        return AcceleratorScope(
            self._runner, "", timeout, priority, owner=owner, pool=pool, role=role, resolver=self
        )

    async def resolve(self, key: RoleKey) -> str:
        """The role's group: kept, or asked for once (concurrent first uses ask once)."""
        known = self._groups.get(key)
        if known is not None:
            return known
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            known = self._groups.get(key)
            if known is not None:
                return known
            answer = await self.place(key[0], [key[1]], self._profiles)
            placed = answer.roles[0]
            if not placed.group_id:
                raise ResourceExhausted(
                    f"pool {key[0]}: no group can take {self._job_id}/{key[1]}: {placed.reason}"
                )
            log.info(
                "job %s role %s in pool %s: group %s (%s)",
                self._job_id,
                key[1],
                key[0],
                placed.group_id,
                placed.reason,
            )
            return placed.group_id

    async def group_for(self, pool: str, role: str = DEFAULT_ROLE) -> str:
        """The role's group, from any loop (a scope's entry: :class:`~._scope.RoleResolver`)."""
        return await self._runner.run(self.resolve(role_key(None, pool, role)))

    def group_for_blocking(self, pool: str, role: str = DEFAULT_ROLE) -> str:
        """The role's group from blocking code (the client's loop runs in another thread)."""
        key = role_key(None, pool, role)
        known = self._groups.get(key)
        if known is not None:
            return known
        return self._runner.run_blocking(
            self.resolve(key),
            wait=self._call_timeout + 1.0,
            what=f"group_for({key[0]}, {key[1]})",
        )

    async def place(
        self,
        pool: str,
        roles: Sequence[str],
        profiles: Mapping[RoleKey, JobProfile] | None = None,
    ) -> PlaceResponse:
        """``Placement.Place`` for this job; the groups it answers are kept (the later answer
        wins). ``profiles``: declared profiles by (pool, role)."""
        pool_id = validate_id(pool, "pool")
        names = [validate_id(r, "role") for r in roles]
        declared = [
            wire_profile(role, p)
            for (where, role), p in sorted((profiles or {}).items())
            if where == pool_id and role in names
        ]
        request = PlaceRequest(pool=pool_id, job_id=self._job_id, roles=names, profiles=declared)

        async def call(stub: TimeSliceStub, timeout: float) -> PlaceResponse:
            return await PlacementStub(stub.channel).place(request, timeout=timeout)

        answer = await self._core.unary(f"Place({pool_id})", call)
        for placed in answer.roles:
            if placed.group_id:  # what this client's scopes of the role use from now on
                self._groups[(pool_id, placed.role)] = placed.group_id
        return answer
