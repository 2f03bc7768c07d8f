"""What the agent and the tools both spell (timeslice.agent_contract): the journal line's shape,
read back from what the agent writes, also from journals older than its last field, and the one
list of backends, which must name the agent's backend modules."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

from timeslice.agent_contract import BackendKind, JournalEntry, read_journal
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveAck, DirectiveKind


def test_an_entry_is_made_of_the_directive_and_its_ack() -> None:
    directive = Directive(
        directive_id="d1", group_id="g", epoch=7, kind=DirectiveKind.RESTORE, job_id="job-a"
    )
    ack = DirectiveAck(
        status=AckStatus.FAILED,
        error="no room",
        bytes_moved=100,
        bytes_skipped=40,
        started_at=1.0,
        finished_at=2.5,
    )
    assert JournalEntry.of("n1", directive, ack) == JournalEntry(
        node="n1",
        directive_id="d1",
        group="g",
        epoch=7,
        kind="restore",
        job="job-a",
        status="failed",
        error="no room",
        bytes_moved=100,
        started_at=1.0,
        finished_at=2.5,
        bytes_skipped=40,
    )


def test_a_journal_is_read_in_order_and_an_older_line_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    assert read_journal(path) == []  # an agent that finished nothing wrote no file
    newer = JournalEntry("n1", "d2", "g", 8, "checkpoint", "job-b", "ok", "", 5, 3.0, 4.0, 5)
    older_line = {
        "node": "n1",
        "directive_id": "d1",
        "group": "g",
        "epoch": 7,
        "kind": "restore",
        "job": "job-a",
        "status": "ok",
        "error": "",
        "bytes_moved": 10,
        "started_at": 1.0,
        "finished_at": 2.0,
    }  # written before bytes_skipped existed
    newer_line = dataclasses.asdict(newer)
    path.write_text(f"{json.dumps(older_line)}\n\n{json.dumps(newer_line)}\n")
    first, second = read_journal(path)
    assert (first.directive_id, first.bytes_skipped) == ("d1", 0)
    assert second == newer


def test_every_backend_kind_names_an_agent_backend_module_with_create() -> None:
    for kind in BackendKind:
        module = importlib.import_module(f"timeslice_agent.backends.{kind.value}")
        assert callable(module.create), kind
