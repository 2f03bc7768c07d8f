"""Fixtures of the SDK tests: a fake orchestrator (and agent) on a background loop thread."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sdk.fakes import FakeOrchestrator, LoopThread
from timeslice.tls import TlsFiles
from timeslice_tools.dev.certs import Pki


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def orch(loop_thread: LoopThread, session_pki: Pki) -> Iterator[FakeOrchestrator]:
    """A one-replica fake orchestrator on loopback TCP, serving mutual TLS with the session's
    certificates (the ones the clients find in their environment)."""
    server = session_pki.orchestrator
    fake = FakeOrchestrator(
        loop_thread, tls=TlsFiles(str(session_pki.ca), str(server.cert), str(server.key))
    )
    fake.add_replica()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TIMESLICE_JOB_ID", "job-a")
    monkeypatch.delenv("TIMESLICE_TARGET", raising=False)
    return "job-a"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix sockets (their paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ts-sdk-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
