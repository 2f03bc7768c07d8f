"""The sweep: taking back what an aborted acquire left on the server.

The abort resets the Acquire stream, and the orchestrator withdraws the entry, or takes back
a grant it could not deliver. Two cases escape it:

- The server had already sent GRANTED and ended the stream: the reset comes too late, and the
  GRANTED, still on the wire, is dropped with the stream.
- The entry outlived the call: the abort came while no stream was open (between two
  replicas, both unreachable for a moment). That entry is granted later.

Either way a hold would sit on our live session with no record here: the group blocked for
everyone, our next acquire of it refused ("already holds"). So the client looks the group up.
A hold of this job is yielded (the Yield names our session and the epoch read: it cannot
release anyone else's hold). The aborted call's own entry (its ticket), still there after the
server had time to withdraw it, is taken back: the same request, sent again, re-attaches to
it and is reset at its first answer, which withdraws it; then the group is looked at again,
for a grant that raced that reset. The replica answering may lag a grant or a withdrawal by a
moment, so looks that find nothing to do are repeated a few times, briefly. Retried while no
replica answers, until the session ends (which takes everything anyway).

While it runs the group's tenure is SWEEPING (:mod:`timeslice._tenure`), and the next
acquire of the group waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, cast

from timeslice._acquire import AcquireCall
from timeslice._session import Session
from timeslice._tenure import TenureState
from timeslice._types import AcquireStage
from timeslice.backoff import Backoff
from timeslice.errors import (
    AlreadyExists,
    Cancelled,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Timeout,
    TimeSliceError,
    Unavailable,
)
from timeslice_proto.timeslice.v1 import AcquireEvent, GroupStatus, QueueEntry, TimeSliceStub

if TYPE_CHECKING:
    from timeslice._core import ClientCore

log = logging.getLogger("timeslice")

# Pauses between two look-ups for an unseen grant while no replica answers.
_RETRY_INITIAL = 0.1
_RETRY_MAX = 1.0
# Pauses between the looks of a sweep that find nothing to do yet: the replica answering may
# not show yet a grant made a moment ago, nor the server's own withdrawal of the entry (which
# is why the entry is taken back only when it is still there after these).
_PAUSES = (0.05, 0.2)


async def sweep(core: ClientCore, session: Session, aborted: AcquireCall) -> None:
    """Take back what ``aborted`` left on the server: a grant it never saw, or its queue
    entry; see the module docstring."""
    group = aborted.group
    job = core.job_id
    backoff = Backoff(_RETRY_INITIAL, _RETRY_MAX)
    pauses = list(_PAUSES)
    while (
        not session.done
        and not core.closed
        and core.tenures.state_of(group) is not TenureState.HELD
    ):
        try:
            try:
                status: GroupStatus | None = await core.group_status(group)
            except NotFound:
                status = None  # not (yet) known to the replica that answered
            if status is not None and status.holder_job_id == job:
                epoch = status.holder_epoch
                await core.send_yield(session, group, epoch)
                log.warning(
                    "gave back group %s (epoch %d): it was granted to an acquire of job %s "
                    "that was aborted",
                    group,
                    epoch,
                    job,
                )
                return
            entry = _entry_of(status, job)
            mine = entry is not None and aborted.ticket in (0, entry.revision)
            if mine and not pauses:
                epoch = await _leave_queue(core, session, aborted)
                if epoch:
                    await core.send_yield(session, group, epoch)
                    return
                pauses = [_PAUSES[0]]  # a grant may have raced the reset: look again
                continue
            if not pauses:
                return  # nothing of the aborted call's is left
            await asyncio.sleep(pauses.pop(0))
        except (NotHolder, PermissionDenied, NotFound, AlreadyExists, Cancelled) as exc:
            # Not ours (another session of the job), gone, or the client closed.
            log.debug("sweep of %s ends: %s", group, exc)
            return
        except SessionExpired as exc:
            session.lose(f"sweep: {exc}")
            return
        except (Unavailable, Timeout) as exc:
            log.warning("taking back what an aborted acquire of %s left, retrying: %s", group, exc)
            await asyncio.sleep(backoff.next_delay())
        except TimeSliceError as exc:
            # Not something a retry fixes (a faulted group, a quota): the session's end takes
            # what is left.
            log.warning("could not take back what an aborted acquire of %s left: %s", group, exc)
            return


async def _leave_queue(core: ClientCore, session: Session, aborted: AcquireCall) -> int:
    """Re-send the aborted request (it re-attaches to its entry) and reset it at the first
    answer, which makes the orchestrator withdraw the entry. Returns the epoch when that
    answer was a grant (given back by the caller), else 0."""
    request = aborted.request(session)

    async def call(stub: TimeSliceStub, timeout: float) -> int:
        events = cast(AsyncGenerator[AcquireEvent, None], stub.acquire(request))
        async with contextlib.aclosing(events), asyncio.timeout(timeout):
            event = await anext(events, None)
        if event is None:
            return 0  # ended without an answer: nothing was written for it
        granted = AcquireStage.from_wire(event.state) is AcquireStage.GRANTED
        return int(event.epoch) if granted else 0

    return await core.unary(f"Acquire({aborted.group}) to leave its queue", call)


def _entry_of(status: GroupStatus | None, job: str) -> QueueEntry | None:
    if status is None:
        return None
    return next((q for q in status.queue if q.job_id == job), None)
