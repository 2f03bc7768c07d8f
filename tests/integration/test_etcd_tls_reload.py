"""A reload of the etcd client certificate leaves nothing on the channels it retires.

Closing a gRPC channel cancels the calls still on it from below. The mirror's watch stayed on
the channel the reload retired and, when that channel was closed (30 s later), ended as if
cancelled on purpose: the mirror stopped following etcd without a word, while the replica
went on answering from it as ready. Now the reload moves the watches (and, at their next
refresh, the lease keepalive streams) to the new channels, and a call cancelled from below
fails over like any broken stream.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest

from timeslice.tls import TlsFiles
from timeslice_orchestrator.store.etcd import EtcdClient, LeaseKeeper
from timeslice_orchestrator.store.etcd import members as etcd_members
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.etcd import EtcdServer


def _copy_tls(pki: Pki, into: Path) -> TlsFiles:
    pair = pki.etcd_client
    files = TlsFiles(
        ca=str(shutil.copy(pki.etcd_ca, into / "ca.crt")),
        cert=str(shutil.copy(pair.cert, into / "client.crt")),
        key=str(shutil.copy(pair.key, into / "client.key")),
    )
    return files


def _rewrite(path: str) -> None:
    """Replace the file by a copy of itself (a new inode: what a certificate rotation does)."""
    shutil.copy(path, path + ".new")
    Path(path + ".new").replace(path)


async def test_the_mirror_and_a_lease_outlive_a_tls_reload(
    tls_etcd_server: EtcdServer,
    session_pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(etcd_members, "OLD_CHANNEL_GRACE", 0.0)
    tls = _copy_tls(session_pki, tmp_path)
    client = EtcdClient([tls_etcd_server.endpoint], tls=tls, timeout=5.0)
    keys = Keyspace(f"/timeslice/reload-{uuid.uuid4().hex[:8]}")
    mirror = Mirror(client, keys)
    following = asyncio.create_task(mirror.run())
    lease = await client.grant_lease(3)
    keeper = LeaseKeeper(client, lease, 3)
    keeping = asyncio.create_task(keeper.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        await client.keepalive_once(lease)  # a keepalive stream on the old channel
        for _ in range(2):
            assert tls.cert is not None
            _rewrite(tls.cert)
            assert await client.refresh_tls()
            await asyncio.sleep(0.5)
            await client.refresh_tls()  # closes the channels the reload retired (no grace)
            revision = await client.put(keys.root + b"else/x", uuid.uuid4().bytes)
            await mirror.wait_for_revision(revision, 5)
            assert not following.done()
        await asyncio.sleep(3.5)  # past the lease's TTL: refreshed on the new channels
        assert not keeper.lost.is_set() and await client.lease_ttl(lease) > 0
    finally:
        following.cancel()
        keeping.cancel()
        await asyncio.gather(following, keeping, return_exceptions=True)
        await client.revoke_lease(lease)
        await client.close()
