"""veRL's synchronous PPO/GRPO trainer (V1, colocated actor and rollout), time-sliced.

veRL drives its GPU workers from one controller, the ``TaskRunnerV1`` Ray actor, which builds
the trainer class registered under ``trainer.v1.trainer_mode`` and calls ``init()`` then
``fit()``. This module registers a subclass of veRL's ``PPOTrainerSync`` under
:data:`TRAINER_MODE`, so a run opts in with configuration only (no veRL code changes)::

    python -m verl.trainer.main_ppo ... \\
        trainer.v1.trainer_mode=timeslice_sync \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=\\
timeslice.integrations.verl.register_trainers \\
        +ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_JOB_ID=grpo-a \\
        +ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_GROUP=node-0-gpus \\
        +ray_kwargs.ray_init.runtime_env.env_vars.TIMESLICE_TARGET=orchestrator:50051

(:func:`hydra_overrides` prints that list.) Ray runs the setup hook in every worker process
of the job, so the trainer mode is registered in the ``TaskRunnerV1`` process before veRL
looks it up; the environment variables reach every worker too: the controller's client reads
``TIMESLICE_TARGET``/``TIMESLICE_JOB_ID``, and the agent's process discovery finds the GPU
workers and rollout servers by ``TIMESLICE_JOB_ID``/``TIMESLICE_GROUP`` (and
``TIMESLICE_NODE`` where several agents share a host).

Hook points (verl 0.9.1, ``verl/trainer/ppo/v1/trainer_base.py`` and ``trainer_sync.py``):

- ``PPOTrainer.init``: the group is acquired before it. ``init`` is where veRL loads the
  models onto the devices (``init_model`` on the worker group), starts the rollout servers and
  pushes the first weights (``on_init_end``), so nothing touches the devices before the job
  holds them.
- ``PPOTrainerSync.on_sample_end``: veRL puts its rollout replicas to sleep there (vLLM or
  SGLang free the weights and the KV cache). Right after that, the job yields and queues
  again: another job's step runs in the gap, while this job's only device state is its
  FSDP/Megatron actor (and critic).
- ``PPOTrainer.fit``: the group is given back when it returns or raises (its last step
  returns without calling ``on_train_end``).

So one hold covers training of step *N*, the weight sync, validation and the generation of
step *N+1*. The trainer keeps veRL's ``sync`` semantics: its constructor sets
``trainer.v1.trainer_mode`` back to ``sync`` (veRL's replay buffer and refill logic test for
that name).

What moves at a switch depends on the agent's backend:

- ``cuda``: the agent checkpoints every labelled GPU process of the job (discovered, no code).
  Run it with ``--discover nvml`` (the default on a GPU node): the controller holds no CUDA
  context, so it is never a candidate to freeze.
- ``app``: set ``TIMESLICE_VERL_APP_HOOKS=1``. After ``init`` the controller registers with
  its node's agent; the hooks move the worker groups' state through veRL's own
  ``ActorRolloutRefWorker.to`` / ``TrainingWorker.to`` (model, optimizer, gradients to the CPU
  at a checkpoint; back, except what veRL's ``param_offload``/``optimizer_offload`` keeps on
  the CPU anyway, at a restore). The rollout replicas are already asleep at the gap. The
  controller must then run on the GPU node (one node: its agent is the one that calls the
  hooks).

Other trainer modes are not covered: ``colocate_async`` resumes generation at the end of each
step, so its replicas never stop; ``separate_async`` generates continuously on its own pool.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.integrations._hold import Acquirer, GroupHold, Hold

if TYPE_CHECKING:
    from timeslice.worker import WorkerRegistration

__all__ = [
    "Hold",
    "Slicer",
    "TimeSlicedMixin",
    "hydra_overrides",
    "register_trainers",
    "runtime_env_vars",
    "trainer_class",
]

log = logging.getLogger("timeslice.integrations.verl")

TESTED_VERL = "0.9.1"
TRAINER_MODE = "timeslice_sync"
"""The ``trainer.v1.trainer_mode`` this module registers."""
BASE_MODE = "sync"
"""veRL's mode the time-sliced trainer extends (and reports to veRL's own code)."""
SETUP_HOOK = "timeslice.integrations.verl.register_trainers"
"""The Ray ``worker_process_setup_hook`` that registers :data:`TRAINER_MODE`."""

JOB_ENV = "TIMESLICE_JOB_ID"
GROUP_ENV = "TIMESLICE_GROUP"
POOL_ENV = "TIMESLICE_POOL"
"""Instead of ``TIMESLICE_GROUP``: the placement pool the trainer's role is placed in."""
ROLE_ENV = "TIMESLICE_ROLE"
"""With ``TIMESLICE_POOL``: the trainer's role in the pool (default ``trainer``)."""
NODE_ENV = "TIMESLICE_NODE"
TARGET_ENV = "TIMESLICE_TARGET"
TIMEOUT_ENV = "TIMESLICE_ACQUIRE_TIMEOUT"
APP_HOOKS_ENV = "TIMESLICE_VERL_APP_HOOKS"
_TLS_ENV = ("TIMESLICE_TLS_CA", "TIMESLICE_TLS_CERT", "TIMESLICE_TLS_KEY", "TIMESLICE_INSECURE")

