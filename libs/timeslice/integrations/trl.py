"""TRL's ``GRPOTrainer`` (and its relatives), time-sliced: generation and training each hold
the group, and the job yields between them.

A colocated trainer generates and trains in one process on the same devices, so both phases
use **one** group; the job gives the group back after each phase, and another job's phase
runs in the gap::

    from timeslice import TimeSliceOrchestratorClient
    from timeslice.integrations.trl import time_slice
    from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)
    client = TimeSliceOrchestratorClient()          # TIMESLICE_TARGET / TIMESLICE_JOB_ID
    with time_slice(trainer, client, group_id="grpo-pool") as sliced:
        trainer.train()
        with sliced.hold():                          # the state may be parked between phases
            trainer.save_model("out")

Hook points (TRL 1.16, ``trl/trainer/grpo_trainer.py``): the **generation phase** is
``GRPOTrainer._generate_and_score_completions`` (generation, rewards, the old and reference
log-probabilities); the **training phase** runs from the first ``compute_loss`` of an
optimizer step to ``TrainerCallback.on_step_end`` (after ``optimizer.step()`` and
``zero_grad``). Both are wrapped on the trainer *instance*; TRL's classes are not changed.

What moves at a switch: the trainer registers a :class:`~timeslice.offload.TorchOffloader`
with the node agent at ``on_train_begin`` (the optimizer exists from then on) tracking the
policy, the reference model and the optimizer's state, so the agent's ``app`` backend parks
them in host memory while another job holds the group, and restores them bit-exact before
this job's next phase. Generation's KV caches are transient in ``model.generate`` (freed when
it returns), so nothing else holds device memory between phases.

Outside a phase the tracked storages may be parked (size 0): code that reads the model between
phases, or after ``train()``, does it inside :meth:`TimeSlicedTrainer.hold`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id
from timeslice.integrations._hold import GroupHold, Hold

__all__ = ["Hold", "TimeSlicedTrainer", "time_slice"]

if TYPE_CHECKING:
    from timeslice._types import Grant
    from timeslice.client import TimeSliceOrchestratorClient
    from timeslice.offload import TorchOffloader
    from timeslice.worker import WorkerRegistration

log = logging.getLogger("timeslice.integrations.trl")

TESTED_TRL = "1.16.0"
GENERATION_HOOK = "_generate_and_score_completions"
LOSS_HOOK = "compute_loss"


class TimeSlicedTrainer(GroupHold):
    """A trainer's phases wired to one group (see the module docstring). Made by
    :func:`time_slice`; a context manager that undoes the wiring and ends the registration.
    :attr:`holds` records every hold: ``generation``, ``training`` or ``hold``."""

    def __init__(
        self,
        trainer: Any,
        client: TimeSliceOrchestratorClient,
        group_id: str,
        *,
        offloader: TorchOffloader | None,
        timeout: float | None,
        on_grant: Callable[[str, Grant], None] | None,
    ) -> None:
        super().__init__(client, group_id, timeout=timeout, on_grant=on_grant)
        self.trainer = trainer
        self.offloader = offloader
        self.registration: WorkerRegistration | None = None
        self._originals: dict[str, Any] = {}
        self._callback: Any = None

    # ------------------------------------------------------------------ wiring

    def _install(self) -> None:
        from transformers import TrainerCallback

        trainer = self.trainer
        generate = getattr(trainer, GENERATION_HOOK)
        compute_loss = getattr(trainer, LOSS_HOOK)
        self._originals = {GENERATION_HOOK: generate, LOSS_HOOK: compute_loss}

        def generation_phase(*args: Any, **kwargs: Any) -> Any:
            # A phase of its own: held for the call, given back after it, unless the
            # training phase already held the group (gradient accumulation).
            was_held = self._held
            self.enter("generation")
            try:
                return generate(*args, **kwargs)
            finally:
                if not was_held:
                    self.leave()

        def training_phase(*args: Any, **kwargs: Any) -> Any:
            self.enter("training")  # held until on_step_end
            return compute_loss(*args, **kwargs)

        setattr(trainer, GENERATION_HOOK, generation_phase)
        setattr(trainer, LOSS_HOOK, training_phase)
        sliced = self

        class _Phases(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                sliced._register(kw.get("optimizer"))

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                sliced.leave()

            def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                sliced.leave()

        self._callback = _Phases()
        trainer.add_callback(self._callback)

    def _register(self, optimizer: Any) -> None:
        """Track the trainer's state and register it with the node agent (once)."""
        if self.offloader is None or self.registration is not None:
            return
        trainer = self.trainer
        self.offloader.add_module(trainer.model, tag="policy")
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            self.offloader.add_module(ref, tag="reference")
        if optimizer is not None:
            self.offloader.add_optimizer(optimizer, tag="optimizer")
        self.registration = self.offloader.register(self.group_id, job_id=self.client.job_id)
        log.info(
            "registered the trainer's state (%d bytes) for group %s",
            self.offloader.device_bytes,
            self.group_id,
        )

    def close(self) -> None:
        """Give the group back, end the registration and undo the wiring. Idempotent."""
        if self.registration is not None:
            # Before the yield: a job that is leaving must not be offloaded on its way out.
            with self.hold():
                self.registration.close()
            self.registration = None
        self.leave()
        for name, original in self._originals.items():
            setattr(self.trainer, name, original)
        self._originals = {}
        if self._callback is not None:
            self.trainer.remove_callback(self._callback)
            self._callback = None

    def __enter__(self) -> TimeSlicedTrainer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def time_slice(
    trainer: Any,
    client: TimeSliceOrchestratorClient,
    group_id: str,
    *,
    offloader: TorchOffloader | None = None,
    register: bool = True,
    timeout: float | None = None,
    on_grant: Callable[[str, Grant], None] | None = None,
) -> TimeSlicedTrainer:
    """Time-slice ``trainer`` (a TRL ``GRPOTrainer``, or a trainer with the same two hook
    points) on ``group_id`` through ``client``.

    Args:
        offloader: what moves the trainer's state at a switch; by default a new
            :class:`~timeslice.offload.TorchOffloader`. Pass one to choose its options
            (``keep_pinned``) or to track more tensors.
        register: register the state with the node agent at ``on_train_begin`` (the ``app``
            backend). ``False`` for the ``cuda`` backend, which finds the process itself.
        timeout: seconds each phase may wait for the group (None: no limit).
        on_grant: called with the phase name and the grant, after each acquire.
    """
    group = validate_group_id(group_id)
    for hook in (GENERATION_HOOK, LOSS_HOOK, "add_callback", "remove_callback"):
        if not callable(getattr(trainer, hook, None)):
            raise InvalidArgument(
                f"{type(trainer).__name__} has no {hook}(): time_slice needs a TRL GRPOTrainer "
                f"(tested with trl {TESTED_TRL}) or a trainer with the same hook points"
            )
    if register and offloader is None:
        from timeslice.offload import TorchOffloader

        offloader = TorchOffloader()
    sliced = TimeSlicedTrainer(
        trainer,
        client,
        group,
        offloader=offloader if register else None,
        timeout=timeout,
        on_grant=on_grant,
    )
    sliced._install()
    return sliced
