"""``timeslice orchestrator features``: its arguments, read like a replica's, and its output."""

from __future__ import annotations

import pytest

from timeslice_orchestrator import features
from timeslice_orchestrator.store.records import FeaturesRecord


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        features.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_it_reads_the_replicas_etcd_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_ETCD", "etcd-0.etcd:2379,etcd-1.etcd:2379")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_PREFIX", "/timeslice/prod")
    monkeypatch.setenv("TIMESLICE_ORCHESTRATOR_ETCD_CA", "/tls/ca.crt")
    action, target = features.parse_args(["enable", "--etcd-cert=/tls/c", "--etcd-key=/tls/k"])
    assert action == "enable"
    assert target.etcd == ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]
    assert target.prefix == "/timeslice/prod"
    assert target.etcd_tls is not None and target.etcd_tls.ca == "/tls/ca.crt"
    assert (target.etcd_tls.cert, target.etcd_tls.key) == ("/tls/c", "/tls/k")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show"], "no TLS for etcd"),
        (["enable", "--etcd-cert=/c", "--etcd-key=/k"], "need --etcd-ca"),
        (["enable", "--etcd-ca=/ca", "--etcd-cert=/c"], "together"),
        (["show", "--insecure", "--prefix=timeslice"], "prefix"),
        (["show", "--insecure", "--etcd=:"], "etcd"),
        (["turn-on", "--insecure"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(argv, capsys)
    assert message in err and err.count("\n") == 1, err


def test_it_shows_each_feature_and_a_missing_record() -> None:
    on = features.describe(FeaturesRecord(one_transaction_hand_over=True))
    assert on == "one_transaction_hand_over: on"
    missing = features.describe(None)
    assert "one_transaction_hand_over: off" in missing and "no features record" in missing


def test_it_counts_the_holds_an_older_version_would_misread() -> None:
    on = FeaturesRecord(one_transaction_hand_over=True)
    assert features.describe_misread(["g"], on) == "holds an older version would misread: 1 (g)"
    many = [f"g{i:02d}" for i in range(12)]
    shown = features.describe_misread(many, on)
    assert shown.startswith("holds an older version would misread: 12 (g00, g01,")
    assert shown.endswith("g09, ...)") and "g10" not in shown
    # Switched off: a rollback waits for the count to reach 0, and is told when it has.
    waiting = features.describe_misread(["g"], FeaturesRecord())
    assert "roll back once none is left" in waiting
    assert "may be started" in features.describe_misread([], None)