# The veRL methods this module overrides or calls, with the parameters it relies on
# (checked against veRL's source in tests/integrations/test_verl.py).
HOOKS: Mapping[str, tuple[str, ...]] = {
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer.__init__": ("self", "config"),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer.init": ("self",),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer.fit": ("self", "agent_loop_manager"),
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync.on_sample_end": ("self",),
    "verl.trainer.ppo.v1.trainer_base.register_trainer": ("name",),
    "verl.workers.engine_workers.ActorRolloutRefWorker.to": (
        "self",
        "device",
        "model",
        "optimizer",
        "grad",
    ),
    "verl.workers.engine_workers.TrainingWorker.to": (
        "self",
        "device",
        "model",
        "optimizer",
        "grad",
    ),
}


class _Client(Acquirer, Protocol):
    """What the trainer needs of a client (TimeSliceOrchestratorClient has it)."""

    def close(self) -> None: ...


def runtime_env_vars(
    job_id: str,
    group_id: str,
    target: str,
    *,
    node: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The Ray ``runtime_env`` ``env_vars`` a time-sliced veRL run needs.

    ``TIMESLICE_JOB_ID`` and ``TIMESLICE_GROUP`` label every worker process for the agent's
    discovery and name the job and group to the controller; ``TIMESLICE_TARGET`` is the
    orchestrator; ``TIMESLICE_NODE`` pins the processes to one agent where several share a
    host. The TLS variables present in ``env`` (default ``os.environ``) are passed on as they
    are: the files must exist at the same paths on every Ray node.
    """
    env = os.environ if env is None else env
    out = {
        JOB_ENV: validate_job_id(job_id),
        GROUP_ENV: validate_group_id(group_id),
        TARGET_ENV: target,
    }
    if not target:
        raise InvalidArgument("target: the orchestrator's host:port is required")
    if node:
        out[NODE_ENV] = node
    out.update({name: env[name] for name in _TLS_ENV if env.get(name)})
    return out


def hydra_overrides(
    job_id: str,
    group_id: str,
    target: str,
    *,
    node: str | None = None,
    app_hooks: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The ``python -m verl.trainer.main_ppo`` overrides that turn time-slicing on."""
    env_vars = runtime_env_vars(job_id, group_id, target, node=node, env=env)
    if app_hooks:
        env_vars[APP_HOOKS_ENV] = "1"
    prefix = "+ray_kwargs.ray_init.runtime_env"
    return [
        "trainer.use_v1=True",
        f"trainer.v1.trainer_mode={TRAINER_MODE}",
        f"{prefix}.worker_process_setup_hook={SETUP_HOOK}",
        *(f"{prefix}.env_vars.{name}={value}" for name, value in env_vars.items()),
    ]


class Slicer(GroupHold):
    """The group's holds for one trainer: taken at ``init``, cycled at each step's gap.
    :attr:`holds` records them (reason ``init`` or ``step``).

    Thread-safe: the agent calls the app hooks from another thread while the trainer's
    thread waits in :meth:`switch`.
    """

    client: _Client  # it also closes the client

    def __init__(self, client: _Client, group_id: str, *, timeout: float | None = None) -> None:
        super().__init__(client, group_id, timeout=timeout)
        self.registration: WorkerRegistration | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Slicer:
        """A slicer with a client made from the environment (see :func:`runtime_env_vars`)."""
        env = os.environ if env is None else env
        where = GROUP_ENV if env.get(GROUP_ENV) or not env.get(POOL_ENV) else POOL_ENV
        missing = [name for name in (JOB_ENV, where, TARGET_ENV) if not env.get(name)]
        if missing:
            raise InvalidArgument(
                f"time-sliced veRL needs {', '.join(missing)} in the Ray runtime_env "
                "(timeslice.integrations.verl.hydra_overrides lists them)"
            )
        try:
            timeout = float(env[TIMEOUT_ENV]) if env.get(TIMEOUT_ENV) else None
        except ValueError as exc:
            raise InvalidArgument(f"{TIMEOUT_ENV} must be a number of seconds") from exc
        from timeslice.client import TimeSliceOrchestratorClient

        client = TimeSliceOrchestratorClient(env[TARGET_ENV], job_id=env[JOB_ENV])
        if where == POOL_ENV:
            # The orchestrator places the role (docs/placement.md); the agent still finds
            # the workers by TIMESLICE_GROUP, which the launcher sets from `timeslice place`.
            try:
                group = client.group_for(env[POOL_ENV], env.get(ROLE_ENV) or "trainer")
            except BaseException:
                client.close()
                raise
            return cls(client, group, timeout=timeout)
        return cls(client, env[GROUP_ENV], timeout=timeout)

    def switch(self) -> None:
        """The gap between two holds: give the group back and queue for it again."""
        self.leave()
        self.enter("step")

    def register(self, on_checkpoint: Callable[[], None], on_restore: Callable[[], None]) -> None:
        """Register this (controller) process with the node agent, with app hooks (once)."""
        if self.registration is not None:
            return
        from timeslice.worker import register

        self.registration = register(
            self.group_id,
            job_id=self.client.job_id,
            on_checkpoint=on_checkpoint,
            on_restore=on_restore,
            acquirer=True,  # it calls acquire itself: never to be frozen
        )

    def close(self) -> None:
        """End the registration, give the group back and close the client. Idempotent."""
        try:
            if self.registration is not None:
                registration, self.registration = self.registration, None
                registration.close()
            self.leave()
        finally:
            self.client.close()


def _select(config: Any, path: str) -> Any:
    """``config.a.b.c`` or None where a key is missing (a veRL DictConfig or any object)."""
    node = config
    for part in path.split("."):
        node = getattr(node, part, None)  # DictConfig's missing key is an AttributeError
        if node is None:
            return None
    return node


def _offload_flags(config: Any, role: str) -> tuple[bool, bool]:
    """(param_offload, optimizer_offload) of a role's engine config, for FSDP or Megatron."""
    for engine in ("fsdp_config", "megatron"):
        section = _select(config, f"{role}.{engine}")
        if section is not None:
            return (
                bool(getattr(section, "param_offload", False)),
                bool(getattr(section, "optimizer_offload", False)),
            )
    return False, False


class TimeSlicedMixin:
    """The time-slicing overrides; put before veRL's ``PPOTrainerSync`` in the bases.

    Kept free of veRL imports so it can be checked without veRL; :func:`trainer_class` makes
    the real subclass.
    """

    timeslice: Slicer
    config: Any
    use_critic: bool
    actor_rollout_wg: Any
    critic_wg: Any

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # veRL's base class tests trainer_mode == "sync" (replay buffer, refills): keep them.
        # The key exists, so a struct-mode DictConfig takes the assignment.
        config.trainer.v1.trainer_mode = BASE_MODE
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        if not hasattr(self, "timeslice"):  # a test may give one first
            self.timeslice = Slicer.from_env()

    def init(self) -> None:
        """veRL's init (models onto the devices, rollout servers up), holding the group."""
        self.timeslice.enter("init")
        super().init()  # type: ignore[misc]
        if os.environ.get(APP_HOOKS_ENV) == "1":
            self.timeslice.register(self._offload, self._onload)

    def on_sample_end(self) -> None:
        """veRL's (its rollout replicas go to sleep), then the gap where another job runs."""
        super().on_sample_end()  # type: ignore[misc]
        self.timeslice.switch()

    def fit(self, agent_loop_manager: Any) -> Any:
        """veRL's fit; the group is given back however it ends."""
        try:
            return super().fit(agent_loop_manager)  # type: ignore[misc]
        finally:
            self.timeslice.close()

    # The app hooks: run in the agent's hook thread while the trainer waits in switch().

    def _groups(self) -> list[tuple[Any, str]]:
        groups = [(self.actor_rollout_wg, "actor_rollout_ref.actor")]
        if self.use_critic:
            groups.append((self.critic_wg, "critic"))
        return groups

    def _offload(self) -> None:
        for wg, _ in self._groups():
            wg.to("cpu", model=True, optimizer=True, grad=True)

    def _onload(self) -> None:
        for wg, role in self._groups():
            param_offload, optimizer_offload = _offload_flags(self.config, role)
            # What veRL offloads itself between calls stays on the CPU: it loads it when needed.
            if not (param_offload and optimizer_offload):
                wg.to(
                    "device",
                    model=not param_offload,
                    optimizer=not optimizer_offload,
                    grad=not param_offload,
                )


_TRAINER: type[Any] | None = None


def trainer_class() -> type[Any]:
    """The time-sliced ``PPOTrainerSync`` subclass (imports veRL)."""
    global _TRAINER
    if _TRAINER is None:
        # Imported by name: veRL is not a dependency of this package (nor typed).
        base = importlib.import_module("verl.trainer.ppo.v1.trainer_sync").PPOTrainerSync
        _TRAINER = type(
            "TimeSlicedPPOTrainerSync",
            (TimeSlicedMixin, base),
            {"__module__": __name__, "__doc__": TimeSlicedMixin.__doc__},
        )
    return _TRAINER


def register_trainers() -> None:
    """Register :data:`TRAINER_MODE` with veRL (idempotent); the Ray setup hook."""
    registry = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    registry.register_trainer(TRAINER_MODE)(trainer_class())
