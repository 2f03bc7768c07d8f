"""Free ports for dev clusters: each pytest-xdist worker picks from its own slice, below the
kernel's ephemeral range, so parallel workers never pick the same port and race to bind it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from timeslice_tools.dev import _procs


def picked(monkeypatch: pytest.MonkeyPatch, worker: str, count: int) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run-1234")
    return [p for _ in range(count) for p in _procs.free_ports(2)]


def test_workers_of_one_run_never_share_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    by_worker = {w: set(picked(monkeypatch, w, 20)) for w in ("gw0", "gw1", "gw2", "gw3")}
    for w, ports in by_worker.items():
        assert len(ports) == 40, f"{w} was handed a port twice"
        others = set().union(*(p for v, p in by_worker.items() if v != w))
        assert not ports & others, f"{w} shares ports with another worker"
        assert all(p < _procs._ephemeral_low() for p in ports), "ephemeral ports handed out"


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    start = _procs._slice_start()
    cursor = _procs._cursor.get(start, 0)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", start + cursor))
        blocker.listen()
        ports = _procs.free_ports(1)
    assert ports != [start + cursor]


def _slice_of(port: int) -> int:
    return (port - _procs._PORT_FLOOR) // _procs._SLICE


def test_another_process_with_the_same_slot_gets_another_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second run (or a benchmark beside a test run) whose worker would prefer the same
    slice takes the next free one: the slice is claimed for as long as its process lives."""
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw9", "PYTEST_XDIST_TESTRUNUID": "run-77"}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from timeslice_tools.dev import _procs;"
            "print(_procs.free_ports(1)[0], flush=True); sys.stdin.read()",
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        theirs = int(holder.stdout.readline())
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw9")
        monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run-77")
        mine = _procs.free_ports(1)[0]
        assert _slice_of(mine) != _slice_of(theirs), (mine, theirs)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
