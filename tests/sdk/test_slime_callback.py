"""The Slime callback's rules, against a recording client: which locks each phase takes, in
which order, idempotence, the lock-order error, release at close, and doing nothing unset.

(That it gives mutual exclusion without deadlock on a real cluster is
tests/integrations/test_slime_replay.py.)
"""

from __future__ import annotations

import pytest

from timeslice import Grant
from timeslice.errors import InvalidArgument
from timeslice.integrations.slime import (
    ADDRESS_ENV,
    JOB_ENV,
    PHASE_LOCKS,
    SAMPLER_ENV,
    TIMEOUT_ENV,
    TRAINER_ENV,
    LockOrderError,
    SlimePhaseCallback,
)

ENV = {JOB_ENV: "job-a", ADDRESS_ENV: "localhost:1", TRAINER_ENV: "T", SAMPLER_ENV: "S"}


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.timeouts: list[float | None] = []
        self.closed = False

    def acquire(self, group_id: str, *, timeout: float | None = None) -> Grant:
        self.calls.append(("acquire", group_id))
        self.timeouts.append(timeout)
        return Grant(group_id, "job-a", len(self.calls), 0.0, False, None, 0.0)

    def yield_(self, group_id: str) -> None:
        self.calls.append(("yield", group_id))

    def close(self) -> None:
        self.closed = True


def _callback(env: dict[str, str] | None = None) -> tuple[SlimePhaseCallback, Recording]:
    client = Recording()
    return SlimePhaseCallback(ENV if env is None else env, client=client), client


@pytest.mark.parametrize("unset", [JOB_ENV, ADDRESS_ENV, TRAINER_ENV, SAMPLER_ENV])
def test_it_does_nothing_when_a_variable_is_unset(unset: str) -> None:
    env = {k: v for k, v in ENV.items() if k != unset}
    callback, client = _callback(env)
    assert not callback.enabled
    for phase in PHASE_LOCKS:
        callback.on_phase_begin(phase)
        callback.on_phase_end(phase)
    callback.close()
    assert client.calls == [] and callback.held == []


def test_each_phase_takes_its_pools_trainer_first_and_gives_them_back_in_reverse() -> None:
    expected = {
        "init": ["T", "S"],
        "weight_sync": ["T", "S"],
        "generate": ["S"],
        "offload": ["S"],
        "onload": ["S"],
        "eval": ["S"],
        "train": ["T"],
        "create": ["T"],
    }
    for phase, groups in expected.items():
        callback, client = _callback()
        callback.on_phase_begin(phase, "actor", {})
        assert client.calls == [("acquire", g) for g in groups], phase
        assert callback.held == groups
        callback.on_phase_end(phase, "actor", {})
        assert client.calls[len(groups) :] == [("yield", g) for g in reversed(groups)], phase
        assert callback.held == []


def test_acquire_and_release_are_idempotent() -> None:
    callback, client = _callback()
    callback.on_phase_begin("train")
    callback.on_phase_begin("train")
    callback.on_phase_begin("init")  # trainer already held: only the sampler is taken
    assert client.calls == [("acquire", "T"), ("acquire", "S")]
    callback.on_phase_end("init")
    callback.on_phase_end("init")
    callback.on_phase_end("train")
    assert client.calls[2:] == [("yield", "S"), ("yield", "T")]


def test_the_trainer_lock_while_holding_only_the_sampler_lock_is_an_error() -> None:
    callback, client = _callback()
    callback.on_phase_begin("generate")
    with pytest.raises(LockOrderError):
        callback.on_phase_begin("train")
    with pytest.raises(LockOrderError):
        callback.on_phase_begin("weight_sync")
    assert client.calls == [("acquire", "S")]  # nothing more was taken
    callback.on_phase_end("generate")
    callback.on_phase_begin("train")  # fine once the sampler phase ended
    assert callback.held == ["T"]


def test_close_gives_back_everything_in_reverse_and_closes_the_client() -> None:
    callback, client = _callback()
    callback.on_phase_begin("init")
    callback.close()
    callback.close()
    assert client.calls == [("acquire", "T"), ("acquire", "S"), ("yield", "S"), ("yield", "T")]
    assert client.closed and callback.held == []


def test_the_acquire_timeout_defaults_to_600_s_and_can_be_set() -> None:
    callback, client = _callback()
    callback.on_phase_begin("train")
    assert client.timeouts == [600.0]
    callback, client = _callback({**ENV, TIMEOUT_ENV: "5"})
    callback.on_phase_begin("train")
    assert client.timeouts == [5.0]
    for bad in ("soon", "0", "-1"):
        with pytest.raises(InvalidArgument):
            _callback({**ENV, TIMEOUT_ENV: bad})


def test_a_phase_not_in_the_table_takes_no_lock() -> None:
    callback, client = _callback()
    callback.on_phase_begin("save_checkpoint")
    callback.on_phase_end("save_checkpoint")
    assert client.calls == []


def test_the_phase_callback_path_loads_the_way_slime_loads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slime's load_phase_callback: load_function(path) (rpartition on the last dot,
    # importlib.import_module, getattr), then cls() with no arguments.
    import importlib

    from timeslice.integrations import slime

    for name in ("TIMESLICE_JOB_ID", "TIMESLICE_ORCH_ADDR"):
        monkeypatch.delenv(name, raising=False)
    module_path, _, attr = slime.PHASE_CALLBACK_PATH.rpartition(".")
    callback = getattr(importlib.import_module(module_path), attr)()
    assert isinstance(callback, SlimePhaseCallback) and not callback.enabled
    callback.on_phase_begin("generate", "sampler", {"rollout_id": 0})  # inert: no lock, no error
    callback.on_phase_end("generate", "sampler", {"rollout_id": 0})
    callback.close()
