"""The ``timeslice`` CLI: parsing, error format and exit codes, and the operator commands
against a real local orchestrator (real processes, gRPC over loopback)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from timeslice.errors import InvalidArgument
from timeslice.tls import CERT_ENV, KEY_ENV
from timeslice_proto.timeslice.v1 import (
    FaultedJob,
    GroupStatus,
    NodeResidency,
    QueueEntry,
    SwitchPhase,
    SwitchStatus,
)
from timeslice_tools import cli
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]
INSTALLED = Path(sys.executable).parent / "timeslice"


def run(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TIMESLICE, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def not_an_operator(pki: Pki) -> dict[str, str]:
    """The environment of a client whose certificate is a job's, not an operator's (the
    session's default certificate is an operator's: only a token can make this one one)."""
    pair = pki.job("cli-anyone")
    return {**os.environ, CERT_ENV: str(pair.cert), KEY_ENV: str(pair.key)}


@pytest.fixture(scope="module")
def cluster(session_pki: Pki) -> Iterator[LocalCluster]:
    # No agents: the operator commands only need the orchestrator's client API. TLS with the
    # session's certificates, which the commands find in $TIMESLICE_TLS_*.
    with LocalCluster(replicas=1, agents=0, tls=session_pki) as c:
        yield c


# -- parsing and errors (no orchestrator needed) ---------------------------------------------


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("dev", "orchestrator", "agent", "groups", "status", "acquire", "yield"):
        assert command in result.stdout


def test_installed_entry_point_runs() -> None:
    result = subprocess.run(
        [str(INSTALLED), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0
    assert "usage: timeslice" in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "the following arguments are required: COMMAND"),
        (("frob",), "invalid choice: 'frob'"),
        (("acquire", "g"), "no job: pass --job J or set TIMESLICE_JOB_ID"),
        (("yield", "g", "--job", "j", "--epoch", "0"), "'0' is not a valid epoch"),
        (("yield", "g", "--job", "j", "--epoch", "x"), "'x' is not an integer"),
        (("acquire", "g", "--job", "j", "--hold", "-1"), "'-1' must not be negative"),
        (("acquire", "g", "--job", "j", "--timeout", "0"), "'0' must be positive"),
        (("dev", "cluster", "--replicas", "0"), "'0' must be at least 1"),
        (("dev", "cluster", "--backend", "tpu"), "invalid choice: 'tpu'"),
        (("status", "bad group"), "group_id 'bad group' is not valid"),
        (("acquire", "g", "--job", "../x", "--hold", "0"), "job_id '../x' is not valid"),
        (("status", "g", "--target", "nonsense"), "target 'nonsense' is not HOST:PORT"),
        (("groups", "--target", "host:99999"), "target 'host:99999' is not HOST:PORT"),
        (("dev", "cluster", "--etcd", "http://"), "is not HOST:PORT"),
    ],
)
def test_bad_input_exits_2_with_a_typed_message(args: tuple[str, ...], expected: str) -> None:
    result = run(*args)
    assert result.returncode == 2, result
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: invalid_argument: "), result.stderr
    assert expected in last
    assert result.stdout == ""


def test_unreachable_orchestrator_exits_6() -> None:
    result = run("groups", "--target", "127.0.0.1:1,127.0.0.1:2")
    assert result.returncode == 6
    # One cause at every replica: named, with each address and what to do.
    assert result.stderr.startswith("error: unavailable: "), result.stderr
    assert "no orchestrator replica reachable: " in result.stderr, result.stderr
    assert "nothing listens on 127.0.0.1:1: is the orchestrator running" in result.stderr
    assert "nothing listens on 127.0.0.1:2" in result.stderr


def test_target_defaults_to_the_environment() -> None:
    env = dict(os.environ, TIMESLICE_TARGET="127.0.0.1:3")
    result = subprocess.run(
        [*TIMESLICE, "groups"], capture_output=True, text=True, env=env, timeout=30, check=False
    )
    assert result.returncode == 6
    assert "127.0.0.1:3" in result.stderr


def test_parse_targets_and_etcd() -> None:
    assert cli.parse_targets("a:1, b:2 ,[::1]:3") == [("a", 1), ("b", 2), ("::1", 3)]
    assert cli.parse_etcd("http://127.0.0.1:2379/,10.0.0.1:2380") == "127.0.0.1:2379,10.0.0.1:2380"
    for bad in (",", "a", "a:", ":1", "a:0", "a:b"):
        with pytest.raises(InvalidArgument):
            cli.parse_targets(bad)


def test_status_text_shows_everything_an_operator_needs() -> None:
    now = 1000.0
    status = GroupStatus(
        group_id="g",
        holder_job_id="a",
        holder_epoch=42,
        held_since=990.0,
        queue=[
            QueueEntry(job_id="c", priority=0, enqueued_at=999.0, revision=9),
            QueueEntry(job_id="b", priority=1, enqueued_at=995.0, revision=7),
        ],
        nodes=[
            NodeResidency(node="n1", resident_job_id="", backend="cuda"),
            NodeResidency("n0", "a"),
        ],
        switch=SwitchStatus(
            switch_id="s1",
            epoch=43,
            from_job_id="a",
            to_job_id="b",
            phase=SwitchPhase.CHECKPOINT,
            started_at=999.5,
        ),
        faulted=[FaultedJob(job_id="z", reason="restore failed on n1: out of memory")],
        last_error="restore failed on n1",
        switches=7,
        driver_replica="r0",
    )
    text = cli.format_status(cli.status_view(status, now))
    assert text.splitlines() == [
        "group g",
        "  holder:     a (epoch 42, held for 10.0 s)",
        "  queue:",
        "    1. b (priority 1, waiting 5.0 s)",
        "    2. c (priority 0, waiting 1.0 s)",
        "  nodes:",
        "    n0: a  [no agent]",
        "    n1: (nothing resident)  [cuda]",
        "  switch:     a -> b, phase checkpoint, 0.5 s in (epoch 43, id s1)",
        "  faulted:",
        "    z: restore failed on n1: out of memory",
        "  last error: restore failed on n1",
        "  switches:   7",
        "  driver:     r0",
    ]
    empty = cli.format_status(cli.status_view(GroupStatus(group_id="h"), now))
    assert "  holder:     none" in empty
    assert "  queue:      empty" in empty
    assert "  switch:     none in flight" in empty


# -- against a real orchestrator -------------------------------------------------------------


def test_groups_and_status_on_an_empty_cluster(cluster: LocalCluster) -> None:
    result = run("groups", "--target", cluster.target)
    assert result.returncode == 0
    assert result.stdout == ""
    assert "no groups" in result.stderr
    result = run("groups", "--json", "--target", cluster.target)
    assert json.loads(result.stdout) == []
    result = run("status", "no-such-group", "--target", cluster.target)
    assert result.returncode == 3
    assert result.stderr.startswith("error: not_found: ")


def test_acquire_hold_and_yield(cluster: LocalCluster) -> None:
    result = run(
        "acquire",
        "cli-g1",
        "--job",
        "cli-a",
        "--hold",
        "0",
        "--allow-unknown",
        "--target",
        cluster.target,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("granted epoch=") and " waited=" in lines[0]
    assert lines[1:] == ["yielded"]
    status = json.loads(run("status", "cli-g1", "--json", "--target", cluster.target).stdout)
    assert status["group_id"] == "cli-g1"
    assert status["holder_job_id"] == ""


class Acquirer:
    """A ``timeslice acquire`` process whose stdout lines are read with deadlines."""

    def __init__(self, cluster: LocalCluster, group: str, job: str) -> None:
        self.group = group
        self.proc = subprocess.Popen(
            [
                *TIMESLICE,
                "acquire",
                group,
                "--job",
                job,
                "--allow-unknown",
                "--target",
                cluster.target,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, timeout: float = 20) -> str | None:
        """The next stdout line (None at end of output); fails after ``timeout`` seconds."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"timeslice acquire printed nothing within {timeout} s")

    def finish(self, timeout: float = 20) -> tuple[list[str], str, int]:
        """Wait for exit; the remaining stdout lines, stderr and the exit status.

        The module's cluster has no agents, so no node serves any group: a grant's warning
        that says so (docs/groups.md) is left out of the stderr returned."""
        code = self.proc.wait(timeout=timeout)
        rest = []
        while (line := self.line()) is not None:
            rest.append(line)
        assert self.proc.stderr is not None
        stderr = self.proc.stderr.read()
        warning = f"warning: group {self.group} is not known: no node serves it"
        lines = stderr.splitlines(keepends=True)
        return rest, "".join(line for line in lines if not line.startswith(warning)), code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _status(cluster: LocalCluster, group: str) -> dict[str, object]:
    result = run("status", group, "--json", "--target", cluster.target)
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _wait_for(predicate: object, timeout: float = 10) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_holder_queue_operator_yield_and_interrupts(cluster: LocalCluster) -> None:
    group = "cli-g2"
    holder = Acquirer(cluster, group, "cli-holder")
    try:
        granted = holder.line()
        assert granted is not None and granted.startswith("granted epoch=")
        epoch = int(granted.split()[1].split("=")[1])
        waiter = Acquirer(cluster, group, "cli-waiter")
        try:
            _wait_for(lambda: _status(cluster, group)["queue"])
            text = run("status", group, "--target", cluster.target).stdout
            assert f"holder:     cli-holder (epoch {epoch}, held for" in text
            assert "1. cli-waiter (priority 0, waiting" in text
            groups = run("groups", "--target", cluster.target).stdout
            assert f"{group}  holder=cli-holder  queue=1  switching=no" in groups.splitlines()

            # Without the operator token (or certificate) the yield is refused, whatever the
            # epoch.
            assert cluster.pki is not None
            plain = not_an_operator(cluster.pki)
            anyone = run("yield", group, "--job", "cli-holder", "--epoch", str(epoch),
                         "--target", cluster.target, env=plain)  # fmt: skip
            assert anyone.returncode == 7
            assert anyone.stderr.startswith("error: permission_denied: Yield needs an operator")
            assert _status(cluster, group)["holder_job_id"] == "cli-holder"
            # A stale epoch changes nothing; the right one releases the hold without a session.
            token = str(cluster.operator_token_file)
            stale = run("yield", group, "--job", "cli-holder", "--epoch", str(epoch - 1),
                        "--target", cluster.target, "--token-file", token, env=plain)  # fmt: skip
            assert stale.returncode == 4
            assert stale.stderr.startswith("error: not_holder: ")
            assert _status(cluster, group)["holder_job_id"] == "cli-holder"
            ok = run("yield", group, "--job", "cli-holder", "--epoch", str(epoch),
                     "--target", cluster.target, "--token-file", token, env=plain)  # fmt: skip
            assert ok.returncode == 0 and ok.stdout == "yielded\n"
            line = waiter.line()
            assert line is not None and line.startswith("granted epoch=")

            # SIGINT during the hold yields and exits 0.
            waiter.proc.send_signal(signal.SIGINT)
            assert waiter.finish() == (["yielded"], "", 0)
        finally:
            waiter.kill()
    finally:
        holder.kill()


