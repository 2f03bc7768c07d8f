"""Recorded grant histories and the invariant checks of DESIGN.md section 5."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hold:
    job: str
    group: str
    epoch: int
    ticket: int
    granted_at: float  # monotonic, after the grant arrived
    released_at: float  # monotonic, before the yield was sent


def check_mutual_exclusion(holds: list[Hold]) -> None:
    by_group: dict[str, list[Hold]] = {}
    for h in holds:
        by_group.setdefault(h.group, []).append(h)
    for group, items in by_group.items():
        items.sort(key=lambda h: h.epoch)
        epochs = [h.epoch for h in items]
        assert len(set(epochs)) == len(epochs), f"{group}: an epoch was granted twice"
        for a, b in itertools.pairwise(items):
            assert b.granted_at >= a.released_at, (
                f"{group}: {b.job} (epoch {b.epoch}) granted at {b.granted_at:.6f} while "
                f"{a.job} (epoch {a.epoch}) held it until {a.released_at:.6f}"
            )


def check_fifo(holds: list[Hold]) -> None:
    """Under FIFO, grants in epoch order serve queue tickets in increasing order."""
    by_group: dict[str, list[Hold]] = {}
    for h in holds:
        by_group.setdefault(h.group, []).append(h)
    for group, items in by_group.items():
        items.sort(key=lambda h: h.epoch)
        tickets = [h.ticket for h in items]
        out_of_order = [
            (a.job, a.ticket, b.job, b.ticket)
            for a, b in itertools.pairwise(items)
            if b.ticket <= a.ticket
        ]
        assert not out_of_order, f"{group}: grants out of enqueue order: {out_of_order[:5]}"
        assert tickets == sorted(tickets)
