"""One job of the GPU check: ``python -m scripts.gpu_check.job CONFIG``.

Job 0 is a *trainer*: it builds its state (:mod:`scripts.gpu_check.state`) before it registers,
and takes one in-place "optimizer step" per hold. Job 1 is a *sampler*: its weights never
change, and it builds them only inside its first hold, after job 0 was switched out, so the two
states are never on the device together. Both register with the node agent (``app``: a
:class:`timeslice.offload.TorchOffloader`, the sampler's with ``keep_pinned`` so an unchanged
state is released without a copy; ``cuda``: ``timeslice.worker.register`` of the pid, whose
whole device state the agent checkpoints). Each hold:

1. ``acquire``; a grant whose previous holder is the peer followed a switch;
2. compare every word of the state with the content regenerated for its generation
   (``--corrupt-after-restore``: the trainer flips one byte first, after its first restore);
3. read NVML: this process must hold its state, the peer (switched out) must hold ~nothing;
4. trainer: step; wait until the peer queues for the group (so the yield switches), ``yield_``.

Every hold is one line in ``events-<i>.jsonl``. When done, the job waits until it was switched
out (or the peer is done), writes ``result-<i>.json`` and ends at once with ``os._exit``: no
interpreter teardown, whose CUDA calls would block in a checkpointed process. Under ``cuda`` it
does not end itself: a live restored process must be locked and checkpointed before it dies
(NVIDIA/cuda-checkpoint#53), so it waits for the check to park and kill it.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from scripts.gpu_check.nvml import Nvml, NvmlMissing
from scripts.gpu_check.protocol import (
    POLL_SECONDS,
    JobConfig,
    RunFiles,
    read_json,
    wait_for_file,
    write_json,
)
from scripts.gpu_check.state import TrainState, build_state
from timeslice import NotFound, TimeSliceOrchestratorClient, WorkerRegistration, register
from timeslice.offload import CycleStats, TorchOffloader

REGISTER_SECONDS = 30.0


class JobStopped(Exception):
    """The job ends early for a reason it records (deadline, the peer stopped, a mismatch)."""


class RecordingOffloader(TorchOffloader):
    """The product's offloader, keeping each offload's stats (the restore overwrites
    ``last_stats`` before the job could read them)."""

    def __init__(self, *, keep_pinned: bool) -> None:
        super().__init__(keep_pinned=keep_pinned)
        self.offloads: list[dict[str, Any]] = []

    def offload(self, tags: Any = None) -> int:
        copied = super().offload(tags)
        stats = self.last_stats
        if stats is not None:
            self.offloads.append(stats_json(stats))
        return copied


def stats_json(stats: CycleStats) -> dict[str, Any]:
    """A cycle's figures; fields an older offloader lacks read as 0."""
    out = asdict(stats)
    for name in ("skipped_bytes", "pin_seconds", "copy_seconds"):
        out.setdefault(name, 0)
    return out


@dataclass
class Job:
    """A job: its config, state (None until the sampler's first hold) and links."""

    cfg: JobConfig
    files: RunFiles
    state: TrainState | None
    registration: WorkerRegistration | None
    offloader: RecordingOffloader | None
    nvml: Nvml | None
    peer_pid: int = -1
    reported_offloads: int = 0

    @property
    def trainer(self) -> bool:
        return self.cfg.index == 0


def _build(cfg: JobConfig) -> tuple[TrainState, dict[str, float]]:
    started = time.perf_counter()
    state = build_state(torch.device(cfg.device), cfg.size_bytes, seed=cfg.index + 1)
    return state, {"build_seconds": time.perf_counter() - started}


def _track(offloader: TorchOffloader, state: TrainState) -> None:
    offloader.add_module(state.module)
    offloader.add_optimizer(state.optimizer)


def _register(job: Job) -> None:
    cfg = job.cfg
    if cfg.backend == "app":
        # The sampler always keeps its host copy: that is what lets an unchanged state go
        # without a copy. The trainer keeps it with --keep-pinned.
        job.offloader = RecordingOffloader(keep_pinned=cfg.keep_pinned or not job.trainer)
        if job.state is not None:
            _track(job.offloader, job.state)
        job.registration = job.offloader.register(
            cfg.group, job_id=cfg.job_id, socket=cfg.agent_socket, acquirer=True,
            state_bytes=cfg.size_bytes, timeout=REGISTER_SECONDS,
        )  # fmt: skip
        return
    # The cuda backend moves the whole process: announce the pid and the bytes it will hold.
    job.registration = register(
        cfg.group, job_id=cfg.job_id, pid=os.getpid(), state_bytes=cfg.size_bytes,
        socket=cfg.agent_socket, acquirer=True, timeout=REGISTER_SECONDS,
    )  # fmt: skip


