"""Scopes of a role in a placement pool (``on_accelerators(pool=..., role=...)``): their
arguments, and that they pickle as scopes of the same role (the resolution itself, against a
live cluster: tests/e2e/test_placements.py)."""

from __future__ import annotations

import pickle

import pytest

from timeslice import AsyncTimeSliceClient, TimeSliceOrchestratorClient
from timeslice.errors import InvalidArgument


def test_a_scope_names_a_group_or_a_pool_role() -> None:
    client = AsyncTimeSliceClient("h:1", job_id="j")
    scope = client.on_accelerators(pool="p", role="sampler", timeout=5)
    assert (scope.pool, scope.role, scope.group_id) == ("p", "sampler", "")
    assert "pool='p', role='sampler'" in repr(scope)
    assert client.on_accelerators(pool="p").role == "main"
    for bad in (
        {},
        {"group_id": "g", "pool": "p"},
        {"role": "sampler"},
        {"pool": "../p"},
        {"pool": "p", "role": ""},
    ):
        with pytest.raises(InvalidArgument):
            client.on_accelerators(**bad)  # type: ignore[arg-type]


def test_a_pool_scope_pickles_as_the_same_role_of_the_copy() -> None:
    with TimeSliceOrchestratorClient("h:1", job_id="j") as original:
        scope = original.on_accelerators(pool="p", role="trainer", timeout=5)
        copy = pickle.loads(pickle.dumps(scope))
        try:
            assert (copy.pool, copy.role, copy.timeout) == ("p", "trainer", 5.0)
            assert copy._owner is not original  # a scope of the client's copy
        finally:
            owner = copy._owner
            assert isinstance(owner, TimeSliceOrchestratorClient)
            owner.close()
