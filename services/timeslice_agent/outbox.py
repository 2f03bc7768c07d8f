"""The way out of every directive's ack: remembered, made durable, journaled, then sent.

An ack is remembered in the ledger at once, so a re-send arriving before the state file is
written is answered from the ledger (or waits for this ack), never executed or fenced a second
time. It is written to the state file before the orchestrator hears of it where the disk
allows; an ack that reports a move is sent only once written (:meth:`AckOutbox.durable`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from timeslice_agent.durability import Durability
from timeslice_agent.journal import DirectiveJournal, JournalEntry
from timeslice_agent.ledger import AckLedger
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.tasks import Supervisor
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveAck, DirectiveKind

log = logging.getLogger(__name__)


class AckOutbox:
    """Remembers, writes, journals and sends acks; ``send_ack`` must not block."""

    def __init__(
        self,
        node: str,
        durability: Durability,
        supervisor: Supervisor,
        metrics: AgentMetrics,
        send_ack: Callable[[DirectiveAck], None],
        journal: DirectiveJournal | None,
    ) -> None:
        self._node = node
        self._durability = durability
        self._supervisor = supervisor
        self._metrics = metrics
        self.send = send_ack  # straight to the link: for acks already remembered, or never
        self._journal = journal
        self.ledger = AckLedger()

    async def resend_when_done(self, running: asyncio.Future[DirectiveAck]) -> None:
        """Send the ack of a directive still running (a duplicate arrived) once it is out."""
        try:
            ack = await asyncio.shield(running)
        except asyncio.CancelledError:
            if running.cancelled():
                return  # abandoned unanswered (the state file cannot be written)
            raise
        self.send(ack)

    def exit(self, d: Directive, ack: DirectiveAck, *, written: bool = False) -> None:
        """The one way a directive's ack leaves: remembered now, then persisted and sent.

        ``written``: the state file already holds this ack (:meth:`durable`).
        """
        if d.directive_id:
            self.remember(d, ack)
        self._supervisor.spawn(
            self._publish(d, ack, written=written), name=f"ack:{d.directive_id}", kind="directive"
        )

    def remember(self, d: Directive, ack: DirectiveAck) -> None:
        """Keep ``ack`` as ``d``'s answer, and count it."""
        self.ledger.remember(ack)
        kind = d.kind.name.lower() if isinstance(d.kind, DirectiveKind) else "unspecified"
        self._metrics.observe_directive(
            kind, ack.status.name.lower(), ack.elapsed_seconds, ack.bytes_moved, ack.bytes_skipped
        )

    def interrupted(self, d: Directive, ack: DirectiveAck) -> None:
        """Remembered, not published: the agent is stopping (shutdown persists the state)."""
        self.remember(d, ack)
        self.ledger.release(ack)

    def abandon(self, directive_id: str) -> None:
        """Leave a directive unanswered and unremembered (the state file cannot be written)."""
        self.ledger.abandon(directive_id)

    async def _publish(self, d: Directive, ack: DirectiveAck, *, written: bool = False) -> None:
        if not written:
            # Written before the orchestrator hears of it where the disk allows. An ack that
            # reports a move never gets here unwritten as OK (durable); any other is sent
            # even when this write fails: it claims no new state a restart could lose.
            await self._durability.persist()
        self.ledger.release(ack)
        if self._journal is not None:
            self._journal.record(JournalEntry.of(self._node, d, ack))
        self.send(ack)
        level = logging.INFO if ack.status is AckStatus.OK else logging.WARNING
        log.log(
            level,
            "directive %s %s job %s epoch %d: %s%s bytes=%d (skipped %d) in %.3f s%s",
            d.directive_id,
            d.kind.name.lower(),
            d.job_id,
            d.epoch,
            ack.status.name,
            f" ({ack.error})" if ack.error else "",
            ack.bytes_moved,
            ack.bytes_skipped,
            ack.elapsed_seconds,
            " [emulated]" if ack.emulated else "",
        )

    async def durable(self, ack: DirectiveAck) -> bool:
        """Whether the job's new state and ``ack`` itself are written.

        Until then the file says the job is TRANSITIONING from where it was (the write before
        acting), and a restarted agent faults it there, not where its state now is: a later
        restore would only re-run the app's hooks of a job whose state is parked, a later
        checkpoint would save nothing of one whose state is on the devices. So an OK is sent
        only once written. When the write fails, nothing is sent: the node stops answering
        and is fenced out (its switches go on without it, none of its jobs faulted for the
        disk), and its next hello, once the file can be written, reports where the job's
        state really is. The job in memory stays as the move left it, which is the truth the
        following directives act on, and the ack stays in the ledger, to be written with the
        next successful write.
        """
        # In the ledger before the write, so the one write that settles the job carries its
        # ack too: a re-send after a restart is answered, never executed again.
        self.ledger.remember(ack)
        try:
            return await self._durability.save() is None
        except asyncio.CancelledError:
            # As for a directive interrupted while it acted: the agent is stopping, and its
            # shutdown writes the state (with this ack) where the disk allows.
            self.ledger.release(ack)
            raise