def _nvml_reading(nvml: Nvml | None, peer_pid: int) -> dict[str, Any]:
    if nvml is None:
        return {}
    held = nvml.held_by_pid()
    own = os.getpid()
    reading: dict[str, Any] = {
        "nvml_own_bytes": held.get(own, 0),
        "nvml_own_listed": own in held,
        "nvml_peer_bytes": held.get(peer_pid, 0),
        "nvml_peer_listed": peer_pid in held,
    }
    if own not in held:
        # In another pid namespace NVML names host pids: keep what it did list.
        reading["nvml_pids_listed"] = sorted(held)
    return reading


def setup(cfg: JobConfig) -> Job:
    """Trainer: build the state. Both: register, open NVML; writes ``ready-<i>.json``."""
    job = Job(cfg, RunFiles(Path(cfg.run_dir)), None, None, None, None)
    ready: dict[str, Any] = {"pid": os.getpid(), "role": "trainer" if job.trainer else "sampler"}
    if job.trainer:
        job.state, timing = _build(cfg)
        ready.update(timing, state_bytes=job.state.nbytes)
    _register(job)
    if cfg.use_nvml:
        try:
            job.nvml = Nvml()
        except NvmlMissing as exc:
            ready["nvml_note"] = str(exc)
    write_json(job.files.ready(cfg.index), ready)
    return job


def _holder(client: TimeSliceOrchestratorClient, group: str) -> str:
    try:
        return client.status(group).holder_job_id
    except NotFound:  # nobody has asked for the group yet
        return ""


def _wait_for_first_holder(job: Job, client: TimeSliceOrchestratorClient) -> None:
    """Job 1 lets job 0 take the first grant, so the number of switches is exact."""
    cfg = job.cfg
    while _holder(client, cfg.group) != cfg.peer_job_id:
        if time.time() >= cfg.deadline:
            raise JobStopped("job 0 never took the group")
        if job.files.finished(cfg.peer_index).exists():
            raise JobStopped("job 0 stopped before it took the group")
        time.sleep(POLL_SECONDS)


def _wait_for_peer_queued(job: Job, client: TimeSliceOrchestratorClient) -> str:
    """Block until yielding will switch: the peer waits in the queue (or will never come)."""
    cfg = job.cfg
    while True:
        if job.files.finished(cfg.peer_index).exists():
            return "peer finished"
        if any(e.job_id == cfg.peer_job_id for e in client.status(cfg.group).queue):
            return "peer queued"
        if time.time() >= cfg.deadline:
            return "deadline"
        time.sleep(POLL_SECONDS)


def _first_build(job: Job, event: dict[str, Any]) -> None:
    """The sampler's state, built inside its first hold (job 0 is switched out by now)."""
    job.state, timing = _build(job.cfg)
    event.update(timing, built=True, state_bytes=job.state.nbytes)
    if job.offloader is not None:
        _track(job.offloader, job.state)
    write_json(job.files.built(job.cfg.index), {"state_bytes": job.state.nbytes, **timing})


def _adapter_figures(job: Job, event: dict[str, Any]) -> None:
    """The adapter's own figures of the switch that just brought this job back: the offload
    that took it out, and the restore (the last cycle, unless the restore moved nothing)."""
    if job.offloader is None:
        return
    new = job.offloader.offloads[job.reported_offloads :]
    job.reported_offloads = len(job.offloader.offloads)
    if new:
        event["adapter_offload"] = new[-1]
    stats = job.offloader.last_stats
    if stats is not None and (not new or stats_json(stats) != new[-1]):
        event["adapter_restore"] = stats_json(stats)


