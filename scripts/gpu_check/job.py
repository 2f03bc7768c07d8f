"""One job of the GPU check: ``python -m scripts.gpu_check.job CONFIG``.

It builds its state (:mod:`scripts.gpu_check.state`), takes the reference checksum,
registers with the node agent (``app``: :class:`timeslice.offload.TorchOffloader`; ``cuda``:
``timeslice.worker.register`` of its own pid, whose whole device state the agent then
checkpoints), waits for the other job, then holds the group ``holds`` times. Each hold:

1. ``acquire``; a grant whose previous holder is the peer followed a switch;
2. recompute the checksum on the device and compare it with the reference;
3. read NVML: this process must hold its state, the peer (switched out) must hold ~nothing;
4. wait until the peer queues for the group (so the yield really switches), then ``yield_``.

Job 0 takes the first grant and job 1 waits for that, so ``switches + 1`` alternating grants
make exactly ``switches`` switches. Every hold is one line in ``events-<i>.jsonl``;
``result-<i>.json`` says how the job ended. Exit status 0 when it ran all its holds, else 1.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
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
from timeslice.offload import TorchOffloader

REGISTER_SECONDS = 30.0


class JobStopped(Exception):
    """The job ends early for a reason it records (deadline, the peer stopped, a mismatch)."""


@dataclass
class Job:
    """A set-up job: its config, state, reference checksum and links."""

    cfg: JobConfig
    files: RunFiles
    state: TrainState
    reference: str
    registration: WorkerRegistration
    offloader: TorchOffloader | None
    nvml: Nvml | None
    peer_pid: int = -1

    def close(self) -> None:
        self.registration.close()
        if self.nvml is not None:
            self.nvml.close()


def _register(
    cfg: JobConfig, state: TrainState
) -> tuple[WorkerRegistration, TorchOffloader | None]:
    if cfg.backend == "app":
        offloader = TorchOffloader(keep_pinned=cfg.keep_pinned)
        offloader.add_module(state.module)
        offloader.add_optimizer(state.optimizer)
        registration = offloader.register(
            cfg.group, job_id=cfg.job_id, socket=cfg.agent_socket, acquirer=True,
            timeout=REGISTER_SECONDS,
        )  # fmt: skip
        return registration, offloader
    # The cuda backend moves the whole process: announce the pid and the bytes it holds.
    registration = register(
        cfg.group, job_id=cfg.job_id, pid=os.getpid(), state_bytes=state.nbytes,
        socket=cfg.agent_socket, acquirer=True, timeout=REGISTER_SECONDS,
    )  # fmt: skip
    return registration, None


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
    """Build the state, take its checksum, register, open NVML; writes ``ready-<i>.json``."""
    files = RunFiles(Path(cfg.run_dir))
    started = time.perf_counter()
    state = build_state(torch.device(cfg.device), cfg.size_bytes, seed=cfg.index + 1)
    built = time.perf_counter()
    reference = state.digest()
    digested = time.perf_counter()
    registration, offloader = _register(cfg, state)
    nvml: Nvml | None = None
    nvml_note = ""
    if cfg.use_nvml:
        try:
            nvml = Nvml()
        except NvmlMissing as exc:
            nvml_note = str(exc)
    write_json(files.ready(cfg.index), {
        "pid": os.getpid(),
        "state_bytes": state.nbytes,
        "build_seconds": built - started,
        "checksum_seconds": digested - built,
        "reference_checksum": reference,
        "nvml_note": nvml_note,
        "setup_nvml": _nvml_reading(nvml, -1),
    })  # fmt: skip
    return Job(cfg, files, state, reference, registration, offloader, nvml)


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


def hold_once(job: Job, client: TimeSliceOrchestratorClient, hold: int) -> dict[str, Any]:
    """One acquire / check / yield cycle; returns its event."""
    cfg = job.cfg
    remaining = cfg.deadline - time.time()
    if remaining <= 0:
        raise JobStopped(f"deadline reached before hold {hold}")
    requested = time.time()
    grant = client.acquire(cfg.group, timeout=remaining)
    granted = time.time()
    checked = time.perf_counter()
    matched = job.state.digest() == job.reference
    event: dict[str, Any] = {
        "hold": hold,
        "requested_at": requested,
        "granted_at": granted,
        "epoch": grant.epoch,
        "restored": grant.restored,
        "previous_job_id": grant.previous_job_id,
        "switched": grant.previous_job_id == cfg.peer_job_id,
        "orchestrator_switch_seconds": grant.switch_seconds,
        "waited_seconds": grant.waited_seconds,
        "checksum_ok": matched,
        "checksum_seconds": time.perf_counter() - checked,
    }
    stats = job.offloader.last_stats if job.offloader is not None else None
    if grant.restored and stats is not None:
        event["adapter_restore"] = {"bytes": stats.copied_bytes, "seconds": stats.seconds}
    event.update(_nvml_reading(job.nvml, job.peer_pid))
    event["yield_reason"] = _wait_for_peer_queued(job, client)
    event["yield_at"] = time.time()
    client.yield_(cfg.group)
    event["yielded_at"] = time.time()
    return event


def _peer_gave_up(job: Job) -> bool:
    marker = job.files.finished(job.cfg.peer_index)
    return marker.exists() and not read_json(marker).get("complete", False)


def hold_all(job: Job, client: TimeSliceOrchestratorClient) -> None:
    """Every hold of the job; stops (raising :class:`JobStopped`) when it cannot go on."""
    cfg = job.cfg
    if cfg.index == 1:
        _wait_for_first_holder(job, client)
    for hold in range(cfg.holds):
        if _peer_gave_up(job):
            raise JobStopped(f"the peer stopped; {hold} of {cfg.holds} holds done")
        event = hold_once(job, client, hold)
        job.files.append_event(cfg.index, event)
        if not event["checksum_ok"]:
            raise JobStopped(f"checksum mismatch after the grant of hold {hold}")


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
        hold_all(job, client)
        complete = True
    finally:
        mark_finished(job.files, cfg, complete=complete)
        client.close()
    # The peer may still be switching this process out: stay alive until it is done too.
    wait_for_file(job.files.finished(cfg.peer_index), cfg.deadline)
    job.close()


def main(argv: list[str] | None = None) -> int:
    """Run the job described by the config file in ``argv[0]``."""
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
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
