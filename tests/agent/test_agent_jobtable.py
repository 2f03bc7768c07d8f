"""The node's job table (timeslice_agent.jobtable): jobs come with their workers and go when
nothing of them is left; a job is in one group on a node while anything binds it there, and
then may come back in another; the host memory the node's jobs hold. The registry is stood in
by the one question the table asks it (which workers a job has here)."""

from __future__ import annotations

import os
import subprocess
from typing import cast

import pytest

from timeslice.errors import InvalidArgument
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.jobtable import JobTable
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.tasks import KeyedLocks
from timeslice_agent.workers import WorkerRegistry
from timeslice_proto.timeslice.v1 import WorkerInfo


class Workers:
    """The registry's view the table reads: the workers registered per job."""

    def __init__(self) -> None:
        self.by_job: dict[str, list[WorkerInfo]] = {}

    def workers_of(self, job_id: str) -> list[WorkerInfo]:
        return list(self.by_job.get(job_id, []))

    def register(self, job: str, group: str, pid: int = 4242) -> WorkerInfo:
        info = WorkerInfo(job_id=job, group_id=group, pid=pid)
        self.by_job.setdefault(job, []).append(info)
        return info


class Rig:
    def __init__(self) -> None:
        self.workers = Workers()
        self.locks = KeyedLocks()
        self.changes = 0
        self.table = JobTable(
            cast(WorkerRegistry, self.workers),
            self.locks,
            AgentMetrics(node="n1", backend="sim", emulated=True),
            self._changed,
        )

    def _changed(self) -> None:
        self.changes += 1


def _gone_pid() -> int:
    """A pid no process has any more (a child that exited and was reaped)."""
    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


def test_a_job_comes_with_its_workers_and_goes_with_them() -> None:
    rig = Rig()
    rig.workers.register("job-a", "g1")
    rig.table.on_workers_changed("job-a")
    job = rig.table.get("job-a")
    assert job is not None and (job.group_id, job.state) == ("g1", JobState.IDLE)
    assert rig.changes == 1
    rig.workers.by_job.clear()
    rig.table.on_workers_changed("job-a")
    assert rig.table.get("job-a") is None
    assert rig.table.left("job-a", "g1") and not rig.table.left("job-a", "g2")


def test_a_parked_job_stays_when_its_workers_go() -> None:
    rig = Rig()
    rig.table.jobs["job-a"] = Job("job-a", "g1", JobState.SAVED, Residency.HOST, saved_bytes=10)
    rig.table.forget_if_gone("job-a")
    assert rig.table.get("job-a") is not None  # its state is parked here: not forgotten


def test_a_job_with_workers_here_cannot_register_in_another_group() -> None:
    rig = Rig()
    rig.workers.register("job-a", "g1", pid=4242)
    rig.table.on_workers_changed("job-a")
    assert rig.table.elsewhere("job-a", "g2") == "g1"
    assert rig.table.elsewhere("job-a", "g1") is None
    with pytest.raises(InvalidArgument, match=r"in group g1 on this node, not g2: .*\[4242\]"):
        rig.table.check_registration(WorkerInfo(job_id="job-a", group_id="g2", pid=4243))
    assert rig.table.get("job-a") is not None


async def test_a_job_with_a_directive_in_progress_cannot_move() -> None:
    rig = Rig()
    rig.table.jobs["job-a"] = Job("job-a", "g1")
    async with rig.locks.holding("job-a", None):
        with pytest.raises(InvalidArgument, match="a directive for it is in progress"):
            rig.table.check_registration(WorkerInfo(job_id="job-a", group_id="g2", pid=1))


def test_a_checkpoint_parked_for_live_processes_binds_the_job() -> None:
    rig = Rig()
    parked = Job("job-a", "g1", JobState.SAVED, Residency.HOST, saved_pids=(os.getpid(),))
    rig.table.jobs["job-a"] = parked
    with pytest.raises(InvalidArgument, match="its checkpoint is parked for process"):
        rig.table.check_registration(WorkerInfo(job_id="job-a", group_id="g2", pid=1))


def test_once_nothing_binds_it_a_job_moves_and_its_old_checkpoint_is_discarded() -> None:
    rig = Rig()
    rig.table.jobs["job-a"] = Job(
        "job-a", "g1", JobState.SAVED, Residency.HOST, saved_bytes=100, saved_pids=(_gone_pid(),)
    )
    rig.table.check_registration(WorkerInfo(job_id="job-a", group_id="g2", pid=1))
    assert rig.table.get("job-a") is None and rig.changes == 1
    assert rig.table.left("job-a", "g1")
    # Back in the group it left: that group's directives count for it again.
    rig.table.check_registration(WorkerInfo(job_id="job-a", group_id="g1", pid=1))
    assert not rig.table.left("job-a", "g1")


def test_the_host_memory_held_counts_parked_states_and_kept_copies() -> None:
    rig = Rig()
    rig.table.jobs["parked"] = Job("parked", "g1", JobState.SAVED, Residency.HOST, saved_bytes=300)
    rig.table.jobs["running"] = Job("running", "g2", JobState.RUNNING, saved_bytes=999)
    rig.table.host_kept["running"] = 50
    assert rig.table.parked_bytes() == 350
    copies = rig.table.copies()
    assert copies == rig.table.jobs and copies["parked"] is not rig.table.jobs["parked"]
    assert [r.job_id for r in rig.table.reports()] == ["parked", "running"]
