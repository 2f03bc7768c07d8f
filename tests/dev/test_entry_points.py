"""Every entry point fails at start with one clear line (and a non-zero status) when an
address, a certificate path or a flag is wrong; none retries for ever in silence."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timeslice_tools.dev._procs import free_ports
from timeslice_tools.dev.certs import Pki

ORCHESTRATOR = [sys.executable, "-m", "timeslice_orchestrator"]
AGENT = [sys.executable, "-m", "timeslice_agent"]
CLI = [sys.executable, "-m", "timeslice_tools.cli"]


def run(argv: list[str], timeout: float = 60) -> tuple[int, list[str]]:
    """Exit status and the non-empty lines of stderr."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


def one_line(lines: list[str], *needles: str) -> str:
    """The one line of stderr (log lines of the start-up aside), containing every needle."""
    errors = [line for line in lines if " INFO " not in line and " WARNING " not in line]
    assert len(errors) == 1, lines
    assert all(n in errors[0] for n in needles), errors[0]
    assert "Traceback" not in "\n".join(lines), lines
    return errors[0]


def orchestrator_args(tmp: Path, *extra: str) -> list[str]:
    grpc, http = free_ports(2)
    return [
        *ORCHESTRATOR,
        "--listen", f"127.0.0.1:{grpc}",
        "--http", f"127.0.0.1:{http}",
        "--prefix", f"/timeslice/entry-{tmp.name}",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--insecure", "--bogus-flag"], ["unrecognized arguments: --bogus-flag", "--help"]),
        (["--insecure", "--listen", "a:b:c"], ["'a:b:c' is not HOST:PORT"]),
        (["--insecure", "--etcd", "127.0.0.1:0"], ["etcd endpoint", "port"]),
        (["--insecure", "--start-timeout", "-1"], ["--start-timeout"]),
        (["--tls-ca", "/nope/ca.crt"], ["go together"]),
    ],
)
def test_orchestrator_refuses_bad_flags_in_one_line(
    extra: list[str], needles: list[str], tmp_path: Path
) -> None:
    code, lines = run(orchestrator_args(tmp_path, *extra))
    assert code == 2
    one_line(lines, "timeslice orchestrator: error:", *needles)


def test_orchestrator_refuses_missing_certificate_files(tmp_path: Path, session_pki: Pki) -> None:
    pair = session_pki.orchestrator
    missing = tmp_path / "gone.key"
    tls = ["--tls-ca", str(session_pki.ca), "--tls-cert", str(pair.cert), "--tls-key", str(missing)]
    etcd = ["--etcd-ca", str(session_pki.ca), "--etcd-cert", str(pair.cert)]
    args = orchestrator_args(tmp_path, *tls, *etcd, "--etcd-key", str(pair.key))
    code, lines = run(args)
    assert code == 1
    one_line(lines, "timeslice orchestrator: error:", str(missing), "No such file")
    # A file that is there but is not a certificate.
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    args[args.index(str(missing))] = str(pair.key)
    args[args.index("--tls-cert") + 1] = str(garbage)
    code, lines = run(args)
    assert code == 1
    one_line(lines, "do not load", str(garbage))


def test_orchestrator_gives_up_on_an_unreachable_etcd_in_one_line(tmp_path: Path) -> None:
    (dead,) = free_ports(1)
    started = time.monotonic()
    code, lines = run(
        orchestrator_args(
            tmp_path, "--insecure", "--etcd", f"127.0.0.1:{dead}", "--start-timeout", "2"
        )
    )
    assert time.monotonic() - started < 30
    assert code == 1
    # It said what it waited for while it waited, then one line why it gave up.
    assert any("waiting for etcd" in line for line in lines), lines
    one_line(lines, "timeslice orchestrator: error: cannot start:", f"127.0.0.1:{dead}")


def test_orchestrator_log_level_is_honoured(tmp_path: Path) -> None:
    # The same start as above, at --log-level error: the warnings while it waits are not
    # written, the line saying why it gave up is.
    (dead,) = free_ports(1)
    extra = ["--etcd", f"127.0.0.1:{dead}", "--start-timeout", "2", "--log-level", "error"]
    code, lines = run(orchestrator_args(tmp_path, "--insecure", *extra))
    assert code == 1
    assert not any("waiting for etcd" in line for line in lines), lines
    one_line(lines, "timeslice orchestrator: error: cannot start:", f"127.0.0.1:{dead}")


def test_agent_without_a_backend_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    # No default backend: a GPU node started without one must not silently emulate.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    args = [*AGENT, "--orchestrator", "127.0.0.1:1", "--insecure"]
    args += ["--worker-socket", str(tmp_path / "w.sock")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, lines
    line = one_line(lines, "timeslice agent: error: --backend", "TIMESLICE_AGENT_BACKEND")
    assert all(kind in line for kind in ("sim", "freeze", "cuda", "app")), line
    assert not (tmp_path / "w.sock").exists()


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--http", "nowhere"], ["'nowhere' is not HOST:PORT"]),
        (["--orchestrator", "a:b:c"], ["'a:b:c'"]),
        (["--tls-ca", "/nope"], ["go together"]),
    ],
)
def test_agent_refuses_bad_flags_in_one_line(
    extra: list[str], needles: list[str], tmp_path: Path
) -> None:
    args = [*AGENT, "--orchestrator", "127.0.0.1:1", "--backend", "sim", "--insecure"]
    args += ["--worker-socket", str(tmp_path / "w.sock"), *extra]
    code, lines = run(args)
    assert code == 2
    one_line(lines, "timeslice agent: error:", *needles)


def test_agent_refuses_missing_certificate_files(tmp_path: Path, session_pki: Pki) -> None:
    node = session_pki.node("entry")
    missing = tmp_path / "gone.crt"
    args = [*AGENT, "--orchestrator", "127.0.0.1:1", "--node", "entry", "--backend", "sim"]
    args += ["--worker-socket", str(tmp_path / "w.sock"), "--tls-ca", str(session_pki.ca)]
    code, lines = run([*args, "--tls-cert", str(missing), "--tls-key", str(node.key)])
    assert code == 2
    one_line(lines, "timeslice-agent: error:", str(missing))


def test_cli_refuses_bad_flags_in_one_line() -> None:
    code, lines = run([*CLI, "status", "--bogus"])
    assert code == 2
    one_line(lines, "error: invalid_argument:", "--bogus", "--help")
    code, lines = run([*CLI, "status", "--target", "a:b:c"])
    assert code == 2
    one_line(lines, "'a:b:c'")
