"""Client sessions: one etcd lease each, named after it, with a key that describes the client.

Everything a session owns (its queue entries, its holds, its fault records) is attached to
its lease, so it all goes when the session expires or closes: that is how a dead client's
place in line and grant are freed without anyone watching for it.
"""

from __future__ import annotations

import re
import time

from timeslice.errors import InvalidArgument, SessionExpired
from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import LeaseExpired
from timeslice_orchestrator.store.records import SessionRecord, Stored


def session_id_of(lease_id: int) -> str:
    """The session ID of a lease: its ID as 16 hex digits."""
    return f"{lease_id:016x}"


# The one spelling of a session ID: exactly what session_id_of writes. int(x, 16) alone
# would also take "+00000000000000f", "0x0000000000000f", "000000000000_00f" or upper case,
# several names for one lease.
_SESSION_ID = re.compile(r"[0-9a-f]{16}")
# etcd lease IDs are positive int64s.
_MAX_LEASE = 2**63 - 1


def lease_of(session_id: str) -> int:
    """The lease of a session ID; InvalidArgument when it is not one (not canonical, 0, or
    beyond etcd's int64 lease IDs)."""
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(
            f"session_id {session_id[:40]!r} is not a session ID (16 lower-case hex digits)"
        )
    value = int(session_id, 16)
    if not 0 < value <= _MAX_LEASE:
        raise InvalidArgument(f"session_id {session_id!r} is out of range")
    return value


class SessionStore(StoreBase):
    """Open, read, refresh and close client sessions."""

    async def open_session(
        self, job: str, ttl: int, host: str, pid: int, *, secret_hash: str = ""
    ) -> str:
        """Grant a lease of ``ttl`` seconds and describe the client under it.

        ``secret_hash`` is what the session's calls are checked against (see ``authz``).
        """
        lease = await self.etcd.grant_lease(ttl)
        sid = session_id_of(lease)
        record = SessionRecord(
            job=job, host=host, pid=pid, opened_at=time.time(), secret_hash=secret_hash
        )
        await self.etcd.put(self.keys.session(sid), record.encode(), lease=lease)
        return sid

    async def session(self, session_id: str) -> Stored[SessionRecord]:
        """The session's record; SessionExpired when it is gone."""
        lease_of(session_id)
        kv = await self.etcd.get(self.keys.session(session_id))
        if kv is None:
            raise SessionExpired(f"session {session_id} has expired or was closed")
        return Stored.of(kv, SessionRecord.decode(kv.value))

    async def keepalive(self, session_id: str) -> int:
        """Refresh the session's lease; returns the TTL granted."""
        try:
            return await self.etcd.keepalive_once(lease_of(session_id))
        except LeaseExpired as exc:
            raise SessionExpired(f"session {session_id} has expired") from exc

    async def close_session(self, session_id: str) -> None:
        """Revoke the lease: the session's entries, holds and fault records go with it."""
        await self.etcd.revoke_lease(lease_of(session_id))
