"""The agent's directive journal (timeslice_agent.journal): one line per finished directive,
appended across runs and visible to a reader as soon as it is recorded."""

from __future__ import annotations

from pathlib import Path

from timeslice_agent.journal import DirectiveJournal, JournalEntry, read_journal


def _entry(directive: str, epoch: int) -> JournalEntry:
    return JournalEntry("n1", directive, "g", epoch, "checkpoint", "job", "ok", "", 1, 0.5, 0.75)


def test_entries_are_readable_as_soon_as_recorded_and_kept_across_runs(tmp_path: Path) -> None:
    path = tmp_path / "state" / "journal.jsonl"  # its folder is made as needed
    journal = DirectiveJournal(path)
    journal.record(_entry("d1", 1))
    # Line-buffered: a checker reading while the agent runs sees every finished directive.
    assert read_journal(path) == [_entry("d1", 1)]
    journal.record(_entry("d2", 2))
    journal.close()
    # A restarted agent appends: the node's history is never cut short.
    again = DirectiveJournal(path)
    again.record(_entry("d3", 3))
    again.close()
    assert [e.directive_id for e in read_journal(path)] == ["d1", "d2", "d3"]
    assert len(path.read_text().splitlines()) == 3  # one compact JSON object per line