def test_interrupt_while_waiting_leaves_the_queue(cluster: LocalCluster) -> None:
    group = "cli-g3"
    holder = Acquirer(cluster, group, "cli-h3")
    try:
        line = holder.line()
        assert line is not None and line.startswith("granted epoch=")
        waiter = Acquirer(cluster, group, "cli-w3")
        try:
            _wait_for(lambda: _status(cluster, group)["queue"])
            waiter.proc.send_signal(signal.SIGTERM)
            out, err, code = waiter.finish()
            assert (out, code) == ([], 1)
            assert err.strip().splitlines()[-1] == (
                f"error: cancelled: interrupted while waiting for {group}"
            )
        finally:
            waiter.kill()
        _wait_for(lambda: not _status(cluster, group)["queue"])
        assert _status(cluster, group)["holder_job_id"] == "cli-h3"
        holder.proc.send_signal(signal.SIGTERM)
        assert holder.finish() == (["yielded"], "", 0)
    finally:
        holder.kill()


def test_acquire_timeout_is_a_typed_error(cluster: LocalCluster) -> None:
    group = "cli-g4"
    holder = Acquirer(cluster, group, "cli-h4")
    try:
        line = holder.line()
        assert line is not None and line.startswith("granted epoch=")
        started = time.monotonic()
        result = run("acquire", group, "--job", "cli-w4", "--allow-unknown", "--timeout", "0.5",
                     "--target", cluster.target)  # fmt: skip
        assert time.monotonic() - started < 15
        assert result.returncode == 5
        assert result.stderr.startswith("error: timeout: "), result.stderr
        assert not _status(cluster, group)["queue"]
        holder.proc.send_signal(signal.SIGTERM)
        assert holder.finish() == (["yielded"], "", 0)
    finally:
        holder.kill()


