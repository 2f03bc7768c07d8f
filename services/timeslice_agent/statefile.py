"""The agent's durable state: a small JSON file written atomically after every change.

It keeps what a restarted agent must not forget:

- the highest epoch accepted per group (fencing must survive restarts);
- every known job: group, state, where its device state lives, bytes and pids of its last
  checkpoint, fault reason (jobs parked on the host stay SAVED across a restart);
- the acks of recent directives, so a directive re-sent after a restart is answered from
  memory instead of being executed twice.

Writes go to a temporary file in the same directory, are fsynced, then ``os.replace``-d over
the old file and the directory is fsynced: a crash leaves either the old or the new file, never
a torn one. A file that cannot be parsed is moved aside to ``<file>.corrupt`` and the agent
starts empty; a file written for another node is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timeslice.tasks import run_to_completion
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.procs import ProcessIdentity
from timeslice_proto.timeslice.v1 import AckStatus, DirectiveAck, StaleCause
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# A state write slower than this is logged: every directive ack waits for it.
SLOW_WRITE_SECONDS = 1.0


class StateFileError(Exception):
    """The state file exists but must not be used (for example it belongs to another node)."""


class CorruptStateFile(ValueError):
    """The state file's content is not a valid agent state."""


class StateWriteError(OSError):
    """The state could not be made durable."""


@dataclass
class AgentState:
    """What the state file holds."""

    node: str
    epochs: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    acks: list[DirectiveAck] = field(default_factory=list)
    # The orchestrator fenced this node out at this revision: no directive below it may act.
    fence_revision: int = 0


def _job_to_json(job: Job) -> dict[str, Any]:
    return {
        "group": job.group_id,
        "state": job.state.value,
        "residency": job.residency.value,
        "saved_bytes": job.saved_bytes,
        "saved_pids": list(job.saved_pids),
        # [pid, start time, uid, euid]: a restarted agent resumes only these very processes.
        "saved_identities": [[i.pid, i.start_time, i.uid, i.euid] for i in job.saved_identities],
        "reason": job.reason,
    }


