"""``timeslice.integrations.verl``: the time-sliced veRL trainer.

veRL cannot be installed next to TRL (it needs ``transformers < 5.11``), so the checks against
the real package run in a separate environment: set ``TIMESLICE_VERL_PYTHON`` to a Python with
``verl==0.9.1`` (and ``TransferQueue``, ``cachetools``, ``uvicorn``, ``fastapi``, plus this
project's dependencies) and :func:`test_against_the_real_verl` runs
``tests/integrations/verl_checks.py`` there (about 30 s). Here, without veRL: the module's hook
table against the signatures recorded from veRL 0.9.1 by that script, the trainer's overrides
on a stand-in with veRL's call order, the slicer and the launch overrides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from timeslice._types import Grant
from timeslice.errors import InvalidArgument
from timeslice.integrations import verl as tv

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("verl_hooks.json")


def test_the_hooks_exist_in_the_recorded_verl_with_the_arguments_used() -> None:
    recorded = json.loads(RECORDED.read_text())
    assert recorded["verl"] == tv.TESTED_VERL
    assert set(recorded["signatures"]) == set(tv.HOOKS)
    for path, params in tv.HOOKS.items():
        assert recorded["signatures"][path][: len(params)] == list(params), path


def test_importing_the_module_does_not_import_verl() -> None:
    code = "import sys, timeslice, timeslice.integrations.verl; print('verl' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "libs")},
    )
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(
    not os.environ.get("TIMESLICE_VERL_PYTHON"),
    reason="set TIMESLICE_VERL_PYTHON to a Python with verl 0.9.1 (see the module docstring)",
)
def test_against_the_real_verl() -> None:
    out = subprocess.run(
        [os.environ["TIMESLICE_VERL_PYTHON"], str(ROOT / "tests/integrations/verl_checks.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"verl checks passed with verl {tv.TESTED_VERL}" in out.stdout


# ----------------------------------------------------------------------------- stand-ins


class FakeClient:
    job_id = "job-v"

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.closed = False

    def acquire(self, group_id: str, *, timeout: float | None = None) -> Grant:
        self.events.append(f"acquire:{group_id}")
        return Grant(group_id, self.job_id, 1, 0.0, False, None, 0.0)

    def yield_(self, group_id: str) -> None:
        self.events.append(f"yield:{group_id}")

    def close(self) -> None:
        self.closed = True


class Node:
    """Attribute access like veRL's DictConfig."""

    def __init__(self, **items: Any) -> None:
        self.__dict__.update(items)


def make_config(param_offload: bool = False, optimizer_offload: bool = False) -> Node:
    fsdp = Node(param_offload=param_offload, optimizer_offload=optimizer_offload)
    return Node(
        trainer=Node(v1=Node(trainer_mode=tv.TRAINER_MODE)),
        actor_rollout_ref=Node(actor=Node(fsdp_config=fsdp)),
        critic=Node(fsdp_config=Node(param_offload=False, optimizer_offload=False)),
    )