def hold_once(job: Job, client: TimeSliceOrchestratorClient, hold: int) -> dict[str, Any]:
    """One acquire / check / step / yield cycle; returns its event."""
    cfg = job.cfg
    remaining = cfg.deadline - time.time()
    if remaining <= 0:
        raise JobStopped(f"deadline reached before hold {hold}")
    requested = time.time()
    grant = client.acquire(cfg.group, timeout=remaining)
    granted = time.time()
    switched = grant.previous_job_id == cfg.peer_job_id
    event: dict[str, Any] = {
        "hold": hold,
        "role": "trainer" if job.trainer else "sampler",
        "requested_at": requested,
        "granted_at": granted,
        "epoch": grant.epoch,
        "restored": grant.restored,
        "previous_job_id": grant.previous_job_id,
        "switched": switched,
        "orchestrator_switch_seconds": grant.switch_seconds,
        "waited_seconds": grant.waited_seconds,
    }
    if job.state is None:
        _first_build(job, event)
    elif switched:
        event["after_restore"] = True
        _adapter_figures(job, event)
        if cfg.corrupt_after_restore and job.trainer and not job.state.corrupted:
            event["corrupted"] = job.state.corrupt_one_byte()
    assert job.state is not None
    checked = time.perf_counter()
    mismatch = job.state.verify()
    event["checksum_ok"] = mismatch is None
    event["checksum_seconds"] = time.perf_counter() - checked
    event["generation"] = job.state.generation
    if mismatch is not None:
        event["mismatch"] = mismatch.describe()
    event.update(_nvml_reading(job.nvml, job.peer_pid))
    if mismatch is None and job.trainer:
        job.state.step()
    event["yield_reason"] = _wait_for_peer_queued(job, client)
    event["yield_at"] = time.time()
    client.yield_(cfg.group)
    event["yielded_at"] = time.time()
    return event


def _peer_gave_up(job: Job) -> bool:
    marker = job.files.finished(job.cfg.peer_index)
    return marker.exists() and not read_json(marker).get("complete", False)


def hold_all(job: Job, client: TimeSliceOrchestratorClient) -> float:
    """Every hold of the job; stops (raising :class:`JobStopped`) when it cannot go on.
    Returns when its last yield happened."""
    cfg = job.cfg
    if cfg.index == 1:
        _wait_for_first_holder(job, client)
    last_yield = time.time()
    for hold in range(cfg.holds):
        if _peer_gave_up(job):
            raise JobStopped(f"the peer stopped; {hold} of {cfg.holds} holds done")
        event = hold_once(job, client, hold)
        job.files.append_event(cfg.index, event)
        last_yield = event["yielded_at"]
        if not event["checksum_ok"]:
            raise JobStopped(f"restore MISMATCH at hold {hold}: {event['mismatch']}")
    return last_yield


def wait_switched_out(job: Job, since: float) -> None:
    """After the last yield: stay until the peer was granted (the switch that takes this
    job's state finished; under ``app`` it runs in this process) or will not come."""
    cfg = job.cfg
    while time.time() < cfg.deadline:
        if job.files.finished(cfg.peer_index).exists():
            return
        if any(e["granted_at"] >= since for e in job.files.read_events(cfg.peer_index)):
            return
        time.sleep(POLL_SECONDS)


def mark_finished(files: RunFiles, cfg: JobConfig, *, complete: bool) -> None:
    """Tell the peer this job will not acquire again, and whether it did all its holds."""
    if not files.finished(cfg.index).exists():
        write_json(files.finished(cfg.index), {"at": time.time(), "complete": complete})


def run(cfg: JobConfig) -> None:
    """Set up, wait for the go, hold the group ``cfg.holds`` times."""
    job = setup(cfg)
    if not wait_for_file(job.files.go, cfg.deadline):
        raise JobStopped("the other job never became ready")
    job.peer_pid = int(read_json(job.files.go)["pids"][str(cfg.peer_index)])
    client = TimeSliceOrchestratorClient(cfg.target, job_id=cfg.job_id)
    complete = False
    try:
        last_yield = hold_all(job, client)
        complete = True
    finally:
        mark_finished(job.files, cfg, complete=complete)
        client.close()
    wait_switched_out(job, last_yield)


def end(cfg: JobConfig, code: int) -> None:
    """End now. Under ``cuda`` wait to be parked and killed by the check instead (module
    docstring); if the check is gone, stay: exiting could tear down a live restored context."""
    sys.stdout.flush()
    sys.stderr.flush()
    if cfg.backend == "cuda" and cfg.device == "cuda":
        while True:
            time.sleep(1.0)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the job described by the config file in ``argv[0]``; never returns normally."""
    args = sys.argv[1:] if argv is None else argv
    cfg = JobConfig.load(Path(args[0]))
    files = RunFiles(Path(cfg.run_dir))
    result: dict[str, Any] = {"ok": True, "error": ""}
    try:
        run(cfg)
    except JobStopped as exc:
        result = {"ok": False, "error": str(exc)}
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    mark_finished(files, cfg, complete=False)
    write_json(files.result(cfg.index), result)
    print(f"job {cfg.job_id}: {result}", flush=True)
    end(cfg, 0 if result["ok"] else 1)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
