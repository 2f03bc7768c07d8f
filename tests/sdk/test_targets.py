"""The one address parser (timeslice.targets) and the one Backoff (timeslice.backoff)."""

from __future__ import annotations

import random

import pytest

from timeslice.backoff import Backoff
from timeslice.errors import InvalidArgument
from timeslice.targets import (
    DEFAULT_PORT,
    HostPort,
    UnixSocket,
    parse_address,
    parse_target,
    parse_targets,
    targets_from_env,
)


def test_the_forms_every_component_accepts() -> None:
    assert parse_target("orch.example.com:7") == HostPort("orch.example.com", 7)
    assert parse_target(" 10.0.0.1:50052 ") == ("10.0.0.1", 50052)
    assert parse_target("[::1]:9") == HostPort("::1", 9)
    assert parse_target("[fe80::1]") == HostPort("fe80::1", DEFAULT_PORT)
    assert parse_target("h") == HostPort("h", DEFAULT_PORT)
    assert parse_target("unix:/run/o.sock") == UnixSocket("/run/o.sock")
    assert parse_target("unix:///run/o.sock") == UnixSocket("/run/o.sock")
    assert [str(t) for t in parse_targets("a:1, [::1]:2,,unix:/x,")] == [
        "a:1",
        "[::1]:2",
        "unix:/x",
    ]
    assert parse_targets(["a:1,b:2", "c:3"]) == [("a", 1), ("b", 2), ("c", 3)]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("h:", "no port after ':'"),
        (":1", "no host"),
        ("h:0", "from 1 to 65535"),
        ("h:65536", "from 1 to 65535"),
        ("h:x", "from 1 to 65535"),
        ("::1:5", "write IPv6 addresses as [addr]:port"),
        ("[::1", "unterminated"),
        ("[::1]5", "expected ':port'"),
    ],
)
def test_malformed_addresses_say_why(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match="is not HOST:PORT") as raised:
        parse_address(text, what="address")
    assert why in str(raised.value)


def test_caller_options() -> None:
    with pytest.raises(InvalidArgument, match="no port"):
        parse_target("h", default_port=None)
    assert parse_address(":8080", default_host="0.0.0.0") == ("0.0.0.0", 8080)
    assert parse_address("h:0", port_zero=True) == ("h", 0)
    with pytest.raises(InvalidArgument, match="absolute path"):
        parse_target("unix:run/o.sock")
    with pytest.raises(InvalidArgument, match="port"):
        parse_targets("unix:/x", unix=False)
    with pytest.raises(InvalidArgument, match="names no address"):
        parse_targets(" , ")


def test_targets_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_TARGET", "e:1")
    assert targets_from_env(None) == [("e", 1)]
    assert targets_from_env("x:2") == [("x", 2)]
    monkeypatch.delenv("TIMESLICE_TARGET")
    assert targets_from_env(None) == [("localhost", DEFAULT_PORT)]


def test_backoff_doubles_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.1, 0.5, jitter=False)
    assert [backoff.next_delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == 0.1


def test_backoff_jitter_stays_in_the_upper_half() -> None:
    backoff = Backoff(0.05, 1.0, rng=random.Random(7))
    for planned in (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0):
        assert planned / 2 <= backoff.next_delay() <= planned
