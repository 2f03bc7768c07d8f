"""Process inspection (timeslice_agent.procs): /proc read right, including command names that
hold spaces and ')', and the real process tree of this test's own children."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from timeslice_agent.procs import (
    ProcessIdentity,
    ProcWalkTimeout,
    descendants_of,
    descends_from,
    identity_of,
    nspid_of,
    pid_exists,
    pid_namespace,
    process_state,
)


def _fake(
    proc: Path, pid: int, ppid: int, *, comm: str = "x", start: int = 100, uid: int = 1000
) -> None:
    """One process in a fake procfs: its stat (fields 3 to 22) and status lines."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    after = ["S", str(ppid), *["0"] * 17, str(start), "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(after)}\n")
    (proc / str(pid) / "status").write_text(
        f"Name:\t{comm}\nUid:\t{uid}\t{uid + 1}\t{uid}\t{uid}\nNSpid:\t{pid}\t7\n"
    )


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real child that spawns a grandchild, both sleeping until the test ends."""
    code = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        for pid in descendants_of(proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait(10)


def test_a_command_name_with_spaces_and_parens_does_not_shift_the_fields(tmp_path: Path) -> None:
    _fake(tmp_path, 42, 1, comm="a) b (c", start=777, uid=1000)
    assert identity_of(42, tmp_path) == ProcessIdentity(pid=42, start_time=777, uid=1000, euid=1001)
    assert nspid_of(42, tmp_path) == (42, 7)


def test_a_gone_or_unreadable_process_has_no_identity(tmp_path: Path) -> None:
    assert identity_of(42, tmp_path) is None
    assert identity_of(0, tmp_path) is None
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("43 (x) S\n")  # cut short
    (tmp_path / "43" / "status").write_text("Uid:\t1\t1\t1\t1\n")
    assert identity_of(43, tmp_path) is None
    assert nspid_of(44, tmp_path) is None


def test_a_kernel_without_nspid_gives_an_empty_tuple(tmp_path: Path) -> None:
    _fake(tmp_path, 42, 1)
    (tmp_path / "42" / "status").write_text("Name:\tx\nUid:\t0\t0\t0\t0\n")
    assert nspid_of(42, tmp_path) == ()


def test_ancestry_and_descendants_of_a_fake_tree(tmp_path: Path) -> None:
    for pid, ppid in ((10, 1), (11, 10), (12, 11), (13, 10), (20, 1)):
        _fake(tmp_path, pid, ppid)
    assert descends_from(12, 10, tmp_path)
    assert descends_from(10, 10, tmp_path)  # a process counts as its own
    assert not descends_from(20, 10, tmp_path)
    assert not descends_from(99, 10, tmp_path)  # gone
    assert descendants_of(10, tmp_path) == [11, 12, 13]
    assert descendants_of(20, tmp_path) == []
    assert descendants_of(10, tmp_path / "absent") == []


def test_a_cycle_in_a_corrupt_read_ends_the_walk_of_descendants(tmp_path: Path) -> None:
    _fake(tmp_path, 30, 31)
    _fake(tmp_path, 31, 30)
    assert descendants_of(30, tmp_path) == [31]


def test_a_walk_past_its_deadline_raises(tmp_path: Path) -> None:
    _fake(tmp_path, 10, 1)
    with pytest.raises(ProcWalkTimeout):
        descendants_of(1, tmp_path, deadline=time.monotonic() - 1)


def test_the_real_tree_of_a_child(child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while len(found := descendants_of(child.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    (grandchild,) = found
    assert descends_from(grandchild, os.getpid())
    assert {child.pid, grandchild} <= set(descendants_of(os.getpid()))
    me = identity_of(child.pid)
    assert me is not None and (me.uid, me.euid) == (os.getuid(), os.geteuid())
    assert pid_exists(child.pid) and process_state(child.pid) in {"S", "R"}
    assert pid_namespace(child.pid) == pid_namespace("self") is not None
    nspid = nspid_of(child.pid)
    assert nspid is not None and nspid[0] == child.pid


def test_a_reaped_or_zombie_process_does_not_exist() -> None:
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while process_state(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(proc.pid) == "Z"
    assert not pid_exists(proc.pid)  # exited, not yet reaped
    proc.wait(10)
    assert process_state(proc.pid) is None
    assert not pid_exists(proc.pid)
    assert not pid_exists(0) and not pid_exists(-1)
