"""The durable state file: round trip, atomic replace, corrupt files, other nodes' files."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path

import pytest

from timeslice_agent import statefile
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.statefile import (
    AgentState,
    CorruptStateFile,
    StateFileError,
    StateStore,
    decode_state,
    encode_state,
    load_state,
    write_atomic,
)
from timeslice_proto.timeslice.v1 import AckStatus, DirectiveAck, StaleCause
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState


def _state() -> AgentState:
    return AgentState(
        node="node-a",
        epochs={"g1": 7, "g2": 3},
        jobs={
            "j1": Job(
                "j1",
                "g1",
                state=JobState.SAVED,
                residency=Residency.HOST,
                saved_bytes=5_000_000_000,
                saved_pids=(101, 102),
            ),
            "j2": Job("j2", "g2", state=JobState.FAULTED, reason="hook before_checkpoint failed"),
        },
        acks=[
            DirectiveAck(
                directive_id="d1",
                group_id="g1",
                epoch=7,
                status=AckStatus.OK,
                bytes_moved=5_000_000_000,
                elapsed_seconds=0.1,
                job_state=ProtoJobState.SAVED,
                emulated=True,
                started_at=1.5,
                finished_at=1.6,
            ),
            DirectiveAck(
                directive_id="d0",
                group_id="g1",
                epoch=6,
                status=AckStatus.STALE_EPOCH,
                stale_cause=StaleCause.NODE_FENCED,
            ),
        ],
    )


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, encode_state(_state()))
    loaded = load_state(path, "node-a")
    assert loaded is not None
    assert loaded.epochs == {"g1": 7, "g2": 3}
    assert loaded.jobs == _state().jobs
    assert [bytes(a) for a in loaded.acks] == [bytes(a) for a in _state().acks]
    doc = json.loads(path.read_text())
    assert doc["jobs"]["j1"]["state"] == "saved" and doc["version"] == 1
    # Nothing but the file itself is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_missing_file_is_a_fresh_start(tmp_path: Path) -> None:
    assert load_state(tmp_path / "nope.json", "node-a") is None


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b'{"version": 99, "node": "node-a"}',
        b'{"version": 1, "node": "node-a", "epochs": {"g": "seven"}}',
        b'{"version": 1, "node": "node-a", "jobs": {"j": {"group": "g", "state": "sleepy"}}}',
        b'{"version": 1, "node": "node-a", "acks": ["x"]}',
    ],
)
def test_corrupt_file_is_moved_aside(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(CorruptStateFile):
        decode_state(content)
    assert load_state(path, "node-a") is None
    assert not path.exists()
    assert (tmp_path / "state.json.corrupt").read_bytes() == content


def test_file_of_another_node_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, encode_state(_state()))
    with pytest.raises(StateFileError, match="belongs to node 'node-a'"):
        load_state(path, "node-b")
    assert path.exists()


async def test_store_writes_latest_snapshot_and_coalesces(tmp_path: Path) -> None:
    state = _state()
    calls = 0

    def snapshot() -> AgentState:
        nonlocal calls
        calls += 1
        return state

    store = StateStore(tmp_path / "s.json", snapshot)
    state.epochs["g1"] = 8
    await asyncio.gather(*(store.save() for _ in range(20)))
    assert calls < 20  # concurrent saves share writes
    loaded = load_state(tmp_path / "s.json", "node-a")
    assert loaded is not None and loaded.epochs["g1"] == 8


async def test_a_cancelled_save_does_not_land_after_a_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of a save whose caller was cancelled goes on in its thread; a later save
    must not overtake it, or the older snapshot lands last and puts the file back in time."""
    state = _state()
    state.epochs["g1"] = 1
    real = statefile._encode_and_write
    slow = [True]

    def write(path: Path, snapshot: AgentState, cache: statefile.AckEncodingCache) -> None:
        if slow.pop() if slow else False:
            time.sleep(0.5)
        real(path, snapshot, cache)

    monkeypatch.setattr(statefile, "_encode_and_write", write)
    store = StateStore(tmp_path / "s.json", lambda: copy.deepcopy(state))
    first = asyncio.create_task(store.save())
    await asyncio.sleep(0.1)  # its write is under way, slowly
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    state.epochs["g1"] = 2
    await store.save()
    await asyncio.sleep(0.6)  # past the slow write's end, whenever it ran
    loaded = load_state(tmp_path / "s.json", "node-a")
    assert loaded is not None and loaded.epochs["g1"] == 2
