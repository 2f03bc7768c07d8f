"""The ack ledger: every directive id is executed at most once, and answered every time.

A directive the orchestrator re-sends (after a reconnect, or from another replica) is answered
with the ack it already got, never executed twice; a re-send that arrives while the first copy
still runs gets the same ack when that copy finishes. The last :data:`MAX_REMEMBERED_ACKS`
acks are remembered, and travel through the state file across restarts.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

from timeslice_proto.timeslice.v1 import DirectiveAck

MAX_REMEMBERED_ACKS = 1024


class AckLedger:
    """Acks by directive id (most recent last), and the directives still running."""

    def __init__(self, limit: int = MAX_REMEMBERED_ACKS) -> None:
        self._limit = limit
        self._acks: OrderedDict[str, DirectiveAck] = OrderedDict()
        self._running: dict[str, asyncio.Future[DirectiveAck]] = {}

    def load(self, acks: Iterable[DirectiveAck]) -> None:
        """Take over the acks a previous run persisted (oldest first)."""
        for ack in acks:
            self._store(ack)

    def acks(self) -> list[DirectiveAck]:
        """The remembered acks, oldest first (for the state file)."""
        return list(self._acks.values())

    def answered(self, directive_id: str) -> DirectiveAck | None:
        """The ack a directive already got, or None; a hit counts as a recent use."""
        ack = self._acks.get(directive_id)
        if ack is not None:
            self._acks.move_to_end(directive_id)
        return ack

    def running(self, directive_id: str) -> asyncio.Future[DirectiveAck] | None:
        """The pending ack of a directive still executing, or None."""
        return self._running.get(directive_id)

    def start(self, directive_id: str) -> None:
        """Mark a directive as executing, so its re-sends wait for its ack."""
        self._running[directive_id] = asyncio.get_running_loop().create_future()

    def remember(self, ack: DirectiveAck) -> None:
        """Remember ``ack``; re-sends still wait (see :meth:`release`)."""
        self._store(ack)

    def release(self, ack: DirectiveAck) -> None:
        """Hand ``ack`` to the re-sends waiting for it (once it is durable)."""
        waiting = self._running.pop(ack.directive_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(ack)

    def abandon(self, directive_id: str) -> None:
        """The directive will not be answered now (its re-sends waiting give up too)."""
        waiting = self._running.pop(directive_id, None)
        if waiting is not None and not waiting.done():
            waiting.cancel()

    def _store(self, ack: DirectiveAck) -> None:
        self._acks[ack.directive_id] = ack
        self._acks.move_to_end(ack.directive_id)
        while len(self._acks) > self._limit:
            self._acks.popitem(last=False)
