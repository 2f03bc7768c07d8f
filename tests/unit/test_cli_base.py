"""The ``timeslice`` command's frame (timeslice.cli.base): argument types, exit statuses by
error class, the error format (text and JSON), the operator token's sources, and a command run
from parsing to exit status. The commands themselves, against a real orchestrator, are in
tests/dev/test_dev_cli.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from timeslice.cli import base
from timeslice.cli.base import (
    OPERATOR_TOKEN_ENV,
    OPERATOR_TOKEN_FILE_ENV,
    Commands,
    ExitCode,
    count,
    epoch,
    exit_code,
    job_of,
    non_negative_float,
    operator_metadata,
    positive_float,
    run,
)
from timeslice.errors import (
    ConnectionRefused,
    GroupFaulted,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    Timeout,
    Unauthenticated,
    Unavailable,
)


@pytest.fixture(autouse=True)
def _text_errors_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` keeps whether errors are JSON in a module global: put it back after each test,
    so that no later test in this process prints its errors as JSON."""
    monkeypatch.setattr(base, "_json_errors", False)


def test_argument_types_take_what_they_say_and_refuse_the_rest() -> None:
    assert positive_float("0.5") == 0.5
    assert non_negative_float("0") == 0.0
    assert count(1)("3") == 3
    assert epoch(str(2**64 - 1)) == 2**64 - 1
    refused = [
        (positive_float, "0", "must be positive"),
        (positive_float, "nan", "must be positive"),
        (positive_float, "x", "is not a number"),
        (non_negative_float, "-1", "must not be negative"),
        (count(1), "0", "must be at least 1"),
        (count(1), "1.5", "is not an integer"),
        (epoch, "0", "not a valid epoch"),
        (epoch, str(2**64), "not a valid epoch"),
    ]
    for parse, text, why in refused:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse(text)


def test_each_error_exits_with_its_documented_status() -> None:
    assert exit_code(InvalidArgument("x")) == 2
    assert exit_code(NotFound("x")) == 3
    assert exit_code(NotHolder("x")) == 4
    assert exit_code(Timeout("x")) == 5
    assert exit_code(Unavailable("x")) == 6
    # A subclass exits as its base: a refused connection is an unreachable orchestrator.
    assert exit_code(ConnectionRefused("x")) == ExitCode.UNREACHABLE
    assert exit_code(PermissionDenied("x")) == exit_code(Unauthenticated("x")) == 7
    assert exit_code(GroupFaulted("x")) == ExitCode.FAILURE


def _commands(commands: Commands) -> None:
    def fails(args: argparse.Namespace) -> int:
        raise NotFound(f"no group {args.group}")

    parser = commands.add("look", fails)
    parser.add_argument("group")
    parser.add_argument("--json", action="store_true")
    commands.add("ok", lambda args: 0)


def test_a_command_runs_and_a_typed_error_is_reported_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["ok"], [_commands]) == 0
    with pytest.raises(SystemExit) as exited:
        run(["look", "g1"], [_commands])
    assert exited.value.code == ExitCode.NOT_FOUND
    assert capsys.readouterr().err == "error: not_found: no group g1\n"


def test_with_json_errors_and_usage_errors_are_one_json_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        run(["look", "g1", "--json"], [_commands])
    assert json.loads(capsys.readouterr().err) == {
        "error": "not_found",
        "message": "no group g1",
        "exit_code": 3,
    }
    # A usage error of a --json command, before any handler ran: JSON too, status 2.
    with pytest.raises(SystemExit) as exited:
        run(["look", "--json"], [_commands])
    assert exited.value.code == ExitCode.USAGE
    document = json.loads(capsys.readouterr().err)
    assert document["error"] == "invalid_argument" and document["exit_code"] == 2


def test_the_operator_token_comes_from_a_file_else_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(OPERATOR_TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(OPERATOR_TOKEN_ENV, raising=False)
    none = argparse.Namespace(token_file=None)
    assert operator_metadata(none) == {}
    monkeypatch.setenv(OPERATOR_TOKEN_ENV, " from-env\n")
    assert operator_metadata(none) == {"authorization": "Bearer from-env"}
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv(OPERATOR_TOKEN_FILE_ENV, str(token_file))
    assert operator_metadata(none) == {"authorization": "Bearer from-file"}
    with pytest.raises(InvalidArgument, match="cannot read the operator token file"):
        operator_metadata(argparse.Namespace(token_file=str(tmp_path / "absent")))


def test_the_job_is_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIMESLICE_JOB_ID", raising=False)
    with pytest.raises(InvalidArgument, match="no job"):
        job_of(argparse.Namespace(job=None))
    monkeypatch.setenv("TIMESLICE_JOB_ID", "job-env")
    assert job_of(argparse.Namespace(job=None)) == "job-env"
    assert job_of(argparse.Namespace(job="job-flag")) == "job-flag"
    with pytest.raises(InvalidArgument):
        job_of(argparse.Namespace(job="bad job id"))
