"""Counts the mirror keeps for the quotas: sessions per job, queue entries and holds per session.

Kept up to date as keys are stored and dropped, so a quota check costs a dictionary lookup
however many groups and sessions there are (a flood of them must not slow anyone else's
calls down). A record that cannot be decoded is not counted; the mirror logs it where it
reads it.
"""

from __future__ import annotations

from collections import Counter

from timeslice_orchestrator.store.keys import KeyRef, Kind


class OwnerIndex:
    def __init__(self) -> None:
        self._owner: dict[KeyRef, str] = {}  # session key -> job; entry or hold -> session
        self.sessions_per_job: Counter[str] = Counter()
        self.entries_per_session: Counter[str] = Counter()

    def stored(self, ref: KeyRef, owner: str | None) -> None:
        """``ref`` was written; ``owner`` is its job (a session) or its session (an entry or a
        hold), None when its record does not decode (not counted)."""
        if ref.kind not in (Kind.SESSION, Kind.QUEUE, Kind.HOLDER):
            return
        self.dropped(ref)  # a rewrite replaces the old owner
        if owner is None:
            return
        counts = self.sessions_per_job if ref.kind is Kind.SESSION else self.entries_per_session
        counts[owner] += 1
        self._owner[ref] = owner

    def dropped(self, ref: KeyRef) -> None:
        owner = self._owner.pop(ref, None)
        if owner is None:
            return
        counts = self.sessions_per_job if ref.kind is Kind.SESSION else self.entries_per_session
        counts[owner] -= 1
        if counts[owner] <= 0:
            del counts[owner]  # no key left behind per departed owner
