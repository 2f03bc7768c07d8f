"""What the driver's parts share (``reconcile.py``): its settings and its own writes."""

from __future__ import annotations

from typing import cast

from timeslice_orchestrator.reconcile import DriverConfig, OwnWrites
from timeslice_orchestrator.store.follower import Mirror


class _Mirror:
    """A mirror at ``revision`` that records what it was asked to wait for."""

    def __init__(self, revision: int) -> None:
        self.revision = revision
        self.waited: list[int] = []

    async def wait_for_revision(self, revision: int, timeout: float) -> None:
        self.waited.append(revision)
        self.revision = max(self.revision, revision)


def test_a_parked_waiter_is_held_back_for_the_directive_timeout_unless_told() -> None:
    assert DriverConfig(replica_id="r", directive_timeout=12.0).held_back_for == 12.0
    assert DriverConfig(replica_id="r", parked_wait=3.0).held_back_for == 3.0
    assert DriverConfig(replica_id="r", parked_wait=0.0).held_back_for == 0.0


async def test_a_pass_waits_for_the_mirror_to_show_its_own_last_write() -> None:
    mirror = _Mirror(100)
    writes = OwnWrites(cast(Mirror, mirror))
    assert writes.wrote("g", None) is None  # a write that did not go through
    assert writes.wrote("g", 105) == 105
    assert writes.wrote("g", 103) == 103  # the latest of this pass's writes counts
    await writes.seen("h")  # nothing written there
    await writes.seen("g")
    assert mirror.waited == [105]
    await writes.seen("g")  # shown now: no wait
    assert mirror.waited == [105]


async def test_writes_the_mirror_shows_are_forgotten() -> None:
    mirror = _Mirror(100)
    writes = OwnWrites(cast(Mirror, mirror))
    writes.wrote("g", 101)
    writes.wrote("h", 102)
    mirror.revision = 101
    writes.shown(["g", "h"])
    mirror.revision = 100  # as if the mirror re-listed below them: g needs no wait any more
    await writes.seen("g")
    await writes.seen("h")
    assert mirror.waited == [102]
    writes.forget("h")
    await writes.seen("h")
    assert mirror.waited == [102]
