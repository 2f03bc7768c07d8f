"""Fixtures of the SDK tests: a fake orchestrator (and agent) on a background loop thread."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sdk.fakes import FakeOrchestrator, LoopThread


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def orch(loop_thread: LoopThread) -> Iterator[FakeOrchestrator]:
    """A one-replica fake orchestrator on loopback TCP."""
    fake = FakeOrchestrator(loop_thread)
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
