"""The orchestrator's environment variables follow the one scheme: TIMESLICE_ORCHESTRATOR_*."""

from __future__ import annotations

import logging

import pytest

from timeslice_orchestrator.config import parse_args


@pytest.fixture(autouse=True)
def _plaintext_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # These parse options without certificates: plaintext chosen through the environment.
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_INSECURE", "1")


def test_options_come_from_timeslice_orchestrator_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_ETCD", "etcd-a:2379,etcd-b:2379")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_MAX_HOLD", "7.5")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_PREFETCH", "true")
    config = parse_args([])
    assert config.etcd == ["etcd-a:2379", "etcd-b:2379"]
    assert (config.max_hold, config.prefetch) == (7.5, True)
    # The command line wins over the environment.
    assert parse_args(["--max-hold", "1"]).max_hold == 1.0


def test_legacy_names_still_work_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIMESLICE_PREFIX", "/timeslice/old")
    with caplog.at_level(logging.WARNING):
        assert parse_args([]).prefix == "/timeslice/old"
    assert "TIMESLICE_PREFIX is deprecated: use TIMESLICE_ORCHESTRATOR_PREFIX" in caplog.text
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_PREFIX", "/timeslice/new")
    assert parse_args([]).prefix == "/timeslice/new"
