"""The group store's session transactions (store/sessions.py) against a real etcd.

Each test drives one transaction the way the orchestrator does and then reads etcd directly:
what it wrote, on which lease, and what a compare that should fail left untouched.
"""

from __future__ import annotations

import pytest

from tests.integration.groupstore import (
    enqueue,
    open_session,
    sid,
    snapshot,
)
from timeslice.errors import (
    InvalidArgument,
    SessionExpired,
)
from timeslice_orchestrator.store.groups import (
    GroupStore,
    lease_of,
)

# -- sessions ---------------------------------------------------------------------------------


async def test_a_session_is_a_lease_with_a_record_on_it(store: GroupStore) -> None:
    session_id = await store.open_session("job-a", 30, "host-1", 42)
    session = await store.session(session_id)
    assert session.lease == lease_of(session_id)
    assert (session.record.job, session.record.host, session.record.pid) == ("job-a", "host-1", 42)
    assert 0 < await store.keepalive(session_id) <= 30
    assert await store.etcd.lease_ttl(session.lease) > 0


async def test_a_closed_session_is_gone_with_everything_it_owned(store: GroupStore) -> None:
    session = await open_session(store, "a")
    await enqueue(store, session)
    await store.close_session(sid(session))
    with pytest.raises(SessionExpired):
        await store.session(sid(session))
    with pytest.raises(SessionExpired):
        await store.keepalive(sid(session))
    # Its queue entry went with its lease; the group itself stays.
    assert set(await snapshot(store)) == {"groups/g/meta"}


async def test_a_malformed_session_id_names_no_session(store: GroupStore) -> None:
    # Not one spelling of a lease: malformed, typed, before etcd is asked.
    for bad in ("", "xyz", "0" * 16, "1" * 15, "+00000000000000f", "0x0000000000000f", "F" * 16):
        with pytest.raises(InvalidArgument):
            await store.session(bad)
