"""Client sessions: one etcd lease each, named after it, with a key that describes the client.

Everything a session owns (its queue entries, its holds, its fault records) is attached to
its lease, so it all goes when the session expires or closes: that is how a dead client's
place in line and grant are freed without anyone watching for it.
"""

from __future__ import annotations

import time

from timeslice.errors import NotFound, SessionExpired
from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import LeaseExpired
from timeslice_orchestrator.store.records import SessionRecord, Stored


def session_id_of(lease_id: int) -> str:
    """The session ID of a lease: its ID as 16 hex digits."""
    return f"{lease_id:016x}"


def lease_of(session_id: str) -> int:
    """The lease of a session ID; NotFound when it cannot name one."""
    try:
        value = int(session_id, 16)
    except ValueError:
        value = 0
    if len(session_id) != 16 or value <= 0:
        raise NotFound(f"session {session_id!r} does not exist")
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