def _expect(value: object, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptStateFile(f"{what} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _job_from_json(job_id: str, raw: object) -> Job:
    data = _expect(raw, dict, f"job {job_id}")
    try:
        state = JobState(_expect(data["state"], str, "state"))
        residency = Residency(_expect(data.get("residency", "device"), str, "residency"))
    except (KeyError, ValueError) as exc:
        raise CorruptStateFile(f"job {job_id}: {exc}") from None
    pids = [_expect(p, int, "pid") for p in _expect(data.get("saved_pids", []), list, "saved_pids")]
    identities = []
    for raw_identity in _expect(data.get("saved_identities", []), list, "saved_identities"):
        fields = [
            _expect(v, int, "identity field") for v in _expect(raw_identity, list, "identity")
        ]
        if len(fields) != 4:
            raise CorruptStateFile(f"job {job_id}: an identity needs 4 numbers, got {fields}")
        identities.append(ProcessIdentity(*fields))
    return Job(
        job_id=job_id,
        group_id=_expect(data.get("group"), str, "group"),
        state=state,
        residency=residency,
        reason=_expect(data.get("reason", ""), str, "reason"),
        saved_bytes=_expect(data.get("saved_bytes", 0), int, "saved_bytes"),
        saved_pids=tuple(pids),
        saved_identities=tuple(identities),
    )


def _ack_to_json(ack: DirectiveAck) -> dict[str, Any]:
    # Written by hand: betterproto's to_dict costs ~0.3 ms per message, far too slow for a
    # file rewritten after every directive with up to 1024 acks in it.
    return {
        "id": ack.directive_id,
        "group": ack.group_id,
        "epoch": ack.epoch,
        "status": ack.status.name,
        "error": ack.error,
        "bytes": ack.bytes_moved,
        "skipped": ack.bytes_skipped,
        "moved": ack.moved,
        "elapsed": ack.elapsed_seconds,
        "job_state": ack.job_state.name,
        "emulated": ack.emulated,
        "started_at": ack.started_at,
        "finished_at": ack.finished_at,
        # Which fence a STALE_EPOCH hit: a re-send answered after a restart says it again.
        "stale_cause": ack.stale_cause.name,
    }


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CorruptStateFile(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


def _ack_from_json(raw: object) -> DirectiveAck:
    data = _expect(raw, dict, "ack")
    try:
        status = AckStatus[_expect(data["status"], str, "ack status")]
        job_state = ProtoJobState[_expect(data.get("job_state", "UNSPECIFIED"), str, "job_state")]
        # Absent in files written before the cause was kept.
        cause = _expect(data.get("stale_cause", "UNSPECIFIED"), str, "ack stale_cause")
        stale_cause = StaleCause[cause]
    except KeyError as exc:
        raise CorruptStateFile(f"bad ack record: unknown or missing {exc}") from None
    return DirectiveAck(
        directive_id=_expect(data.get("id"), str, "ack id"),
        group_id=_expect(data.get("group", ""), str, "ack group"),
        epoch=_expect(data.get("epoch", 0), int, "ack epoch"),
        status=status,
        error=_expect(data.get("error", ""), str, "ack error"),
        bytes_moved=_expect(data.get("bytes", 0), int, "ack bytes"),
        bytes_skipped=_expect(data.get("skipped", 0), int, "ack skipped bytes"),
        moved=_expect(data.get("moved", False), bool, "ack moved"),
        elapsed_seconds=_number(data.get("elapsed", 0.0), "ack elapsed"),
        job_state=job_state,
        emulated=_expect(data.get("emulated", False), bool, "ack emulated"),
        started_at=_number(data.get("started_at", 0.0), "ack started_at"),
        finished_at=_number(data.get("finished_at", 0.0), "ack finished_at"),
        stale_cause=stale_cause,
    )


class AckEncodingCache:
    """Remembers the JSON text of acks already written: acks never change once made, and the
    file is rewritten after every directive, so each ack is encoded once, not 1024 times."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._texts: dict[str, tuple[DirectiveAck, str]] = {}

    def text(self, ack: DirectiveAck) -> str:
        hit = self._texts.get(ack.directive_id)
        if hit is not None and hit[0] is ack:
            return hit[1]
        text = json.dumps(_ack_to_json(ack), separators=(",", ":"))
        if len(self._texts) >= self._size:
            # Insertion order approximates age; the oldest half goes.
            for key in list(self._texts)[: self._size // 2]:
                del self._texts[key]
        self._texts[ack.directive_id] = (ack, text)
        return text


def encode_state(state: AgentState, cache: AckEncodingCache | None = None) -> bytes:
    """Serialise ``state`` to the file format."""
    doc = {
        "version": SCHEMA_VERSION,
        "node": state.node,
        "epochs": dict(sorted(state.epochs.items())),
        "fence_revision": state.fence_revision,
        "jobs": {job_id: _job_to_json(job) for job_id, job in sorted(state.jobs.items())},
    }
    head = json.dumps(doc, separators=(",", ":"))
    encode = (cache or AckEncodingCache()).text
    acks = ",".join(encode(ack) for ack in state.acks)
    # The document ends with "}": splice the pre-encoded ack list in before it.
    return (f'{head[:-1]},"acks":[{acks}]}}\n').encode()


def decode_state(data: bytes) -> AgentState:
    """Parse the file format; raises :class:`CorruptStateFile` on anything unexpected."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStateFile(f"not JSON: {exc}") from None
    doc = _expect(doc, dict, "document")
    if doc.get("version") != SCHEMA_VERSION:
        raise CorruptStateFile(f"unsupported schema version {doc.get('version')!r}")
    node = _expect(doc.get("node"), str, "node")
    epochs: dict[str, int] = {}
    for group, epoch in _expect(doc.get("epochs", {}), dict, "epochs").items():
        epochs[str(group)] = _expect(epoch, int, f"epoch of {group}")
    jobs = {
        str(job_id): _job_from_json(str(job_id), raw)
        for job_id, raw in _expect(doc.get("jobs", {}), dict, "jobs").items()
    }
    acks = [_ack_from_json(raw) for raw in _expect(doc.get("acks", []), list, "acks")]
    fence_revision = _expect(doc.get("fence_revision", 0), int, "fence_revision")
    return AgentState(node=node, epochs=epochs, jobs=jobs, acks=acks, fence_revision=fence_revision)


_TMP_SEQ = itertools.count()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash never leaves a torn file (blocking)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per write: two writes at once (one whose caller was cancelled, say)
    # never share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_TMP_SEQ)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only file system refuses even this (EROFS): nothing to remove there
        raise StateWriteError(f"cannot write state file {path}: {exc}") from exc


def _encode_and_write(path: Path, state: AgentState, cache: AckEncodingCache) -> None:
    write_atomic(path, encode_state(state, cache))


def load_state(path: Path, node: str) -> AgentState | None:
    """Read the state file (blocking).

    Returns None when there is none, or when it was corrupt (then it is moved aside to
    ``<file>.corrupt`` and the reason logged). Raises :class:`StateFileError` when it belongs
    to another node: silently discarding its epochs would weaken fencing.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        state = decode_state(data)
    except CorruptStateFile as exc:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        log.error(
            "state file %s is corrupt (%s); moved aside to %s, starting empty", path, exc, aside
        )
        return None
    if state.node != node:
        raise StateFileError(
            f"state file {path} belongs to node {state.node!r}, not {node!r}; "
            "pass --state-file for this node or remove the file"
        )
    return state


class StateStore:
    """Writes snapshots of the agent's state, off the event loop, newest wins.

    ``save()`` returns once a snapshot taken after the call started is on disk; concurrent
    callers share writes, so a burst of changes costs few fsyncs.
    """

    def __init__(self, path: Path, snapshot: Callable[[], AgentState]) -> None:
        self._path = path
        self._snapshot = snapshot
        self._lock = asyncio.Lock()
        self._requested = 0
        self._written = 0
        # Used only by the writer thread, one write at a time (under the lock).
        self._cache = AckEncodingCache()

    @property
    def path(self) -> Path:
        return self._path

    async def save(self) -> None:
        """Make the current state durable; raises :class:`StateWriteError` on failure."""
        self._requested += 1
        wanted = self._requested
        async with self._lock:
            if self._written >= wanted:
                return
            generation = self._requested
            # The snapshot is taken here, on the loop, so it is consistent; encoding and I/O
            # run in a thread (acks are never mutated after creation, jobs are copies).
            snapshot = self._snapshot()
            started = time.monotonic()
            # Run to its end even if our caller is cancelled: the lock is held until then,
            # so a later snapshot's write never lands before this older one (which would put
            # the file back in time).
            await run_to_completion(
                asyncio.to_thread(_encode_and_write, self._path, snapshot, self._cache)
            )
            took = time.monotonic() - started
            if took >= SLOW_WRITE_SECONDS:
                # Every ack waits for this write (acks are durable before they are sent): a
                # directive that seems lost to the orchestrator is explained here.
                log.warning("state file %s: the write took %.1f s (slow disk)", self._path, took)
            self._written = generation