def test_members_needs_the_operator_token_and_a_known_node(cluster: LocalCluster) -> None:
    # Runs last: it creates a group in the module's cluster.
    target = ("--target", cluster.target)
    assert cluster.pki is not None
    plain = not_an_operator(cluster.pki)
    anyone = run("members", "cli-pinned", "--clear", *target, env=plain)
    assert anyone.returncode == 7
    assert anyone.stderr.startswith("error: permission_denied: SetGroupMembers needs an operator")
    wrong = subprocess.run(
        [*TIMESLICE, "members", "cli-pinned", "--clear", *target],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**plain, "TIMESLICE_OPERATOR_TOKEN": "not-the-token"},
    )
    assert wrong.returncode == 7 and "permission_denied" in wrong.stderr
    # The token from the environment (a file), then from the flag.
    by_env = subprocess.run(
        [*TIMESLICE, "members", "cli-pinned", "--clear", *target],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**plain, "TIMESLICE_OPERATOR_TOKEN_FILE": str(cluster.operator_token_file)},
    )
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout == "cli-pinned: pinned nodes (none: registrations only)\n"
    token = ("--token-file", str(cluster.operator_token_file))
    ghost = run("members", "cli-pinned", "--set", "node-ghost", *target, *token, env=plain)
    assert ghost.returncode == 1
    assert ghost.stderr.startswith("error: failed_precondition: cannot pin node(s) node-ghost")
    # An operator's certificate needs no token (the session's default certificate is one).
    by_cert = run("members", "cli-pinned", "--clear", *target)
    assert by_cert.returncode == 0, by_cert.stderr
