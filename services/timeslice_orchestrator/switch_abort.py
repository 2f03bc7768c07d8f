"""Who is faulted after a switch aborted (its checkpoint failed, hung or was refused).

The switch state machine (:mod:`.switch_machine`) rolls the evicted jobs back and closes the
record; then this rule decides what happens to the waiter and to the jobs whose state could not
leave the devices (the culprits):

- a prefetch ends (the switch will do the work) and an operation keeps its failed outcome;
- a checkpoint that failed in an evicted job's own hook, processes or backend faults that job
  (when it waits), never the waiter, which is retried with backoff and granted once that state
  is off the devices;
- a refused checkpoint (host memory, a safety check), or one whose failure is not known any
  more (carried on after a driver died), is retried a bounded number of times, then the waiter
  alone is faulted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.retries import Retry, RetryLedger
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Authority, Fault, GroupStore
from timeslice_orchestrator.store.records import SwitchKind, SwitchRecord

# The driver's logger, as every part of the driver: a group's switches read in one stream.
log = logging.getLogger("timeslice_orchestrator.driver")


@dataclass(frozen=True, slots=True)
class Culprit:
    """An evicted job whose checkpoint failed on a node, and why."""

    job: str
    node: str
    error: str


class AbortRule:
    """What follows a rolled-back switch: see the module docstring."""

    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        auth: Authority,
        metrics: Metrics,
        config: DriverConfig,
        retries: RetryLedger,
        writes: OwnWrites,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._auth = auth
        self._metrics = metrics
        self._config = config
        self._retries = retries
        self._writes = writes

    async def after_abort(self, group: str, record: SwitchRecord, culprits: list[Culprit]) -> Next:
        """After a failed checkpoint: fault the job whose state could not leave, never the
        waiter, which keeps its place and is retried with backoff.

        Only an evicted job's state was being moved: its hook, its processes or its node
        failed, not the waiter. Faulting the waiter (as before) let the job whose state can
        not move keep the group: once the waiter was gone, its next acquire was granted in
        place. So the job itself is faulted when it waits (its acquire fails with
        GroupFaulted and the reason); one that does not wait yet is faulted at the first
        retry that finds it queued. The waiter is granted as soon as that state is off the
        devices: a retry whose checkpoint works, or the job's workers gone (no longer
        resident, so nothing to move); until then the group's ``last_error`` says why it
        waits. Granting it beside the stuck state instead could run a device out of memory.
        """
        if record.kind is SwitchKind.OPERATION:
            return Next.AGAIN  # its outcome (failed) is written; operations are not retried
        if record.kind is SwitchKind.PREFETCH:
            return Next.IDLE  # an optimisation that did not work out: the switch will do it
        key = (group, record.to_job, record.to_revision)
        retry = self._retries.get(key)
        attempt = max(retry.attempts if retry is not None else 0, record.attempt)
        if not culprits:
            return await self._give_up_later(group, record, attempt)
        # Not a sleep: the next pass finds the retry not yet due and the work queue brings
        # the group back when it is (our own writes kick it earlier in vain). Unbounded in
        # number, so the exponent is: a float overflows past 2**1023.
        doubled = self._config.retry_backoff * 2 ** min(attempt - 1, 30)
        backoff = min(doubled, self._config.max_backoff)
        self._retries.put(key, Retry(attempt, time.monotonic() + backoff))
        # Read the group as the rollback left it: its statistics are written again below.
        await self._writes.seen(group)
        view = self._mirror.group(group)
        stuck = "; ".join(f"{c.job} on {c.node}: {c.error}" for c in culprits)
        note = (
            f"{record.to_job} waits: the state of {', '.join(sorted({c.job for c in culprits}))} "
            f"could not be checkpointed ({stuck}); retried, and granted once that state is off "
            "the devices"
        )
        stats = view.stats
        stats.last_error = note
        told = False  # the note went with a fault's statistics
        for job in sorted({c.job for c in culprits}):
            entry = view.queued(job)
            if entry is None or job == record.to_job:
                continue
            mine = "; ".join(f"on {c.node}: {c.error}" for c in culprits if c.job == job)
            reason = (
                f"the state of {job} could not be checkpointed for the next job in line "
                f"({record.to_job}) {mine}; {job} is faulted, not {record.to_job}, until its "
                "state can leave the devices (fix what failed, or end its processes)"
            )
            stats.faults += 1
            faulted = await self._store.fault_waiter(group, self._auth, Fault(entry, reason), stats)
            if self._writes.wrote(group, faulted) is None:
                stats.faults -= 1  # its entry changed meanwhile: the next retry sees it
                continue
            told = True
            log.error("group %s: %s isolated: %s", group, job, reason)
            self._metrics.switches.labels(outcome="evict_failed").inc()
        if not told:
            await self._store.note_error(group, note)
        return Next.WAIT

    async def _give_up_later(self, group: str, record: SwitchRecord, attempt: int) -> Next:
        """A checkpoint refused (host memory, a safety check) or whose failure is not known
        any more: retry the waiter with a bounded backoff, then give up on it alone."""
        key = (group, record.to_job, record.to_revision)
        if attempt < self._config.max_attempts:
            backoff = self._config.retry_backoff * 2 ** (attempt - 1)
            self._retries.put(key, Retry(attempt, time.monotonic() + backoff))
            return Next.WAIT
        self._retries.pop(key)
        view = self._mirror.group(group)
        head = view.queued(record.to_job)
        if head is None or head.revision != record.to_revision:
            return Next.AGAIN
        reason = f"switch to {record.to_job} failed {attempt} times: {view.stats.last_error}"
        stats = view.stats
        stats.last_error = reason
        stats.faults += 1
        # Isolate the head: its Acquire fails with the reason, the others keep their places.
        self._writes.wrote(
            group, await self._store.fault_waiter(group, self._auth, Fault(head, reason), stats)
        )
        self._metrics.switches.labels(outcome="gave_up").inc()
        return Next.AGAIN
