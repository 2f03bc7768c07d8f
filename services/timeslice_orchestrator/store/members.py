"""Which nodes a group spans: operator-pinned members, agent records, and residency reports.

A node belongs to a group when an operator pinned it (``groups/<g>/members``) or when its agent
record lists a worker of the group. Agent records live on an agent lease of their own, not on
the replica's: they outlive the stream that published them by up to the agent TTL, so an
agent that reconnects to another replica stays a member of its groups throughout.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from timeslice.errors import FailedPrecondition
from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import (
    Delete,
    Get,
    LeaseExpired,
    LeaseKeeper,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    Txn,
    absent,
    modified_at,
    present,
)
from timeslice_orchestrator.store.records import (
    AgentRecord,
    FenceRecord,
    GroupStats,
    HolderRecord,
    MembersRecord,
    ResidentRecord,
    Stored,
)

log = logging.getLogger(__name__)

# Read-modify-write attempts of one group's residency before giving up (a busy group).
_RESIDENCY_ATTEMPTS = 8
# Reads per transaction when looking nodes up (etcd's default limit is 128 operations).
_READS_PER_TXN = 100


class MemberStore(StoreBase):
    """Pinned members, agent records and what the agents say is on their devices."""

    async def set_members(self, group: str, nodes: list[str]) -> int:
        """Pin (or, with no nodes, unpin) the nodes a group always spans; creates the group.

        Returns the store revision after the change.
        """
        # Always a write (an empty list unpins), so the revision returned is this change's.
        change = Put(self.keys.members(group), MembersRecord(sorted(set(nodes))).encode())
        result = await self.etcd.txn(Txn([], [change, self._create_group(group)]))
        return result.revision

    async def known_nodes(self, nodes: list[str]) -> set[str]:
        """Those of ``nodes`` whose agent connected at least once (see :meth:`publish_agent`)."""
        known: set[str] = set()
        for start in range(0, len(nodes), _READS_PER_TXN):
            chunk = nodes[start : start + _READS_PER_TXN]
            result = await self.etcd.txn(Txn([], [Get(self.keys.known_node(n)) for n in chunk]))
            known.update(n for n, kvs in zip(chunk, result.reads, strict=True) if kvs)
        return known

    async def note_error(self, group: str, note: str) -> bool:
        """Set the group's ``last_error`` to ``note`` unless it already says so.

        Returns whether it was written (a concurrent change of the stats costs one more read).
        """
        key = self.keys.stats(group)
        for _ in range(_RESIDENCY_ATTEMPTS):
            current = await self.etcd.get(key)
            stats = GroupStats.decode(current.value) if current else GroupStats()
            if stats.last_error == note:
                return False
            stats.last_error = note
            revision = current.mod_revision if current else 0
            result = await self.etcd.txn(
                Txn(
                    [modified_at(key, revision), present(self.keys.meta(group))],
                    [Put(key, stats.encode())],
                    [Get(self.keys.meta(group))],
                )
            )
            if result.succeeded:
                return True
            if not result.reads[0]:
                return False  # the group is gone: nothing to explain
        raise StoreUnavailable(f"stats of {group} kept changing: last_error not updated")

    async def forget_residency(
        self, group: str, node: str, job: str, *, parked: bool = False
    ) -> bool:
        """Record that ``job``'s state is no longer on ``node``'s devices (an agent said so).

        ``parked``: it is parked on the node (the agent reports it off its devices); it is
        then listed as parked there. Without it, nothing of the job is left on the node (its
        workers there left): it is not listed as parked there either. Returns whether it wrote.
        """
        key = self.keys.resident(group)
        current = await self.etcd.get(key)
        if current is None:
            return False
        record = ResidentRecord.decode(current.value)
        on_device = job in record.nodes.get(node, [])
        listed = job in record.parked.get(node, [])
        if not on_device and listed == parked:
            return False
        if parked:
            record.park(node, job)
        else:
            record.forget(node, job)
        result = await self.etcd.txn(
            Txn([modified_at(key, current.mod_revision)], [Put(key, record.encode())])
        )
        return result.succeeded

    async def settle_parked(self, group: str, node: str, parked: Collection[str]) -> bool:
        """Take an agent's word for the jobs of ``group`` parked on ``node`` (its hello): those
        it reports off its devices, and no others (one it does not report, or reports on its
        devices, has nothing parked there). Returns whether it wrote."""
        key = self.keys.resident(group)
        for _ in range(_RESIDENCY_ATTEMPTS):
            current = await self.etcd.get(key)
            if current is None:
                return False  # never granted: the group parked nothing
            record = ResidentRecord.decode(current.value)
            want = [j for j in sorted(set(parked)) if j not in record.nodes.get(node, [])]
            if sorted(record.parked.get(node, [])) == want:
                return False
            record.parked.pop(node, None)
            if want:
                record.parked[node] = want
            result = await self.etcd.txn(
                Txn([modified_at(key, current.mod_revision)], [Put(key, record.encode())])
            )
            if result.succeeded:
                return True
        raise StoreUnavailable(f"residency of {group} kept changing: {node} not settled")

    async def settle_unknown_residency(
        self, group: str, node: str, on_device: list[str], *, runs_here: Collection[str] = ()
    ) -> bool:
        """Take an agent's word for ``node`` in ``group`` when the group does not know what the
        node holds (it was fenced, or its agent's lease ran out, while the group went on).

        Written even when nothing of the group is on the node's devices: the write itself
        makes the group's driver look again, since a holder granted meanwhile may need its
        state restored there. A node the group knows about keeps the driver's record (only
        :meth:`forget_residency` corrects that), but when the group's holder runs on the node
        (``runs_here``: the jobs the agent reports in the group) and is not on its devices,
        the record is written again as it is: the node was away when the hold began (a switch
        or a grant in place planned without it), and that write is what makes the driver
        restore the holder there. Returns whether it wrote.
        """
        key = self.keys.resident(group)
        current = await self.etcd.get(key)
        if current is None:
            return False  # never granted: nothing to settle
        record = ResidentRecord.decode(current.value)
        if node in record.nodes:
            if not await self._holder_missing(group, runs_here, record.nodes[node]):
                return False
        elif on_device:
            record.nodes[node] = list(on_device)
        result = await self.etcd.txn(
            Txn([modified_at(key, current.mod_revision)], [Put(key, record.encode())])
        )
        return result.succeeded

    async def _holder_missing(
        self, group: str, runs_here: Collection[str], resident: list[str]
    ) -> bool:
        """Whether ``group``'s holder runs on a node (``runs_here``) without its state there."""
        if all(job in resident for job in runs_here):
            return False  # the common hello: whoever holds, its state is there (no read)
        kv = await self.etcd.get(self.keys.holder(group))
        if kv is None:
            return False
        holder = HolderRecord.decode(kv.value).job
        return holder in runs_here and holder not in resident

    async def set_node_residency(
        self, group: str, node: str, jobs: list[str], note: str = ""
    ) -> bool:
        """Make ``jobs`` (least recently restored first) what ``node`` holds for ``group``.

        An empty list marks the node's residency unknown (nothing is counted on there). With
        ``note``, the group's ``last_error`` says it in the same transaction. Returns whether
        the residency changed.
        """
        key, stats_key = self.keys.resident(group), self.keys.stats(group)
        for _ in range(_RESIDENCY_ATTEMPTS):
            current = await self.etcd.get(key)
            if current is None and not jobs:
                return False
            record = ResidentRecord.decode(current.value) if current else ResidentRecord()
            if record.nodes.get(node, []) == jobs:
                return False
            record.nodes.pop(node, None)
            if jobs:
                record.nodes[node] = list(jobs)
            revision = current.mod_revision if current else 0
            compare = [modified_at(key, revision)]
            ops: list[Op] = [Put(key, record.encode())]
            if note:
                stats_kv = await self.etcd.get(stats_key)
                stats = GroupStats.decode(stats_kv.value) if stats_kv else GroupStats()
                stats.last_error = note
                compare.append(modified_at(stats_key, stats_kv.mod_revision if stats_kv else 0))
                ops.append(Put(stats_key, stats.encode()))
            result = await self.etcd.txn(Txn(compare, ops))
            if result.succeeded:
                return True
        raise StoreUnavailable(f"residency of {group} kept changing: {node} not updated")

    async def fence_node(self, node: str, fence: FenceRecord) -> int:
        """Fence ``node`` out: record why, drop its agent record, forget its residency.

        Returns the fence revision: every directive issued before it carries a lower epoch,
        and the agent refuses all of those once its next Welcome tells it the revision. The
        agent lease is revoked, so the replica holding its stream (if any) closes it; also
        when marking the residency fails (which is then raised): the node is fenced all the
        same, and its next hello reconciles every group of ``fence``.
        """
        agent = await self.etcd.get(self.keys.agent(node))
        result = await self.etcd.txn(
            Txn([], [Put(self.keys.fence(node), fence.encode()), Delete(self.keys.agent(node))])
        )
        note = f"node {node} fenced out: {fence.reason}"
        # A lease left alive would keep the node's stream open on the replica holding it,
        # which re-publishes the record on that lease at the agent's next worker change: a
        # rejoin with neither the reconcile nor the fence revision. Revoked after the marks,
        # not before, so that a hello it prompts is never overwritten by one.
        lease = agent.lease if agent is not None else 0
        try:
            for group in fence.groups:
                await self.set_node_residency(group, node, [], note)
        except BaseException:
            if lease:
                try:
                    await self.etcd.revoke_lease(lease)
                except StoreError as exc:  # what failed the marks is what propagates
                    log.warning("could not revoke the agent lease of fenced %s: %s", node, exc)
            raise
        if lease:
            await self.etcd.revoke_lease(lease)
        return result.revision

    async def fence_of(self, node: str) -> Stored[FenceRecord] | None:
        """The node's last fence, if it was ever fenced."""
        kv = await self.etcd.get(self.keys.fence(node))
        return Stored.of(kv, FenceRecord.decode(kv.value)) if kv is not None else None

    async def agent_lease(self, node: str, ttl: int) -> int:
        """The lease that keeps ``node``'s agent record: the existing one while it lives.

        Reusing it keeps the record continuous when the agent reconnects (to this replica or
        another) before it runs out; only a lapsed record gets a fresh lease of ``ttl``.
        """
        current = await self.etcd.get(self.keys.agent(node))
        if current is not None and current.lease:
            try:
                await self.etcd.keepalive_once(current.lease)
                return current.lease
            except LeaseExpired:
                pass
        return await self.etcd.grant_lease(ttl)

    def keep_agent_lease(self, lease: int, ttl: int) -> LeaseKeeper:
        """A keeper that refreshes the agent lease while the agent's stream is held here."""
        return LeaseKeeper(self.etcd, lease, ttl)

    async def publish_agent(
        self, record: AgentRecord, lease: int, *, fence_revision: int, after: int = 0
    ) -> int:
        """Write the agent's record (its workers) on the agent lease, unless the node was
        fenced since its hello read ``fence_revision`` (its fence key's revision; 0: never).

        A fence that lands between the hello's read and this write (another replica fenced
        the node meanwhile) would otherwise be missed: the node would rejoin its groups
        unreconciled, its agent told an older fence than the directives it must refuse.
        FailedPrecondition then: the stream ends and the agent's next hello sees the fence.

        ``after`` (a later write of one agent stream: the revision of its previous one) makes
        the write also wait for nothing else to have written the record since: a newer stream
        of the agent (on this replica or another) has published the whole worker set, which
        an older stream's late write must not replace. FailedPrecondition then too.

        The node is also remembered for good (``nodes/<node>``, on no lease): a node that is
        away can still be pinned, one that never existed cannot. Returns the write's revision.
        """
        node = record.node
        known = self.keys.known_node(node)
        compare = [modified_at(self.keys.fence(node), fence_revision)]
        if after:
            compare.append(modified_at(self.keys.agent(node), after))
        result = await self.etcd.txn(
            Txn(
                compare,
                [
                    Put(self.keys.agent(node), record.encode(), lease=lease),
                    Txn([absent(known)], [Put(known, b"{}")]),
                ],
                [],
            )
        )
        if not result.succeeded:
            raise FailedPrecondition(
                f"node {node} was fenced after its hello read fence revision {fence_revision}"
                if not after
                else f"node {node}'s record changed since this stream wrote it (revision "
                f"{after}): fenced, expired, or the agent connected again"
            )
        return result.revision
