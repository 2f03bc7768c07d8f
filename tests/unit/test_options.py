"""The services' options (timeslice._options): sectioned help, one unit convention, every option
reachable from its environment variable, emulation knobs kept apart from production ones."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from timeslice._options import EMULATION, UNITS, ServiceOptions
from timeslice_agent.config import build_parser as agent_parser
from timeslice_orchestrator.config import build_parser as orchestrator_parser
from timeslice_orchestrator.config import parse_args

ORCHESTRATOR_GROUPS = [
    "listen", "etcd", "timing", "scheduling", "limits", "admission", "connections",
    "TLS and operators", "dashboard",
]  # fmt: skip
AGENT_GROUPS = [
    "node", "listen", "timing and limits", "TLS", "backend", "cuda backend", "app backend",
    EMULATION,
]  # fmt: skip

# Words that name a unit at the end of a flag; those the convention (UNITS) explains, and the
# default units spelled out.
UNIT_WORDS = {
    "ms", "s", "sec", "secs", "seconds", "minutes", "us", "ns", "b", "bytes", "kb", "kib", "mb",
    "mib", "gb", "gib", "gbps", "mbps", "bps",
}  # fmt: skip
NAMED_UNITS = {"ms", "mib", "gb", "gbps", "seconds", "bytes"}


def sections(options: ServiceOptions) -> dict[str, list[str]]:
    """Each group's title and its options' flags, in --help order."""
    return {
        str(group.title): [a.option_strings[0] for a in group._group_actions]
        for group in options.parser._action_groups
    }


# argparse's own options: no variable, no group of a concern.
BUILT_IN = ("-h", "--version")


@pytest.mark.parametrize(
    ("options", "titles"),
    [(orchestrator_parser({}), ORCHESTRATOR_GROUPS), (agent_parser({}), AGENT_GROUPS)],
    ids=["orchestrator", "agent"],
)
def test_help_is_sectioned_by_concern(options: ServiceOptions, titles: list[str]) -> None:
    groups = sections(options)
    # Every option sits in a titled group of its concern; argparse's own group holds --help
    # and --version.
    assert list(groups) == ["positional arguments", "options", *titles]
    assert groups["options"] == list(BUILT_IN) and groups["positional arguments"] == []
    text = options.parser.format_help()
    assert all(f"\n{title}:\n" in text for title in titles), text
    assert text.rstrip().endswith(UNITS.split()[-1]) and "Units: a duration is in seconds" in text
    assert "--log-level" in groups[titles[0]]


@pytest.mark.parametrize(
    ("options", "prefix"),
    [(orchestrator_parser({}), "TIMESLICE_ORCHESTRATOR_"), (agent_parser({}), "TIMESLICE_AGENT_")],
    ids=["orchestrator", "agent"],
)
def test_every_option_names_its_variable_and_units_follow_the_convention(
    options: ServiceOptions, prefix: str
) -> None:
    for action in options.parser._actions:
        flag = action.option_strings[0]
        if flag in BUILT_IN or isinstance(action, argparse._AppendAction):
            continue
        assert f"[env {prefix}{flag[2:].replace('-', '_').upper()}]" in str(action.help), flag
        # A unit in a name is one the help's convention explains; any other (-mb, -s, -kib)
        # would be a second convention for the same kind.
        last = flag.rsplit("-", 1)[-1]
        if last in UNIT_WORDS:
            assert last in NAMED_UNITS, f"{flag}: {last} is not in the convention: {UNITS}"


def test_emulation_and_test_knobs_are_apart_from_production_ones() -> None:
    groups = sections(agent_parser({}))
    sim = [flag for flags in groups.values() for flag in flags if flag.startswith("--sim-")]
    assert sim and set(sim) <= set(groups[EMULATION])
    assert "--host-memory-gb" in groups[EMULATION]
    assert not any(
        flag.startswith("--sim-") for flags in sections(orchestrator_parser({})).values()
        for flag in flags
    )  # fmt: skip


def test_orchestrator_log_level_and_legacy_variables() -> None:
    insecure = {"TIMESLICE_ORCHESTRATOR_INSECURE": "1"}
    assert parse_args([], insecure).log_level == "INFO"
    assert parse_args(["--log-level", "warning"], insecure).log_level == "WARNING"
    env = {**insecure, "TIMESLICE_ORCHESTRATOR_LOG_LEVEL": "debug"}
    assert parse_args([], env).log_level == "DEBUG"
    # Options added after the one naming scheme have no legacy name to read.
    assert parse_args([], {**insecure, "TIMESLICE_LOG_LEVEL": "ERROR"}).log_level == "INFO"
    # An empty certificate variable names no file (as no variable would).
    assert parse_args([], {**insecure, "TIMESLICE_ORCHESTRATOR_TLS_CA": ""}).tls is None


def test_bad_log_level_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--insecure", "--log-level", "loud"], {})
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--log-level 'loud' is not one of DEBUG" in err[0], err


def test_legacy_variable_of_an_old_option_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_args([], {"TIMESLICE_ORCHESTRATOR_INSECURE": "1", "TIMESLICE_MAX_HOLD": "3"})
    assert config.max_hold == 3.0
    assert "TIMESLICE_MAX_HOLD is deprecated: use TIMESLICE_ORCHESTRATOR_MAX_HOLD" in caplog.text


def test_help_states_defaults_and_escapes_percent_signs() -> None:
    options = ServiceOptions("svc", "A service.", "SVC_", {"SVC_RATIO": "7"})
    group = options.group("numbers", "what they are")
    group.option("--ratio", "5", "share of 100%", type=int)
    group.switch("--on", "turn it on")
    text = options.parser.format_help()
    assert "share of 100% (default 5) [env SVC_RATIO]" in " ".join(text.split())
    # The environment sets the default, the command line wins.
    assert options.parse([]).ratio == 7 and options.parse(["--ratio", "9"]).ratio == 9
    assert options.parse([]).on is False and options.parse(["--on"]).on is True


def test_configuration_doc_lists_every_group_and_option() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for service, options in (
        ("orchestrator", orchestrator_parser({})),
        ("agent", agent_parser({})),
    ):
        section = doc.split(f"### {service}\n", 1)[1].split("\n### ", 1)[0]
        for title, flags in sections(options).items():
            shown = [f for f in flags if f not in BUILT_IN]
            if shown:
                row = f"| {title} | {', '.join(f'`{f}`' for f in shown)} |"
                assert row in section, f"docs/configuration.md ({service}) lacks: {row}"
