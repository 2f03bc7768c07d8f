"""What every part of the driver's reconcile pass shares: the settings it runs with
(:class:`DriverConfig`), what it answers (:class:`Next`), and the writes it waits to see
(:class:`OwnWrites`).

The parts are the pass itself (:mod:`.driver`), the switch state machine
(:mod:`.switch_machine`), the rule after an aborted switch (:mod:`.switch_abort`) and the
waiters held back for a node that cannot restore them (:mod:`.held_back`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from timeslice_orchestrator.policy import Policy
from timeslice_orchestrator.store.follower import MIRROR_LAG_TIMEOUT, Mirror


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """How one replica's driver behaves (times in seconds)."""

    replica_id: str
    directive_timeout: float = 30.0
    max_attempts: int = 3  # refused switches tried towards one waiter before it is faulted
    retry_backoff: float = 0.2  # first backoff, of a blocked group and of a failed switch
    max_backoff: float = 2.0  # cap of a blocked group's backoff
    idle_recheck: float = 2.0  # an idle group with waiters is looked at again this often
    co_residency: bool = False
    prefetch: bool = False
    policy: Policy = Policy.FIFO
    # Groups driven at once. A pass can wait on agents up to the directive timeout, so this is
    # generous: enough that switches of unrelated groups rarely wait for each other.
    workers: int = 64
    # How long a waiter parked on a node that cannot restore it (its agent away) is held back
    # before it is faulted; None: the directive timeout (what a restore there may take).
    parked_wait: float | None = None

    @property
    def held_back_for(self) -> float:
        """Seconds a waiter is held back for a node that cannot restore it, at most."""
        return self.directive_timeout if self.parked_wait is None else self.parked_wait


class Next(enum.Enum):
    """What happens to a group after one reconcile pass."""

    IDLE = "idle"  # nothing to do until the group changes
    AGAIN = "again"  # progress was made: look again at once
    LATER = "later"  # blocked (an agent away, a lost race): retry after the group's backoff
    WAIT = "wait"  # the head's last switch failed: look again when its retry is due


class OwnWrites:
    """The revision of this driver's last write to each group, until the mirror shows it.

    A pass planned on an older view would carry on a switch it has just committed, so a pass
    first waits for the mirror to show what this driver wrote to its group.
    """

    def __init__(self, mirror: Mirror) -> None:
        self._mirror = mirror
        self._written: dict[str, int] = {}

    def wrote(self, group: str, revision: int | None) -> int | None:
        """Remember a write of this pass (None: it did not go through); returns it."""
        if revision is not None:
            self._written[group] = max(revision, self._written.get(group, 0))
        return revision

    async def seen(self, group: str) -> None:
        """Wait until the mirror shows this driver's last write to ``group``."""
        written = self._written.get(group, 0)
        if written > self._mirror.revision:
            await self._mirror.wait_for_revision(written, MIRROR_LAG_TIMEOUT)

    def forget(self, group: str) -> None:
        """A pass over ``group`` starts on a view that shows every write of the last one."""
        self._written.pop(group, None)

    def shown(self, groups: Iterable[str]) -> None:
        """The mirror changed ``groups``: writes it now shows need no wait (a group gone idle
        keeps no entry)."""
        if not self._written:
            return
        revision = self._mirror.revision
        for group in groups:
            if self._written.get(group, revision + 1) <= revision:
                del self._written[group]
