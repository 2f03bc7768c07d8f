"""Fixtures of the integration tests: a group store on its own prefix of the shared etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.groupstore import group_store
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_tools.dev.etcd import EtcdServer


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[GroupStore]:
    async with group_store(etcd_server.endpoint) as s:
        yield s
