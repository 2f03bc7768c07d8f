"""Names the node agent shares with the tools that launch it and read what it writes.

The tools (``timeslice_tools``: the dev cluster, the history checkers) stand on the SDK's floor
and must not import the services above them, so the two things both sides spell live here:

- :class:`BackendKind`, the one list of the agent's data-movement backends (its ``--backend``
  choices, and the dev cluster's);
- :class:`JournalEntry`, one line of the agent's directive journal (``--journal``), which the
  agent writes and the history checkers, tests and benchmarks read back.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from timeslice_proto.timeslice.v1 import Directive, DirectiveAck

__all__ = ["BackendKind", "JournalEntry", "read_journal"]


class BackendKind(enum.Enum):
    """The data-movement backends the agent can run: the one list of them.

    Each value names a module of ``timeslice_agent.backends`` that has a ``create``.
    """

    SIM = "sim"
    FREEZE = "freeze"
    CUDA = "cuda"
    APP = "app"


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One finished directive, as one JSON object per line of the agent's journal."""

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
        """The entry for ``directive`` finished on ``node`` with ``ack``."""
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
    """Every entry of the journal at ``path``, in the order written; none if it is absent."""
    if not path.exists():
        return []
    return [
        JournalEntry(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()
    ]
