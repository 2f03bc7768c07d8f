"""Options: command line, TIMESLICE_AGENT_* environment variables, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeslice_agent.config import GB, BackendKind, Endpoint, parse_config, parse_endpoint


def test_defaults_and_derived_paths() -> None:
    argv = ["--orchestrator", "a:1,[::1]:2", "--node", "n1", "--backend", "sim", "--insecure"]
    cfg = parse_config(argv, environ={})
    assert cfg.orchestrators == (Endpoint("a", 1), Endpoint("::1", 2))
    assert cfg.backend is BackendKind.SIM
    assert cfg.log_level == "INFO"
    assert cfg.worker_socket == Path("/run/timeslice/agent.sock")
    assert cfg.state_file == Path("/run/timeslice/agent-n1.json")
    assert cfg.http is None
    assert cfg.sim.capacity_bytes == 80 * GB
    assert cfg.sim.bandwidth_bytes_per_s == 50 * GB
    assert cfg.sim.default_state_bytes == 40 * GB
    assert cfg.sim.time_scale == 1.0
    assert cfg.hook_timeout == 60


def test_environment_variables_and_command_line_precedence() -> None:
    env = {
        "TIMESLICE_AGENT_ORCHESTRATOR": "o:50051",
        "TIMESLICE_AGENT_NODE": "env-node",
        "TIMESLICE_AGENT_BACKEND": "freeze",
        "TIMESLICE_AGENT_WORKER_SOCKET": "/tmp/x/a.sock",
        "TIMESLICE_AGENT_HTTP": "127.0.0.1:0",
        "TIMESLICE_AGENT_SIM_TIME_SCALE": "0",
        "TIMESLICE_AGENT_HOOK_TIMEOUT": "5",
    }
    cfg = parse_config(["--node", "cli-node", "--insecure"], environ=env)
    assert cfg.node == "cli-node"
    assert cfg.orchestrators == (Endpoint("o", 50051),)
    assert cfg.backend is BackendKind.FREEZE
    assert cfg.state_file == Path("/tmp/x/agent-cli-node.json")
    assert cfg.http == Endpoint("127.0.0.1", 0)
    assert cfg.sim.time_scale == 0.0
    assert cfg.hook_timeout == 5.0


OK = ["--orchestrator", "h:1", "--backend", "sim", "--insecure"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--orchestrator"),
        (["--orchestrator", "nohostport", "--backend", "sim"], "nohostport"),
        (["--orchestrator", "h:0", "--backend", "sim"], "h:0"),
        ([*OK, "--node", "../etc"], "../etc"),
        (["--orchestrator", "h:1", "--backend", "cuda-magic"], "cuda-magic"),
        ([*OK, "--sim-capacity-gb", "0"], "--sim-capacity-gb"),
        ([*OK, "--sim-time-scale", "-1"], "--sim-time-scale"),
        ([*OK, "--hook-timeout", "nan"], "--hook-timeout"),
        ([*OK, "--http", "h:99999"], "h:99999"),
        ([*OK, "--log-level", "chatty"], "--log-level 'chatty' is not one of DEBUG, INFO"),
        (["--orchestrator", "h:1", "--insecure"], "--backend"),
    ],
)
def test_bad_options_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(argv, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_no_backend_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    # No default: a GPU node started without --backend must not silently emulate.
    with pytest.raises(SystemExit) as info:
        parse_config(["--orchestrator", "h:1", "--insecure"], environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timeslice agent: error: --backend (or TIMESLICE_AGENT_BACKEND) is")
    assert all(kind.value in err for kind in BackendKind), err
    env = {"TIMESLICE_AGENT_BACKEND": "cuda"}
    assert parse_config(["--orchestrator", "h:1", "--insecure"], env).backend is BackendKind.CUDA


def test_log_level_any_case_from_flag_or_environment() -> None:
    assert parse_config([*OK, "--log-level", "debug"], environ={}).log_level == "DEBUG"
    env = {"TIMESLICE_AGENT_LOG_LEVEL": "warning"}
    assert parse_config(OK, environ=env).log_level == "WARNING"


def test_bad_environment_value_is_reported() -> None:
    with pytest.raises(SystemExit):
        parse_config(OK, environ={"TIMESLICE_AGENT_SIM_BANDWIDTH_GBPS": "x"})


def test_parse_endpoint_port_zero_only_when_allowed() -> None:
    assert parse_endpoint("0.0.0.0:0", allow_port_zero=True) == Endpoint("0.0.0.0", 0)
    assert str(Endpoint("::1", 5)) == "[::1]:5"
