"""Counts the mirror keeps for the quotas: sessions per job, queue entries and holds per
session, groups per creating job.

Kept up to date as keys are stored and dropped, so a quota check costs a dictionary lookup
however many groups and sessions there are (a flood of them must not slow anyone else's
calls down). A record that cannot be decoded is not counted; the mirror logs it where it
reads it.
"""

from __future__ import annotations

from collections import Counter

from timeslice_orchestrator.store.keys import KeyRef, Kind

# The keys counted, and what their owner is: a session's job, an entry's or a hold's session,
# a group's meta key's creating job (GroupMetaRecord.job).
OWNED = frozenset({Kind.SESSION, Kind.QUEUE, Kind.HOLDER, Kind.META})


class OwnerIndex:
    def __init__(self) -> None:
        self._owner: dict[KeyRef, str] = {}
        self.sessions_per_job: Counter[str] = Counter()
        self.entries_per_session: Counter[str] = Counter()
        self.groups_per_job: Counter[str] = Counter()

    def _counts(self, kind: Kind) -> Counter[str]:
        if kind is Kind.SESSION:
            return self.sessions_per_job
        if kind is Kind.META:
            return self.groups_per_job
        return self.entries_per_session

    def stored(self, ref: KeyRef, owner: str | None) -> None:
        """``ref`` was written; ``owner`` is its job (a session, a group's meta key) or its
        session (an entry or a hold), None when it has none or its record does not decode
        (not counted)."""
        if ref.kind not in OWNED:
            return
        self.dropped(ref)  # a rewrite replaces the old owner
        if not owner:
            return
        self._counts(ref.kind)[owner] += 1
        self._owner[ref] = owner

    def dropped(self, ref: KeyRef) -> None:
        owner = self._owner.pop(ref, None)
        if owner is None:
            return
        counts = self._counts(ref.kind)
        counts[owner] -= 1
        if counts[owner] <= 0:
            del counts[owner]  # no key left behind per departed owner
