# mypy: disable-error-code="import-not-found"
# (veRL and Hydra live only in the environment this script runs in.)
"""Checks of ``timeslice.integrations.verl`` against the real veRL package.

Run by ``tests/integrations/test_verl.py`` with a Python that has veRL installed (veRL needs
``transformers < 5.11``, so it cannot share the project's environment, which has TRL's):
``$TIMESLICE_VERL_PYTHON tests/integrations/verl_checks.py``. ``--record PATH`` writes the
signatures of the veRL methods the integration relies on (the file the project-environment
test compares :data:`timeslice.integrations.verl.HOOKS` with).

Exits non-zero on the first failed check. Nothing here touches a GPU: veRL's trainer is built
from its real default config, and the parts that would start workers are replaced on the
instance.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT / "services")]
os.environ.update(
    TIMESLICE_JOB_ID="verl-job",
    TIMESLICE_GROUP="verl-group",
    TIMESLICE_TARGET="127.0.0.1:1",  # never dialled: the slicer is replaced below
    TIMESLICE_INSECURE="1",
)

from timeslice.integrations import verl as tv  # noqa: E402


def signatures() -> dict[str, list[str]]:
    """The parameters of every veRL callable in ``HOOKS``, as this veRL has them."""
    out = {}
    for path in tv.HOOKS:
        parts = path.split(".")
        obj: Any = None
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        out[path] = list(inspect.signature(obj).parameters)
    return out


class FakeSlicer:
    """Records what the trainer asks of the group instead of talking to an orchestrator."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.registered = False

    def enter(self, reason: str) -> None:
        self.events.append(f"acquire:{reason}")

    def switch(self) -> None:
        self.events.append("yield")
        self.events.append("acquire:step")

    def register(self, *hooks: Any) -> None:
        self.registered = True

    def close(self) -> None:
        self.events.append("close")


class FakeCheckpointManager:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def sleep_replicas(self) -> None:
        self.events.append("verl:sleep_replicas")

    def update_weights(self, global_steps: int) -> None:
        self.events.append("verl:update_weights")


class FakeWorkerGroup:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def to(
        self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        self.calls.append((device, model, optimizer, grad))


def main() -> None:
    if sys.argv[1:2] == ["--record"]:
        import verl

        record = {"verl": verl.__version__, "signatures": signatures()}
        pathlib.Path(sys.argv[2]).write_text(json.dumps(record, indent=2) + "\n")
        return

    import verl
    from hydra import compose, initialize_config_dir

    assert verl.__version__ == tv.TESTED_VERL, verl.__version__
    for path, params in signatures().items():
        want = list(tv.HOOKS[path])
        assert params[: len(want)] == want, f"{path}: veRL has {params}, the module needs {want}"

    # Registration, as Ray's worker_process_setup_hook does it (twice: idempotent).
    setup = tv.SETUP_HOOK.rpartition(".")
    getattr(importlib.import_module(setup[0]), setup[2])()
    tv.register_trainers()
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    cls = get_trainer_cls(tv.TRAINER_MODE)
    assert issubclass(cls, PPOTrainerSync), cls.__mro__

    # veRL's real default config and constructor: the mode veRL's own code sees stays "sync".
    config_dir = str(pathlib.Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(
            config_name="ppo_trainer",
            overrides=[f"trainer.v1.trainer_mode={tv.TRAINER_MODE}", "trainer.logger=[console]"],
        )
    trainer = cls(config)
    assert type(trainer.replay_buffer) is ReplayBuffer, type(trainer.replay_buffer)
    assert trainer.trainer_mode == tv.BASE_MODE and config.trainer.v1.trainer_mode == "sync"
    assert isinstance(trainer.timeslice, tv.Slicer)
    assert trainer.timeslice.group_id == "verl-group"
    assert trainer.timeslice.client.job_id == "verl-job"
    trainer.timeslice.client.close()

    # init: the group first, then veRL's _setup (models onto the devices) and on_init_end.
    events: list[str] = []
    trainer.timeslice = FakeSlicer(events)
    trainer.checkpoint_manager = FakeCheckpointManager(events)
    trainer._setup = lambda: events.append("verl:_setup")
    trainer.global_steps = 0
    trainer.init()
    assert events == ["acquire:init", "verl:_setup", "verl:update_weights"], events

    # The gap: veRL's PPOTrainerSync.on_sample_end sleeps the replicas, then the switch.
    events.clear()
    trainer.curr_step_profile = False
    trainer.on_sample_end()
    assert events == ["verl:sleep_replicas", "yield", "acquire:step"], events

    # fit gives the group back however it ends (here veRL's validation raises).
    events.clear()

    def failing_validate() -> None:
        raise RuntimeError("stop")

    trainer._validate = failing_validate
    try:
        trainer.fit(agent_loop_manager=object())
    except RuntimeError as exc:
        assert str(exc) == "stop"
    else:
        raise AssertionError("fit did not raise")
    assert events[-1] == "close", events

    # The app hooks drive veRL's own worker-group offload (the default config: no offload).
    assert trainer.use_critic  # veRL's default algorithm (GAE) has a critic
    trainer.actor_rollout_wg, trainer.critic_wg = FakeWorkerGroup(), FakeWorkerGroup()
    trainer._offload()
    trainer._onload()
    for wg in (trainer.actor_rollout_wg, trainer.critic_wg):
        assert wg.calls == [("cpu", True, True, True), ("device", True, True, True)], wg.calls
    # With veRL's own param and optimizer offload, what veRL keeps on the CPU stays there.
    config.actor_rollout_ref.actor.fsdp_config.param_offload = True
    trainer.actor_rollout_wg.calls.clear()
    trainer._onload()
    assert trainer.actor_rollout_wg.calls == [("device", False, True, False)], (
        trainer.actor_rollout_wg.calls
    )
    # veRL's real worker method takes those arguments.
    from verl.workers.engine_workers import ActorRolloutRefWorker

    inspect.signature(ActorRolloutRefWorker.to).bind(
        None, "cpu", model=True, optimizer=True, grad=True
    )
    check_ray_setup_hook()
    print("verl checks passed with verl", verl.__version__)


def check_ray_setup_hook() -> None:
    """The runtime_env of hydra_overrides registers the mode in a fresh Ray worker process."""
    import ray

    overrides = tv.hydra_overrides("verl-job", "verl-group", "127.0.0.1:1", env={})
    prefix = "+ray_kwargs.ray_init.runtime_env."
    runtime_env: dict[str, Any] = {"env_vars": {}}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith(prefix + "env_vars."):
            runtime_env["env_vars"][key.removeprefix(prefix + "env_vars.")] = value
        elif key.startswith(prefix):
            runtime_env[key.removeprefix(prefix)] = value
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(sys.path[:2])

    @ray.remote
    def lookup() -> tuple[str, str, str]:
        from verl.trainer.ppo.v1 import get_trainer_cls  # no registration here: the hook did it

        return (
            get_trainer_cls(tv.TRAINER_MODE).__name__,
            os.environ["TIMESLICE_JOB_ID"],
            os.environ["TIMESLICE_GROUP"],
        )

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    try:
        found = ray.get(lookup.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert found == ("TimeSlicedPPOTrainerSync", "verl-job", "verl-group"), found


if __name__ == "__main__":
    main()
