"""etcd that lost writes it had acknowledged: the mirror notices and lists again.

etcd can go back in its history: restored from an older backup, or (seen in this suite) a
single-member etcd before 3.5.5 that was killed right after answering a write
(etcd-io/etcd#14370). A mirror that resumed its watch from its own revision would then wait
silently for revisions etcd has not reached, and skip the new writes that reuse them: its
replica would answer from a past that etcd no longer has. Here the loss is a real restore of
an older copy of a real etcd's data directory.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from timeslice_orchestrator.store import follower
from timeslice_orchestrator.store.etcd import EtcdClient, StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_tools.dev.etcd import EtcdServer

# Writes made after the backup, and lost with the restore: more than one, so that a new write
# after the restore lands at or below the revision the mirror saw.
LOST_WRITES = 4


@dataclass
class Restorable:
    server: EtcdServer
    client: EtcdClient
    keys: Keyspace
    backup: Path

    def take_backup(self) -> None:
        self.server.stop()
        shutil.copytree(self.server.data_dir / "etcd", self.backup)
        self.server.start()

    def restore_backup(self) -> None:
        self.server.stop()
        shutil.rmtree(self.server.data_dir / "etcd")
        shutil.copytree(self.backup, self.server.data_dir / "etcd")
        self.server.start()


@dataclass
class Scene:
    """A running mirror, and a caller of it waiting for a write that etcd then loses."""

    mirror: Mirror
    running: asyncio.Task[None]
    waiting: asyncio.Future[None]

    async def stop(self) -> None:
        self.running.cancel()
        self.waiting.cancel()
        await asyncio.gather(self.running, self.waiting, return_exceptions=True)


@pytest.fixture
async def restorable(tmp_path: Path) -> AsyncIterator[Restorable]:
    server = EtcdServer(tmp_path / "etcd").start()
    client = EtcdClient([server.endpoint])
    try:
        yield Restorable(server, client, Keyspace(f"/test/{uuid.uuid4().hex}"), tmp_path / "bak")
    finally:
        await client.close()
        await asyncio.to_thread(server.close)


async def _mirror_after_lost_writes(etcd: Restorable) -> Scene:
    """A running mirror that has seen group ``kept`` (in the backup) and groups ``lost-*``
    (written after it); then the backup is restored."""
    keys = etcd.keys
    await etcd.client.put(keys.meta("kept"), b"")
    await asyncio.to_thread(etcd.take_backup)
    mirror = Mirror(etcd.client, keys)
    running = asyncio.create_task(mirror.run())
    await asyncio.wait_for(mirror.synced.wait(), 10)
    for n in range(LOST_WRITES):
        written = await etcd.client.put(keys.meta(f"lost-{n}"), b"")
    await mirror.wait_for_revision(written, 10)
    assert mirror.has_group("lost-0") and mirror.has_group("kept")
    waiting = asyncio.ensure_future(mirror.wait_for_revision(written + 1, 60))
    await asyncio.to_thread(etcd.restore_backup)
    return Scene(mirror, running, waiting)


async def _until_relisted(mirror: Mirror, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while mirror.rewinds == 0 or not mirror.synced.is_set():
            await asyncio.sleep(0.02)


async def test_a_watch_resumed_on_an_etcd_behind_the_mirror_lists_again(
    restorable: Restorable, caplog: pytest.LogCaptureFixture
) -> None:
    scene = await _mirror_after_lost_writes(restorable)
    mirror = scene.mirror
    try:
        await _until_relisted(mirror, 15)
        assert mirror.has_group("kept")
        assert not any(mirror.has_group(f"lost-{n}") for n in range(LOST_WRITES))
        assert any("lost writes it had acknowledged" in r.message for r in caplog.records)
        # A caller waiting for a write of the lost history answers at once (UNAVAILABLE:
        # its client retries), not when a new write reuses that revision.
        with pytest.raises(StoreUnavailable, match="lost writes"):
            await asyncio.wait_for(scene.waiting, 5)
        # And it follows etcd's new history from there.
        written = await restorable.client.put(restorable.keys.meta("after"), b"")
        await mirror.wait_for_revision(written, 10)
        assert mirror.has_group("after") and mirror.rewinds == 1
    finally:
        await scene.stop()


async def test_a_watch_resumed_after_etcd_passed_the_lost_revisions_lists_again(
    restorable: Restorable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New writes took etcd past the mirror's revision before the watch resumed (another
    replica's, say): etcd's revision alone no longer shows the loss, but the newest write the
    mirror saw is not what etcd has at its revision."""
    client = restorable.client
    check = Mirror._check_not_rewound
    passed: list[int] = []

    async def after_new_writes(mirror: Mirror) -> None:
        if not passed and await client.revision(mirror._keys.root) < mirror.revision:
            for n in range(LOST_WRITES + 2):
                passed.append(await client.put(restorable.keys.meta(f"new-{n}"), b""))
        await check(mirror)

    monkeypatch.setattr(Mirror, "_check_not_rewound", after_new_writes)
    scene = await _mirror_after_lost_writes(restorable)
    mirror = scene.mirror
    try:
        await _until_relisted(mirror, 15)
        assert passed and passed[-1] > 0
        assert not any(mirror.has_group(f"lost-{n}") for n in range(LOST_WRITES))
        assert mirror.has_group("kept") and mirror.has_group(f"new-{LOST_WRITES + 1}")
    finally:
        await scene.stop()


async def test_a_beacon_written_below_the_mirror_lists_again(
    restorable: Restorable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch resumed without the check (as if etcd had already passed the mirror's
    revision when it did): it waits for revisions etcd has not reached, and only the beacon,
    written at a revision the mirror has already seen, shows that etcd went back."""

    async def unchecked(_: Mirror) -> None:
        return None

    monkeypatch.setattr(Mirror, "_check_not_rewound", unchecked)
    monkeypatch.setattr(follower, "WATCH_QUIET_AFTER", 0.5)
    scene = await _mirror_after_lost_writes(restorable)
    mirror = scene.mirror
    try:
        await _until_relisted(mirror, 15)
        assert mirror.has_group("kept")
        assert not any(mirror.has_group(f"lost-{n}") for n in range(LOST_WRITES))
    finally:
        await scene.stop()
