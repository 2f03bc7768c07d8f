"""An append-only record of every directive this agent finished: the node's side of a history.

One JSON object per line (node, directive, group, epoch, kind, job, status, agent-clock start and
finish). Tests and benchmarks read it to check fencing and two-phase ordering across nodes;
operators can use it as an audit trail. Lines go to the page cache without fsync: it is a
record for analysis, not state the agent relies on (that is the state file).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from timeslice_proto.timeslice.v1 import Directive, DirectiveAck


@dataclass(frozen=True, slots=True)
class JournalEntry:
    node: str
    directive_id: str
    group: str
    epoch: int
    kind: str
    job: str
    status: str
    error: str
    bytes_moved: int
    started_at: float
    finished_at: float
    # Of bytes_moved: released without a copy (the host copy was current). Last, with a
    # default, so journals written before it existed still read.
    bytes_skipped: int = 0

    @classmethod
    def of(cls, node: str, directive: Directive, ack: DirectiveAck) -> JournalEntry:
        return cls(
            node=node,
            directive_id=directive.directive_id,
            group=directive.group_id,
            epoch=directive.epoch,
            kind=directive.kind.name.lower(),
            job=directive.job_id,
            status=ack.status.name.lower(),
            error=ack.error,
            bytes_moved=ack.bytes_moved,
            started_at=ack.started_at,
            finished_at=ack.finished_at,
            bytes_skipped=ack.bytes_skipped,
        )


def read_journal(path: Path) -> list[JournalEntry]:
    if not path.exists():
        return []
    return [
        JournalEntry(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()
    ]


class DirectiveJournal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", buffering=1, encoding="utf-8")

    def record(self, entry: JournalEntry) -> None:
        self._file.write(json.dumps(asdict(entry), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
