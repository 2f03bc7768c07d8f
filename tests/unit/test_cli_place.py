"""``timeslice place`` and ``timeslice pool``: argument parsing and the pool as people read it
(the commands against a live cluster: tests/e2e/test_placements.py)."""

from __future__ import annotations

import pytest

from timeslice.cli import main
from timeslice.cli.place import env_lines, parse_claims, parse_profile, pool_view
from timeslice.errors import InvalidArgument
from timeslice_proto.timeslice.placement.v1 import (
    Assignment,
    AuditEntry,
    GroupClaim,
    GroupDuty,
    Mode,
    Pin,
    PlaceResponse,
    Pool,
    RolePlacement,
)


def test_a_profile_is_role_busy_period_and_mode() -> None:
    p = parse_profile("sampler:0.3:20:async")
    assert (p.role, p.busy, p.period_seconds, p.mode) == ("sampler", 0.3, 20.0, Mode.ASYNC)
    assert parse_profile("t:0.5:1").mode == Mode.SYNC
    for bad in ("sampler", "s:x:1", "s:0.3:1:sometimes", "../s:0.3:1"):
        with pytest.raises(InvalidArgument):
            parse_profile(bad)


def test_bad_input_exits_2_before_any_call(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["place", "p", "--role", "s", "--target", "127.0.0.1:1"],  # no --job
        ["place", "p", "--job", "j", "--target", "127.0.0.1:1"],  # no --role
        ["pool", "create", "p", "--target", "127.0.0.1:1"],  # no --groups
        ["pool", "create", "p", "--groups", "g1", "--cap", "2", "--target", "127.0.0.1:1"],
        ["pool", "rename", "p"],
        ["pool", "create", "p", "--groups", "g1", "--claim", "g1", "--target", "127.0.0.1:1"],
        ["pool", "claim", "p", "--group", "g1", "--target", "127.0.0.1:1"],  # no --claim
        ["pool", "claim", "p", "--group", "g1", "--claim", "g1=c", "--target", "127.0.0.1:1"],
        ["pool", "drain", "p", "--group", "g1", "--claim", "c", "--target", "127.0.0.1:1"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
    assert "error: invalid_argument" in capsys.readouterr().err


def test_the_pool_view_shows_duty_rules_reasons_and_the_audit() -> None:
    pool = Pool(
        pool="p",
        groups=["g1", "g2"],
        cap=0.9,
        pins=[Pin("a", "s", "g1")],
        drained=["g2"],
        assignments=[Assignment("a", "s", "g1", "pinned", "pinned to g1", "declared", True)],
        audit=[AuditEntry(at=0.0, what="pinned", job_id="a", role="s", group_id="g1")],
        duty=[GroupDuty("g1", 0.3, 0.25, False, ["a/s"]), GroupDuty("g2", 0.0, 0.0, True)],
    )
    text = "\n".join(pool_view(pool))
    assert "g1: expected duty 30%, measured 25%; a/s" in text
    assert "g2: expected duty 0%, measured 0%; -  (drained)" in text
    assert "pin a/s -> g1" in text
    assert "a/s -> g1 (pinned; provisional): pinned to g1" in text
    assert "00:00:00 pinned a/s g1" in text


def test_env_lines_name_the_group_for_a_launcher() -> None:
    one = PlaceResponse("p", "j", [RolePlacement("trainer", "g1")], True)
    assert env_lines(one) == ["TIMESLICE_GROUP=g1"]
    two = PlaceResponse(
        "p", "j", [RolePlacement("trainer", "g1"), RolePlacement("roll-out", "g2")], True
    )
    assert env_lines(two) == ["TIMESLICE_GROUP_TRAINER=g1", "TIMESLICE_GROUP_ROLL_OUT=g2"]
    assert env_lines(PlaceResponse("p", "j", [RolePlacement("t", "")], False)) == []


def test_claims_are_group_equals_name() -> None:
    assert parse_claims(["g1=gpus-a", "g2=gpus-b"]) == [
        GroupClaim("g1", "gpus-a"),
        GroupClaim("g2", "gpus-b"),
    ]
    for bad in ("g1", "g1=", "../g=c"):
        with pytest.raises(InvalidArgument):
            parse_claims([bad])


def test_the_claim_is_in_the_env_lines_and_the_pool_view() -> None:
    one = PlaceResponse("p", "j", [RolePlacement("trainer", "g1", claim="gpus-a")], True)
    assert env_lines(one) == ["TIMESLICE_GROUP=g1", "TIMESLICE_CLAIM=gpus-a"]
    two = PlaceResponse(
        "p", "j", [RolePlacement("t", "g1", claim="gpus-a"), RolePlacement("s", "g2")], True
    )
    assert env_lines(two) == [
        "TIMESLICE_GROUP_T=g1",
        "TIMESLICE_CLAIM_T=gpus-a",
        "TIMESLICE_GROUP_S=g2",
    ]
    pool = Pool(
        pool="p",
        groups=["g1", "g2"],
        cap=0.9,
        duty=[GroupDuty("g1", 0.3, 0.25, False, ["a/s"]), GroupDuty("g2", 0.0, 0.0, False)],
        claims=[GroupClaim("g1", "gpus-a")],
    )
    text = "\n".join(pool_view(pool))
    assert "g1 (claim gpus-a): expected duty 30%" in text
    assert "g2: expected duty 0%" in text
