"""Session secrets and the operator identity (``timeslice_orchestrator.authz``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import grpclib.server
import pytest
from multidict import MultiDict

from timeslice.errors import InvalidArgument
from timeslice_orchestrator.authz import (
    Authorizer,
    load_operator_token,
    new_session_secret,
    secret_hash,
    secret_matches,
)
from timeslice_orchestrator.metrics import Metrics

TOKEN = "t" * 32


class _Stream:
    """What the authorizer reads of a grpclib server stream: its metadata."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.metadata = MultiDict(pairs)


def stream(*pairs: tuple[str, str]) -> grpclib.server.Stream[Any, Any]:
    return cast(grpclib.server.Stream[Any, Any], _Stream(*pairs))


def test_secrets_are_long_random_and_only_their_hash_is_kept() -> None:
    secrets = {new_session_secret() for _ in range(100)}
    assert len(secrets) == 100
    assert all(len(s) >= 43 for s in secrets)  # 32 random bytes, URL-safe base64
    secret = secrets.pop()
    stored = secret_hash(secret)
    assert secret not in stored and len(stored) == 64
    assert secret_matches(secret, stored)
    for wrong in ("", secret[:-1], secret + "x", secrets.pop(), stored):
        assert not secret_matches(wrong, stored)
    # A session written before secrets existed has no hash: nothing opens it.
    assert not secret_matches(secret, "")
    assert not secret_matches("", "")


def test_operator_is_whoever_presents_the_token() -> None:
    authz = Authorizer(Metrics(), TOKEN)
    assert authz.is_operator(stream(("authorization", f"Bearer {TOKEN}")))
    assert authz.is_operator(stream(("authorization", f"bearer {TOKEN}")))
    assert authz.is_operator(stream(("x", "y"), ("authorization", f"Bearer {TOKEN}")))
    for value in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer ", ""):
        assert not authz.is_operator(stream(("authorization", value))), value
    assert not authz.is_operator(stream())
    # No token configured: nobody is an operator, whatever is sent.
    nobody = Authorizer(Metrics())
    assert not nobody.has_operator_identity
    assert not nobody.is_operator(stream(("authorization", "Bearer ")))
    assert not nobody.is_operator(stream(("authorization", f"Bearer {TOKEN}")))


def test_refusals_are_counted_every_time_and_logged_once_per_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics()
    authz = Authorizer(metrics, TOKEN)
    with caplog.at_level(logging.WARNING, logger="timeslice_orchestrator.authz"):
        for _ in range(50):
            authz.refused("SetGroupMembers", "no operator identity", "10.0.0.1:5")
        authz.refused("Yield", "no operator identity")
        authz.refused("Yield", "session secret missing or wrong")
    assert len(caplog.records) == 3
    assert "10.0.0.1:5" in caplog.records[0].getMessage()
    value = metrics.registry.get_sample_value(
        "timeslice_authz_refusals_total",
        {"rpc": "SetGroupMembers", "cause": "no operator identity"},
    )
    assert value == 50


def test_operator_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_operator_token(str(path)) == TOKEN
    path.write_text("short\n")
    with pytest.raises(InvalidArgument, match="shorter than 16"):
        load_operator_token(str(path))
