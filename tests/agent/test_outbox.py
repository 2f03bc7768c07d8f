"""The ack outbox: an ack is remembered at once, written before it is sent, and an OK that
reports a move is sent only once it is durable.

Real state file, real supervisor; the link is a list the send callback appends to.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from timeslice_agent.durability import Durability
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.outbox import AckOutbox
from timeslice_agent.statefile import AgentState, load_state
from timeslice_agent.tasks import Supervisor
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    Directive,
    DirectiveAck,
    DirectiveKind,
    StaleCause,
)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "state.json"
        self.metrics = AgentMetrics(node="n1", backend="sim", emulated=True)
        self.supervisor = Supervisor(self.metrics)
        # What the state file held when each ack was sent.
        self.sent: list[tuple[DirectiveAck, list[str]]] = []
        self.durability = Durability(self.path, self.snapshot, self.metrics, self.supervisor)
        self.outbox = AckOutbox(
            "n1", self.durability, self.supervisor, self.metrics, self.send, journal=None
        )

    def snapshot(self) -> AgentState:
        return AgentState(node="n1", acks=self.outbox.ledger.acks())

    def send(self, ack: DirectiveAck) -> None:
        on_disk = load_state(self.path, "n1")
        self.sent.append((ack, [a.directive_id for a in on_disk.acks] if on_disk else []))


def _directive(did: str) -> Directive:
    return Directive(directive_id=did, group_id="g", epoch=3, kind=DirectiveKind.CHECKPOINT)


async def test_an_ack_is_remembered_at_once_and_written_before_it_is_sent(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    ack = DirectiveAck(
        directive_id="d1",
        group_id="g",
        epoch=3,
        status=AckStatus.STALE_EPOCH,
        stale_cause=StaleCause.NODE_FENCED,
    )
    rig.outbox.ledger.start("d1")  # as the executor does when it accepts the directive
    running = rig.outbox.ledger.running("d1")
    assert running is not None
    rig.outbox.exit(_directive("d1"), ack)
    # Remembered at once: a re-send arriving now is never executed a second time, and one
    # waiting on the running directive gets this ack once it is written.
    assert rig.outbox.ledger.answered("d1") is ack
    assert not running.done()
    async with asyncio.timeout(5):
        assert await running is ack
        while not rig.sent:
            await asyncio.sleep(0.01)
    [(sent, on_disk)] = rig.sent
    assert sent is ack and on_disk == ["d1"]
    # Answered from the file after a restart, cause and all.
    state = load_state(rig.path, "n1")
    assert state is not None
    assert [(a.directive_id, a.stale_cause) for a in state.acks] == [("d1", StaleCause.NODE_FENCED)]
    await rig.supervisor.cancel_all(2.0)


async def test_a_move_that_cannot_be_written_is_not_durable(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.path.mkdir()  # a directory where the file should be: every write fails
    ack = DirectiveAck(directive_id="d2", status=AckStatus.OK, moved=True)
    rig.outbox.ledger.start("d2")
    waiting = rig.outbox.ledger.running("d2")
    assert waiting is not None
    assert not await rig.outbox.durable(ack)
    assert rig.durability.unwritable is not None
    assert rig.sent == [] and not waiting.done()  # never sent, nor handed to a re-send
    rig.outbox.abandon("d2")  # what the executor does: the node stops answering
    assert waiting.cancelled()
    # Kept, to be written with the next successful write (and answered after the rejoin).
    assert rig.outbox.ledger.answered("d2") is ack
    await rig.supervisor.cancel_all(2.0)
