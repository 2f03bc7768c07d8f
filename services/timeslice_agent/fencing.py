"""The node's fences: the highest epoch accepted per group, and the node's fence revision.

A directive is stale when its epoch is below its group's highest accepted epoch (a newer
switch of the group overtook it) or below the revision at which the orchestrator fenced this
node out (it learns it in a Welcome): the two causes are told apart on the wire by
:class:`~timeslice_proto.timeslice.v1.StaleCause`, never by the ack's text. Equal epochs are
accepted: the checkpoint and restore of one switch share one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from timeslice_proto.timeslice.v1 import GroupEpoch, StaleCause

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stale:
    """Why a directive may not act: which fence it hit, and the reason for people."""

    cause: StaleCause
    reason: str


class Fencing:
    """Epochs accepted per group and the fence revision; the executor persists both."""

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        self._revision = 0  # no directive below it acts, whatever its group

    @property
    def epochs(self) -> dict[str, int]:
        """Highest accepted epoch per group (a copy)."""
        return dict(self._epochs)

    @property
    def revision(self) -> int:
        """The highest fence revision adopted: no directive with a lower epoch acts."""
        return self._revision

    def load(self, epochs: dict[str, int], revision: int) -> None:
        """Take over what a previous run left in the state file."""
        self._epochs = dict(epochs)
        self._revision = revision

    def adopt(self, revision: int) -> bool:
        """The orchestrator fenced this node out at ``revision``; True if that is news."""
        if revision <= self._revision:
            return False
        log.warning(
            "this node was fenced out at revision %d: refusing every directive below it",
            revision,
        )
        self._revision = revision
        return True

    def stale(self, group: str, epoch: int) -> Stale | None:
        """Why a directive of ``group`` at ``epoch`` may not act, or None if it may."""
        if epoch < self._revision:
            return Stale(
                StaleCause.NODE_FENCED,
                f"stale epoch {epoch}: this node was fenced out at revision {self._revision}",
            )
        highest = self._epochs.get(group, 0)
        if epoch >= highest:
            return None
        return Stale(
            StaleCause.GROUP_EPOCH,
            f"stale epoch {epoch}: epoch {highest} was already accepted for group {group}",
        )

    def accept(self, group: str, epoch: int) -> None:
        """``epoch`` passed :meth:`stale`: it is now the group's highest."""
        self._epochs[group] = epoch

    def epoch_list(self) -> list[GroupEpoch]:
        """The wire form sent in AgentHello."""
        return [GroupEpoch(group_id=g, epoch=e) for g, e in sorted(self._epochs.items())]
