"""The ``timeslice`` CLI in scripts and terminals: ``--version`` on every entry point, a
description and an example on every subcommand, exit statuses that tell failures apart,
``--json`` results and JSON errors, ``q`` quitting ``top``, and every node's backend (emulated
ones labelled) in ``status`` and ``top``. Real processes: the CLI in a subprocess against a
real orchestrator, etcd and sim agent over TLS."""

from __future__ import annotations

import argparse
import errno
import json
import os
import pty
import select
import subprocess
import sys
import termios
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from timeslice.cli import build_parser as sdk_parser
from timeslice.cli.base import EXIT_CODES, ExitCode, exit_code
from timeslice.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    Timeout,
    TimeSliceError,
    Unauthenticated,
    Unavailable,
)
from timeslice_tools.cli import build_parser as tools_parser
from timeslice_tools.dev._procs import free_ports
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]
INSTALLED = Path(sys.executable).parent / "timeslice"
ROOT = Path(__file__).resolve().parents[2]
# Generous: a loaded 2-core machine starts a Python process with gRPC in seconds.
DEADLINE = 30.0


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TIMESLICE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def run_many(*argvs: list[str], timeout: float = 60) -> list[subprocess.CompletedProcess[str]]:
    """Each full ``argv`` run at once (every start costs a second or more on a loaded machine)."""
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    results = []
    for argv, proc in zip(argvs, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return results


def json_error(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    """The one JSON object a failed ``--json`` command wrote on stderr (nothing on stdout)."""
    assert result.stdout == "", result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    document: dict[str, object] = json.loads(lines[0])
    assert set(document) == {"error", "message", "exit_code"}, document
    assert document["exit_code"] == result.returncode
    return document


@pytest.fixture(scope="module")
def cluster(session_pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # One sim agent (node-0): its registration is where a node's backend comes from.
    with LocalCluster(
        replicas=1,
        agents=1,
        backend="sim",
        tls=session_pki,
        base_dir=tmp_path_factory.mktemp("cli-shell"),
    ) as c:
        yield c


# -- no orchestrator needed ------------------------------------------------------------------


def test_version_on_every_entry_point() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    entry_points = [
        [str(INSTALLED)],
        TIMESLICE,
        [sys.executable, "-m", "timeslice.cli"],
        [sys.executable, "-m", "timeslice_orchestrator"],
        [sys.executable, "-m", "timeslice_agent"],
    ]
    for argv, result in zip(
        entry_points, run_many(*([*argv, "--version"] for argv in entry_points)), strict=True
    ):
        assert result.returncode == 0, (argv, result.stderr)
        assert result.stdout.startswith(f"timeslice {version} ("), (argv, result.stdout)
        assert result.stdout.count("\n") == 1, result.stdout


def _subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


@pytest.mark.parametrize("build", [sdk_parser, tools_parser], ids=["timeslice.cli", "tools"])
def test_every_subcommand_has_a_description_and_an_example(
    build: Callable[[], argparse.ArgumentParser],
) -> None:
    found = list(_subcommands(build()))
    assert len(found) >= 7
    missing = []
    for path, parser in found:
        command = " ".join(path)
        if not (parser.description or "").strip():
            missing.append(f"{command}: no description")
        examples = [
            line
            for line in (parser.epilog or "").splitlines()
            if line.strip().startswith(f"timeslice {command}")
        ]
        if "examples:" not in (parser.epilog or "") or not examples:
            missing.append(f"{command}: no example (an epilog 'examples:' with the command)")
    assert not missing, "\n".join(missing)


def test_exit_codes_map_by_error_class() -> None:
    class Refused(Unavailable):
        """As a more precise connection error (a subclass) would be."""

    class BadCertPath(InvalidArgument):
        pass

    cases: list[tuple[TimeSliceError, ExitCode]] = [
        (InvalidArgument("x"), ExitCode.USAGE),
        (BadCertPath("x"), ExitCode.USAGE),
        (NotFound("x"), ExitCode.NOT_FOUND),
        (NotHolder("x"), ExitCode.NOT_HOLDER),
        (Timeout("x"), ExitCode.TIMEOUT),
        (Unavailable("x"), ExitCode.UNREACHABLE),
        (Refused("x"), ExitCode.UNREACHABLE),
        (PermissionDenied("x"), ExitCode.DENIED),
        (Unauthenticated("x"), ExitCode.DENIED),
        (AlreadyExists("x"), ExitCode.FAILURE),
    ]
    for error, code in cases:
        assert exit_code(error) is code, error
    # The numbers are an interface (docs/dashboard.md): changing one breaks scripts.
    assert {code.name: int(code) for code in ExitCode} == {
        "OK": 0,
        "FAILURE": 1,
        "USAGE": 2,
        "NOT_FOUND": 3,
        "NOT_HOLDER": 4,
        "TIMEOUT": 5,
        "UNREACHABLE": 6,
        "DENIED": 7,
    }
    # Every code but OK and FAILURE is some error's, and the codes are distinct.
    assert {code for _, code in EXIT_CODES} == set(ExitCode) - {ExitCode.OK, ExitCode.FAILURE}
    assert len({int(code) for code in ExitCode}) == len(ExitCode)


def test_usage_and_unreachable_exit_codes_with_json_errors() -> None:
    (port,) = free_ports(1)  # nothing listens there
    unreachable = [("groups",), ("status", "g"), ("top",), ("plan",)]
    bad, flag, text, *results = run_many(
        [*TIMESLICE, "status", "bad group", "--json"],
        [*TIMESLICE, "groups", "--json", "--no-such-flag"],
        [*TIMESLICE, "groups", "--target", f"127.0.0.1:{port}"],
        *([*TIMESLICE, *args, "--json", "--target", f"127.0.0.1:{port}"] for args in unreachable),
    )
    assert bad.returncode == 2
    assert json_error(bad)["error"] == "invalid_argument"
    assert flag.returncode == 2
    assert "--no-such-flag" in str(json_error(flag)["message"])
    assert text.returncode == 6
    assert text.stderr.startswith("error: unavailable: ")
    for args, result in zip(unreachable, results, strict=True):
        assert result.returncode == 6, (args, result.stderr)
        error = json_error(result)
        assert error["error"] == "unavailable"
        assert f"127.0.0.1:{port}" in str(error["message"])


def test_dev_certs_json_lists_the_files(tmp_path: Path) -> None:
    result = run("dev", "certs", "--out", str(tmp_path / "pki"), "--jobs", "a", "--json")
    assert result.returncode == 0, result.stderr
    paths = json.loads(result.stdout)
    assert str(tmp_path / "pki" / "ca.crt") in paths
    assert all(Path(p).is_file() for p in paths)
    again = run("dev", "certs", "--out", str(tmp_path / "pki"), "--json")
    assert again.returncode == 2
    assert "already holds a CA" in str(json_error(again)["message"])


# -- against a real cluster ------------------------------------------------------------------


def test_not_found_not_holder_and_timeout_exit_codes(cluster: LocalCluster) -> None:
    target = ("--target", cluster.target)
    missing = run("status", "shell-no-such-group", "--json", *target)
    assert missing.returncode == 3
    assert json_error(missing)["error"] == "not_found"

    # acquire --json: one object per event.
    held = run(
        "acquire",
        "shell-g",
        "--job",
        "shell-a",
        "--allow-unknown",
        "--hold",
        "0",
        "--json",
        *target,
    )
    assert held.returncode == 0, held.stderr
    events = [json.loads(line) for line in held.stdout.splitlines()]
    assert [e["event"] for e in events] == ["granted", "yielded"]
    assert events[0]["group_id"] == "shell-g" and events[0]["job_id"] == "shell-a"
    assert events[0]["epoch"] > 0 and events[0]["waited_seconds"] >= 0

    holder = subprocess.Popen(
        [
            *TIMESLICE,
            "acquire",
            "shell-g",
            "--job",
            "shell-h",
            "--allow-unknown",
            "--json",
            *target,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        granted = json.loads(holder.stdout.readline())
        assert granted["event"] == "granted", granted
        # A yield under an epoch the job does not hold changes nothing: not holder.
        stale = run("yield", "shell-g", "--job", "shell-h", "--epoch",
                    str(granted["epoch"] + 1000), "--json", *target)  # fmt: skip
        assert stale.returncode == 4, stale.stderr
        assert json_error(stale)["error"] == "not_holder"
        text = run("yield", "shell-g", "--job", "shell-h", "--epoch",
                   str(granted["epoch"] + 1000), *target)  # fmt: skip
        assert text.returncode == 4 and text.stderr.startswith("error: not_holder: ")
        # Another job waits with a short timeout while shell-h holds: timeout.
        started = time.monotonic()
        waited = run("acquire", "shell-g", "--job", "shell-w", "--allow-unknown",
                     "--timeout", "0.5", "--json", *target)  # fmt: skip
        assert time.monotonic() - started < DEADLINE
        assert waited.returncode == 5, waited.stderr
        assert json_error(waited)["error"] == "timeout"
        status = json.loads(run("status", "shell-g", "--json", *target).stdout)
        assert status["holder_job_id"] == "shell-h" and status["queue"] == []
        # The operator yield with the right epoch, as JSON.
        ok = run("yield", "shell-g", "--job", "shell-h", "--epoch", str(granted["epoch"]),
                 "--json", *target)  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout) == {
            "group_id": "shell-g",
            "job_id": "shell-h",
            "epoch": granted["epoch"],
            "yielded": True,
        }
    finally:
        holder.kill()
        holder.communicate(timeout=DEADLINE)


def test_status_and_top_show_each_nodes_backend(cluster: LocalCluster) -> None:
    target = ("--target", cluster.target)
    (node,) = cluster.agent_sockets
    pinned = run("members", "shell-b", "--set", node, "--json", *target)
    assert pinned.returncode == 0, pinned.stderr
    assert json.loads(pinned.stdout) == {"group_id": "shell-b", "static_members": [node]}

    text, as_json, once, snapshot_run, groups_run = run_many(
        [*TIMESLICE, "status", "shell-b", *target],
        [*TIMESLICE, "status", "shell-b", "--json", *target],
        [*TIMESLICE, "top", "--once", *target],
        [*TIMESLICE, "top", "--json", *target],
        [*TIMESLICE, "groups", "--json", *target],
    )
    assert text.returncode == 0, text.stderr
    assert f"    {node}: (nothing resident)  [sim, emulated]" in text.stdout.splitlines()
    status = json.loads(as_json.stdout)
    assert status["node_backends"] == {node: {"backend": "sim", "emulated": True}}

    assert once.returncode == 0, once.stderr
    assert f"{node}=- (sim, emulated)" in once.stdout
    assert "emulated: those nodes only model data movement" in once.stdout
    snapshot = json.loads(snapshot_run.stdout)
    shown = {g["group_id"]: g for g in snapshot["groups"]}
    assert shown["shell-b"]["node_backends"] == {node: {"backend": "sim", "emulated": True}}

    groups = json.loads(groups_run.stdout)
    assert "shell-b" in {g["group_id"] for g in groups}
    assert run("members", "shell-b", "--clear", *target).returncode == 0


def _read(fd: int, until: float) -> bytes:
    """What the pty has to read within the time left (b"" once the other side closed)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, until - time.monotonic()))
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError as exc:  # EIO: the child closed its side
        if exc.errno != errno.EIO:
            raise
        return b""


def test_q_quits_top_in_a_terminal(cluster: LocalCluster) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*TIMESLICE, "top", "--interval", "0.2", "--target", cluster.target],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    seen = b""
    try:
        deadline = time.monotonic() + 60  # the first frame: a Python start on a loaded machine
        while b"timeslice top" not in seen and time.monotonic() < deadline:
            seen += _read(master, deadline)
        assert b"timeslice top" in seen, seen.decode(errors="replace")
        # The terminal is in cbreak mode while top runs: no Enter needed after q.
        assert not termios.tcgetattr(slave)[3] & termios.ICANON
        sent = time.monotonic()
        os.write(master, b"q")
        while proc.poll() is None and time.monotonic() < sent + 10:
            _read(master, time.monotonic() + 0.2)  # keep draining, or top blocks on writes
        printed = seen.decode(errors="replace")
        assert proc.poll() == 0, f"top did not quit on q; it printed:\n{printed}"
        # ... and the terminal is given back as it was.
        assert termios.tcgetattr(slave)[3] & termios.ICANON
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=DEADLINE)
        os.close(master)
        os.close(slave)


def test_dev_cluster_json_is_one_ready_object_then_stopped(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*TIMESLICE, "dev", "cluster", "--no-tls", "--agents", "0", "--json",
         "--base-dir", str(tmp_path / "cluster")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # the one line, once the cluster serves
        assert ready["event"] == "ready" and ready["tls"] is False
        assert ready["env"]["TIMESLICE_TARGET"] == ready["target"]
        assert set(ready["pids"]) == {"etcd", "r0"}, ready["pids"]
        assert Path(ready["logs"]).is_dir()
        # The environment it gives is enough for a client.
        groups = subprocess.run(
            [*TIMESLICE, "groups", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, **ready["env"]},
        )
        assert groups.returncode == 0, groups.stderr
        assert json.loads(groups.stdout) == []
        proc.terminate()
        out, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0, err
        assert [json.loads(line) for line in out.splitlines()] == [{"event": "stopped"}]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=DEADLINE)
