"""Recorded histories of a run and the invariant checks of docs/design.md section 5.

Clients record every acquire they start, every grant and every yield (monotonic clock of the
recording process); agents record every directive they finish in their journals. The checks
take those records and raise AssertionError with the offending items. The benchmarks reuse
them to prove their runs were correct, not only fast.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sized
from dataclasses import dataclass, field

from timeslice.agent_contract import JournalEntry

EXECUTED = ("ok", "failed")  # the agent acted; stale_epoch and refused mean it did not


@dataclass(frozen=True, slots=True)
class Hold:
    job: str
    group: str
    epoch: int
    ticket: int
    granted_at: float  # after the grant arrived
    released_at: float  # before the yield was sent


@dataclass(frozen=True, slots=True)
class Attempt:
    job: str
    group: str
    started_at: float
    granted_at: float | None  # None: never granted (an error ended it, or the run did)
    error: str = ""


@dataclass
class Recorder:
    """Thread-safe collector shared by the jobs of one run."""

    holds: list[Hold] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, item: Hold) -> None:
        with self._lock:
            self.holds.append(item)

    def attempt(self, item: Attempt) -> None:
        with self._lock:
            self.attempts.append(item)

    @staticmethod
    def now() -> float:
        return time.monotonic()


def _by_group(holds: Iterable[Hold]) -> dict[str, list[Hold]]:
    groups: dict[str, list[Hold]] = defaultdict(list)
    for h in holds:
        groups[h.group].append(h)
    for items in groups.values():
        items.sort(key=lambda h: h.epoch)
    return groups


def _require(items: Sized, what: str) -> None:
    """A check over nothing proves nothing: an empty history is a failure of the run."""
    assert len(items) > 0, f"no {what} recorded: the check would pass vacuously"


def check_mutual_exclusion(holds: list[Hold]) -> None:
    """No two holds of a group overlap, and no epoch is granted twice."""
    _require(holds, "holds")
    for group, items in _by_group(holds).items():
        epochs = [h.epoch for h in items]
        assert len(set(epochs)) == len(epochs), f"{group}: an epoch was granted twice"
        for a, b in itertools.pairwise(items):
            assert b.granted_at >= a.released_at, (
                f"{group}: {b.job} (epoch {b.epoch}) granted at {b.granted_at:.6f} while "
                f"{a.job} (epoch {a.epoch}) held it until {a.released_at:.6f}"
            )


def check_fifo(holds: list[Hold]) -> None:
    """Under FIFO, grants in epoch order serve queue tickets in increasing order.

    Every grant carries its ticket (a re-attached grant too: the server keeps the ticket of
    the queue entry it served); a grant without one is reported as such, not as an inversion.
    """
    _require(holds, "holds")
    for group, items in _by_group(holds).items():
        unticketed = [(h.job, h.epoch) for h in items if h.ticket <= 0]
        assert not unticketed, f"{group}: grants without a ticket (job, epoch): {unticketed[:5]}"
        out_of_order = [
            (a.job, a.ticket, b.job, b.ticket)
            for a, b in itertools.pairwise(items)
            if b.ticket <= a.ticket
        ]
        assert not out_of_order, f"{group}: grants out of enqueue order: {out_of_order[:5]}"


def check_fencing(entries: list[JournalEntry], nodes: Iterable[str] = ()) -> None:
    """No agent executes a directive older than one it already executed for that group.

    The journals must hold executed directives (of every node in ``nodes``): a missing or
    empty journal would pass any check.
    """
    streams: dict[tuple[str, str], list[JournalEntry]] = defaultdict(list)
    for e in entries:
        if e.status in EXECUTED:
            streams[(e.node, e.group)].append(e)
    _require(streams, "executed directives in the journals")
    silent = sorted(set(nodes) - {node for node, _ in streams})
    assert not silent, f"no executed directive in the journal of node(s) {silent}"
    for (node, group), items in streams.items():
        items.sort(key=lambda e: e.started_at)
        newest = 0
        for e in items:
            assert e.epoch >= newest, (
                f"{node}/{group}: executed {e.directive_id} (epoch {e.epoch}) after epoch {newest}"
            )
            newest = e.epoch


# What a directive does in its switch, the second field of its id (``<switch>-<purpose>-...``,
# timeslice_orchestrator.directives): a checkpoint that evicts, the restore of the waiter, or
# the restore that puts an evicted job back after a failed checkpoint (same epoch).
EVICT, RESTORE, ROLLBACK = "evict", "restore", "rollback"


def purpose(entry: JournalEntry) -> str:
    """``evict``, ``restore`` or ``rollback``: what ``entry`` did in its switch."""
    parts = entry.directive_id.split("-", 2)
    if len(parts) >= 2 and parts[1] in (EVICT, RESTORE, ROLLBACK):
        return parts[1]
    return EVICT if entry.kind == "checkpoint" else RESTORE


@dataclass(frozen=True, slots=True)
class TwoPhaseSummary:
    """What :func:`check_two_phase` looked at, so a caller can require that it saw switches."""

    switches: int = 0  # epochs with an executed directive
    committed: int = 0  # of which restored the waiter
    rolled_back: int = 0  # of which put evicted jobs back
    checkpoints: int = 0  # executed checkpoints
    restores: int = 0  # executed restores of waiters


def check_two_phase(entries: list[JournalEntry], *, exclusive: bool = True) -> TwoPhaseSummary:
    """Each switch (epoch) checkpoints, then restores; a failed one rolls back instead.

    Per switch: a waiter's restore runs only after every checkpoint of the switch finished,
    and only if every one of them succeeded (one refused, stale or failed means a rollback);
    a switch never both restores its waiter and rolls back; a rollback on a node starts after
    that node's checkpoint finished. Per node (``exclusive``: one job's state on a node's
    devices at a time, as without co-residency): a waiter is never restored over a job whose
    state the journal shows on the devices and no checkpoint moved off (a skipped checkpoint).
    An operation that failed leaves the node's state unknown to the check until a restore.
    """
    switches: dict[tuple[str, int], list[JournalEntry]] = defaultdict(list)
    for e in entries:
        switches[(e.group, e.epoch)].append(e)
    executed_any = committed = rolled_back = checkpoints = restores = 0
    for (group, epoch), items in switches.items():
        where = f"{group} epoch {epoch}"
        evicts = _final([e for e in items if purpose(e) == EVICT])
        forward = [e for e in items if purpose(e) == RESTORE and e.status in EXECUTED]
        rollbacks = [e for e in items if purpose(e) == ROLLBACK and e.status in EXECUTED]
        done = [e for e in evicts if e.status in EXECUTED]
        if not (done or forward or rollbacks):
            continue
        executed_any += 1
        checkpoints += len(done)
        restores += len(forward)
        committed += bool(forward)
        rolled_back += bool(rollbacks)
        assert not (forward and rollbacks), (
            f"{where}: the switch both restored its waiter and rolled back "
            f"({[e.directive_id for e in forward + rollbacks][:4]})"
        )
        if forward:
            unfinished = [(e.node, e.status) for e in evicts if e.status != "ok"]
            assert not unfinished, (
                f"{where}: the waiter was restored although checkpoints did not succeed "
                f"(node, status): {unfinished}"
            )
            first_restore = min(forward, key=lambda e: e.started_at)
            if evicts:
                last = max(evicts, key=lambda e: e.finished_at)
                assert first_restore.started_at >= last.finished_at, (
                    f"{where}: a restore started at {first_restore.started_at:.6f} "
                    f"({first_restore.node}) before the last checkpoint finished at "
                    f"{last.finished_at:.6f} ({last.node})"
                )
        for r in rollbacks:
            before = [e for e in done if e.node == r.node and e.job == r.job]
            late = [e for e in before if e.finished_at > r.started_at]
            assert not late, (
                f"{where}: the rollback of {r.job} on {r.node} started at {r.started_at:.6f} "
                f"before its checkpoint finished at {late[0].finished_at:.6f}"
            )
    if exclusive:
        _check_no_skipped_checkpoint(entries)
    return TwoPhaseSummary(executed_any, committed, rolled_back, checkpoints, restores)


def _final(entries: list[JournalEntry]) -> list[JournalEntry]:
    """One entry per directive: an agent that refused a directive while shutting down does
    not remember it, so a re-send after its restart may be executed (a second entry)."""
    final: dict[str, JournalEntry] = {}
    for e in sorted(entries, key=lambda e: e.finished_at):
        if e.directive_id not in final or final[e.directive_id].status not in EXECUTED:
            final[e.directive_id] = e
    return list(final.values())


def _check_no_skipped_checkpoint(entries: list[JournalEntry]) -> None:
    """Replay each node's journal: a waiter is restored only once the job before it left."""
    nodes: dict[tuple[str, str], list[JournalEntry]] = defaultdict(list)
    for e in entries:
        if e.status in EXECUTED:
            nodes[(e.node, e.group)].append(e)
    for (node, group), items in nodes.items():
        items.sort(key=lambda e: e.started_at)
        resident: str | None = None  # None: nobody, or not known from the journal
        for e in items:
            if e.status != "ok":
                resident = None  # a failed checkpoint or restore: the state is not known
            elif e.kind == "checkpoint":
                if e.job == resident:
                    resident = None
            else:
                assert resident is None or resident == e.job or purpose(e) == ROLLBACK, (
                    f"{node}/{group}: {e.job} restored (epoch {e.epoch}) over {resident}, "
                    "whose state no checkpoint moved off the devices (a skipped checkpoint)"
                )
                resident = e.job


def check_nothing_lost(attempts: list[Attempt], expected_grants: dict[str, int]) -> None:
    """Every job got every grant it needed; no acquire was left hanging without an error."""
    _require(attempts, "acquire attempts")
    hanging = [
        (a.job, a.group, a.started_at) for a in attempts if a.granted_at is None and not a.error
    ]
    assert not hanging, f"acquires left hanging (neither granted nor failed): {hanging[:5]}"
    granted: dict[str, int] = defaultdict(int)
    for a in attempts:
        if a.granted_at is not None:
            granted[a.job] += 1
    missing = {job: (granted[job], n) for job, n in expected_grants.items() if granted[job] < n}
    assert not missing, f"jobs short of grants (got, expected): {missing}"


def wait_times(attempts: list[Attempt]) -> list[float]:
    return sorted(a.granted_at - a.started_at for a in attempts if a.granted_at is not None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