class WorkerGroup:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def to(
        self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        self.events.append(f"{self.name}.to:{device}:{int(model)}{int(optimizer)}{int(grad)}")


class StandInSync:
    """veRL 0.9.1's PPOTrainer/PPOTrainerSync call order, without veRL."""

    events: list[str]

    def __init__(self, config: Any) -> None:
        self.config = config
        self.mode_seen = config.trainer.v1.trainer_mode
        self.use_critic = True
        self.actor_rollout_wg = WorkerGroup(self.events, "actor")
        self.critic_wg = WorkerGroup(self.events, "critic")

    def init(self) -> None:
        self.events.append("verl:setup")

    def on_sample_end(self) -> None:
        self.events.append("verl:sleep_replicas")

    def fit(self, agent_loop_manager: Any) -> Any:
        for _ in range(2):
            self.events.append("verl:step")
            self.on_sample_end()
        if agent_loop_manager == "fail":
            raise RuntimeError("step failed")
        return "done"


class RecordingSlicer(tv.Slicer):
    """Records the app hooks instead of registering with a node agent."""

    registered: list[tuple[Callable[[], None], Callable[[], None]]]

    def register(self, on_checkpoint: Callable[[], None], on_restore: Callable[[], None]) -> None:
        self.registered.append((on_checkpoint, on_restore))


def make_trainer(events: list[str], config: Node | None = None) -> tuple[Any, FakeClient]:
    client = FakeClient(events)
    slicer = RecordingSlicer(client, "gpus-0")
    slicer.registered = []

    class Trainer(tv.TimeSlicedMixin, StandInSync):
        pass

    Trainer.events = events
    Trainer.timeslice = slicer  # the mixin keeps a slicer given first
    return Trainer(config or make_config()), client


def test_the_group_is_held_from_init_and_cycled_after_each_sleep() -> None:
    events: list[str] = []
    trainer, client = make_trainer(events)
    assert trainer.mode_seen == tv.BASE_MODE  # veRL's own code sees its "sync" mode
    trainer.init()
    assert trainer.fit(object()) == "done"
    assert events == [
        "acquire:gpus-0",
        "verl:setup",
        "verl:step",
        "verl:sleep_replicas",
        "yield:gpus-0",
        "acquire:gpus-0",
        "verl:step",
        "verl:sleep_replicas",
        "yield:gpus-0",
        "acquire:gpus-0",
        "yield:gpus-0",  # fit returned
    ]
    assert client.closed and not trainer.timeslice.held
    assert [h.reason for h in trainer.timeslice.holds] == ["init", "step", "step"]
    assert all(h.released_at >= h.granted_at for h in trainer.timeslice.holds)


def test_a_failing_fit_gives_the_group_back() -> None:
    events: list[str] = []
    trainer, client = make_trainer(events)
    trainer.init()
    with pytest.raises(RuntimeError, match="step failed"):
        trainer.fit("fail")
    assert events[-1] == "yield:gpus-0" and client.closed


def test_app_hooks_register_after_init_and_move_through_verl_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(tv.APP_HOOKS_ENV, "1")
    events: list[str] = []
    trainer, _ = make_trainer(events, make_config(param_offload=True))
    assert trainer.timeslice.registered == []
    trainer.init()
    [(offload, onload)] = trainer.timeslice.registered
    events.clear()
    offload()
    onload()
    # Everything to the CPU; back, except the parameters veRL's param_offload keeps there.
    assert events == [
        "actor.to:cpu:111",
        "critic.to:cpu:111",
        "actor.to:device:010",
        "critic.to:device:111",
    ]


def test_no_app_hooks_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tv.APP_HOOKS_ENV, raising=False)
    trainer, _ = make_trainer([])
    trainer.init()
    assert trainer.timeslice.registered == []


def test_the_slicer_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="TIMESLICE_GROUP, TIMESLICE_TARGET"):
        tv.Slicer.from_env({"TIMESLICE_JOB_ID": "a"})
    env = {
        "TIMESLICE_JOB_ID": "job-a",
        "TIMESLICE_GROUP": "gpus-0",
        "TIMESLICE_TARGET": "127.0.0.1:1",
        "TIMESLICE_ACQUIRE_TIMEOUT": "x",
    }
    with pytest.raises(InvalidArgument, match="TIMESLICE_ACQUIRE_TIMEOUT"):
        tv.Slicer.from_env(env)
    monkeypatch.setenv("TIMESLICE_INSECURE", "1")
    slicer = tv.Slicer.from_env({**env, "TIMESLICE_ACQUIRE_TIMEOUT": "30"})
    try:
        assert (slicer.group_id, slicer.timeout, slicer.client.job_id) == ("gpus-0", 30.0, "job-a")
    finally:
        slicer.client.close()


def test_the_launch_overrides() -> None:
    env = {"TIMESLICE_TLS_CA": "/etc/ts/ca.pem", "UNRELATED": "x"}
    overrides = tv.hydra_overrides(
        "grpo-a", "node-0-gpus", "orch:50051", node="n0", app_hooks=True, env=env
    )
    prefix = "+ray_kwargs.ray_init.runtime_env"
    assert overrides == [
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=timeslice_sync",
        f"{prefix}.worker_process_setup_hook=timeslice.integrations.verl.register_trainers",
        f"{prefix}.env_vars.TIMESLICE_JOB_ID=grpo-a",
        f"{prefix}.env_vars.TIMESLICE_GROUP=node-0-gpus",
        f"{prefix}.env_vars.TIMESLICE_TARGET=orch:50051",
        f"{prefix}.env_vars.TIMESLICE_NODE=n0",
        f"{prefix}.env_vars.TIMESLICE_TLS_CA=/etc/ts/ca.pem",
        f"{prefix}.env_vars.TIMESLICE_VERL_APP_HOOKS=1",
    ]
    # The setup hook names a real function of this module.
    module, _, name = tv.SETUP_HOOK.rpartition(".")
    assert module == tv.__name__ and callable(getattr(tv, name))
    with pytest.raises(InvalidArgument):
        tv.runtime_env_vars("bad id!", "g", "orch:1", env={})
    with pytest.raises(InvalidArgument):
        tv.runtime_env_vars("job", "g", "", env={})
