"""Fixtures for the agent tests: a short socket directory, a fake hub, agent processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import AgentFactory, AgentProcess, FakeHub, running_hub


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tsa-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def hub() -> AsyncIterator[tuple[FakeHub, int]]:
    async with running_hub() as pair:
        yield pair


@pytest.fixture
async def agents(short_dir: Path) -> AsyncIterator[AgentFactory]:
    """Make AgentProcess objects in ``short_dir``; all are killed when the test ends."""
    made: list[AgentProcess] = []

    def make(orchestrator: str, **kwargs: Any) -> AgentProcess:
        agent = AgentProcess(short_dir, orchestrator, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        await agent.ensure_stopped()
