"""An append-only record of every directive this agent finished: the node's side of a history.

One JSON object per line (node, directive, group, epoch, kind, job, status, agent-clock start and
finish). Tests and benchmarks read it to check fencing and two-phase ordering across nodes;
operators can use it as an audit trail. Lines go to the page cache without fsync: it is a
record for analysis, not state the agent relies on (that is the state file). The line's shape,
:class:`JournalEntry`, lives in :mod:`timeslice.agent_contract`, where the tools that read
journals can reach it without importing the agent.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import IO

from timeslice.agent_contract import JournalEntry as JournalEntry
from timeslice.agent_contract import read_journal as read_journal


class DirectiveJournal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", buffering=1, encoding="utf-8")

    def record(self, entry: JournalEntry) -> None:
        self._file.write(json.dumps(asdict(entry), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
