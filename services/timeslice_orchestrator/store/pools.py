"""Placement pools in etcd: a pool's declaration and rules, its assignments, its audit trail.

Three keys per pool (``pools/<pool>/config``, ``.../assignments``, ``.../audit``; see
:mod:`.keys`), not mirrored: a pool is read from etcd when a placement or a pool read needs it
(a pool is tens of jobs; placements happen when jobs start, not per acquire).

Every write is one etcd transaction that compares the mod revisions of the three keys as they
were read (0 for a key that is not there yet) and writes the keys that changed. Two replicas
placing at once (the same job or two jobs) cannot both win with a plan made from the same
state: the loser's transaction fails, it reads again and places again from what the winner
wrote, so both answer the winner's assignment for a job that was placed (a running or already
placed job keeps its group). A replica killed before its transaction commits wrote nothing;
after, the assignment is in etcd for every replica to read: no assignment is ever lost or
half-written.

The audit trail keeps the last :data:`AUDIT_KEPT` entries per pool, oldest first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from timeslice.errors import NotFound, Unavailable
from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import Compare, CompareOp, CompareTarget, Put, Txn
from timeslice_orchestrator.store.records import (
    AuditEntryRecord,
    PoolAssignmentsRecord,
    PoolAuditRecord,
    PoolRecord,
)

__all__ = ["AUDIT_KEPT", "PoolChange", "PoolState", "PoolStore"]

AUDIT_KEPT = 200
"""Audit entries kept per pool (the oldest go first)."""
# Attempts of one write against concurrent writers before it gives up (Unavailable, retryable).
_ATTEMPTS = 20


@dataclass(slots=True)
class PoolState:
    """A pool as read from etcd, with the mod revisions a write compares (0: no such key)."""

    pool: str
    config: PoolRecord
    assignments: PoolAssignmentsRecord
    audit: PoolAuditRecord
    revisions: tuple[int, int, int] = (0, 0, 0)
    read_at: int = 0  # the store revision it was read at


@dataclass(slots=True)
class PoolChange:
    """What a write does: the records to store (None: unchanged) and entries to audit."""

    config: PoolRecord | None = None
    assignments: PoolAssignmentsRecord | None = None
    audit: list[AuditEntryRecord] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.config is None and self.assignments is None and not self.audit


class PoolStore(StoreBase):
    """Read and change placement pools (see the module docstring)."""

    async def read(self, pool: str) -> PoolState | None:
        """The pool, or None when it was never created."""
        revision, kvs = await self.etcd.get_prefix(self.keys.pool_root(pool))
        found = {kv.key: kv for kv in kvs}
        config = found.get(self.keys.pool_config(pool))
        if config is None:
            return None
        assignments = found.get(self.keys.pool_assignments(pool))
        audit = found.get(self.keys.pool_audit(pool))
        return PoolState(
            pool,
            PoolRecord.decode(config.value),
            PoolAssignmentsRecord.decode(assignments.value)
            if assignments
            else PoolAssignmentsRecord(),
            PoolAuditRecord.decode(audit.value) if audit else PoolAuditRecord(),
            (
                config.mod_revision,
                assignments.mod_revision if assignments else 0,
                audit.mod_revision if audit else 0,
            ),
            revision,
        )

    async def create(
        self,
        pool: str,
        groups: list[str],
        cap: float,
        who: str,
        claims: dict[str, str] | None = None,
    ) -> PoolState:
        """Declare ``pool`` with ``groups``, ``cap`` and the groups' ``claims`` (launcher
        handles, group -> claim), or replace those of an existing pool (its rules and
        assignments stay)."""
        claims = dict(claims or {})
        shown = "".join(f", claim {g}={c}" for g, c in claims.items())

        def change(state: PoolState | None) -> PoolChange:
            now = time.time()
            if state is None:
                config = PoolRecord(groups=list(groups), cap=cap, created_at=now, claims=claims)
            else:
                config = PoolRecord(
                    groups=list(groups),
                    cap=cap,
                    created_at=state.config.created_at,
                    pins=state.config.pins,
                    excluded=state.config.excluded,
                    drained=state.config.drained,
                    claims=claims,
                )
            entry = AuditEntryRecord(
                at=now,
                what="pool",
                reason=f"groups {','.join(groups)}, cap {cap:g}{shown}",
                replica=who,
            )
            return PoolChange(config=config, audit=[entry])

        return (await self.update(pool, change, create=True))[0]

    async def update(
        self,
        pool: str,
        change: Callable[[PoolState | None], PoolChange],
        *,
        create: bool = False,
        deadline: float = 10.0,
    ) -> tuple[PoolState, PoolChange]:
        """Apply ``change`` (a pure function of the pool as read) in one compared transaction,
        again from a fresh read while another writer got in first. Returns the pool as written
        and the change made (an empty change writes nothing).

        Raises:
            NotFound: no such pool (and not ``create``).
            Unavailable: other writers won every attempt (retryable).
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline
        for attempt in range(_ATTEMPTS):
            state = await self.read(pool)
            if state is None and not create:
                raise NotFound(f"no placement pool {pool!r} (timeslice pool create)")
            made = change(state)
            if state is None:
                if made.config is None:
                    raise NotFound(f"no placement pool {pool!r} (timeslice pool create)")
                state = PoolState(pool, made.config, PoolAssignmentsRecord(), PoolAuditRecord())
            if made.empty:
                return state, made
            written = await self._write(pool, state, made)
            if written is not None:
                return written, made
            if loop.time() > give_up:
                break
            await asyncio.sleep(min(0.2, 0.005 * (attempt + 1)))
        raise Unavailable(f"placement pool {pool!r} changed under every attempt; try again")

    async def _write(self, pool: str, state: PoolState, made: PoolChange) -> PoolState | None:
        keys = (
            self.keys.pool_config(pool),
            self.keys.pool_assignments(pool),
            self.keys.pool_audit(pool),
        )
        compares = [
            Compare(key, CompareTarget.MOD, CompareOp.EQUAL, revision)
            for key, revision in zip(keys, state.revisions, strict=True)
        ]
        config = made.config or state.config
        assignments = made.assignments or state.assignments
        audit = PoolAuditRecord([*state.audit.entries, *made.audit][-AUDIT_KEPT:])
        puts = []
        if made.config is not None:
            puts.append(Put(keys[0], config.encode()))
        if made.assignments is not None:
            puts.append(Put(keys[1], assignments.encode()))
        if made.audit:
            puts.append(Put(keys[2], audit.encode()))
        result = await self.etcd.txn(Txn(compares, puts))
        if not result.succeeded:
            return None
        rev = result.revision
        revisions = (
            rev if made.config is not None else state.revisions[0],
            rev if made.assignments is not None else state.revisions[1],
            rev if made.audit else state.revisions[2],
        )
        return PoolState(pool, config, assignments, audit, revisions, rev)

    async def pools(self) -> list[str]:
        """Every pool's name (keys only)."""
        _, kvs = await self.etcd.get_prefix(self.keys.pools())
        root = self.keys.pools()
        names = {kv.key[len(root) :].split(b"/", 1)[0].decode() for kv in kvs}
        return sorted(names)
