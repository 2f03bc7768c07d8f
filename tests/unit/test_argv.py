"""Bad command-line input fails with one line and status 2, not a usage dump."""

from __future__ import annotations

import pytest

from timeslice.argv import OneLineParser


def test_an_error_is_one_line_naming_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="timeslice-agent")
    parser.add_argument("--port", type=int, required=True)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--port", "eighty"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("timeslice-agent: error: argument --port: invalid int value")
    assert err.rstrip().endswith("(see timeslice-agent --help)")
    assert "usage:" not in err


def test_good_input_parses(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="p")
    parser.add_argument("--port", type=int)
    assert parser.parse_args(["--port", "80"]).port == 80
    assert capsys.readouterr().err == ""
