"""Finding a job's processes by the labels in their environment (timeslice_agent.discovery), on
a fake procfs: which labels count, which processes a scan keeps, and where candidates come from.
Discovery of real labelled processes, end to end, is in tests/agent/test_device_checks.py."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from timeslice_agent.discovery import ProcessFinder, foreign_pids, labels_of


def _process(proc: Path, pid: int, env: dict[str, str] | bytes, *, start: int = 100) -> None:
    """One process of a fake procfs: stat (parent 1), status (uid 0) and environ."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", *["0"] * 17, str(start), "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} (python) {' '.join(fields)}\n")
    (proc / str(pid) / "status").write_text("Uid:\t0\t0\t0\t0\n")
    raw = env if isinstance(env, bytes) else b"".join(f"{k}={v}\0".encode() for k, v in env.items())
    (proc / str(pid) / "environ").write_bytes(raw)


def _labels(job: str, group: str = "g", node: str = "") -> dict[str, str]:
    env = {"PATH": "/bin", "TIMESLICE_JOB_ID": job, "TIMESLICE_GROUP": group}
    return {**env, "TIMESLICE_NODE": node} if node else env


def test_labels_are_read_from_the_environment_and_malformed_ones_are_none(tmp_path: Path) -> None:
    _process(tmp_path, 10, _labels("job-a", "g1", "n1"))
    labels = labels_of(10, tmp_path)
    assert labels is not None
    assert (labels.job_id, labels.group_id, labels.node) == ("job-a", "g1", "n1")
    _process(tmp_path, 11, {"PATH": "/bin"})  # not a job's process
    _process(tmp_path, 12, _labels("bad job id"))
    _process(tmp_path, 13, _labels("job-a", "bad group id!"))
    # A value named like a label inside another variable is not a label.
    _process(tmp_path, 14, b"X=TIMESLICE_JOB_ID=job-a\0TIMESLICE_JOB_ID\0")
    for pid in (11, 12, 13, 14, 99):
        assert labels_of(pid, tmp_path) is None, pid


def test_a_job_without_a_group_is_labelled_but_not_discovered(tmp_path: Path) -> None:
    _process(tmp_path, 10, {"TIMESLICE_JOB_ID": "job-a"})
    labels = labels_of(10, tmp_path)
    assert labels is not None and labels.group_id == ""
    assert foreign_pids("job-b", [10], tmp_path) == [10]


def test_only_processes_labelled_for_another_job_are_foreign(tmp_path: Path) -> None:
    _process(tmp_path, 10, _labels("job-a"))
    _process(tmp_path, 11, _labels("job-b"))
    _process(tmp_path, 12, {"PATH": "/bin"})
    assert foreign_pids("job-a", [10, 11, 12, 99], tmp_path) == [11]


async def test_a_procfs_scan_keeps_this_nodes_labelled_processes(tmp_path: Path) -> None:
    _process(tmp_path, 10, _labels("job-a", "g1"))  # no node label: any node
    _process(tmp_path, 11, _labels("job-b", "g2", "n1"))
    _process(tmp_path, 12, _labels("job-c", "g3", "other-node"))
    _process(tmp_path, 13, {"TIMESLICE_JOB_ID": "job-d"})  # no group: nothing to join
    _process(tmp_path, 14, _labels("job-e", "g4"))  # the agent itself
    _process(tmp_path, 1, _labels("job-f", "g5"))  # init, never
    finder = ProcessFinder(node="n1", memory=None, own_pid=14, proc=tmp_path)
    assert finder.source == "procfs"
    found = await finder.scan()
    assert [(d.info.pid, d.info.job_id, d.info.group_id) for d in found] == [
        (10, "job-a", "g1"),
        (11, "job-b", "g2"),
    ]
    assert found[0].identity.start_time == 100  # pinned to the process that was read


class _Devices:
    """The one thing a scan asks of device memory: which pids have a device context."""

    def __init__(self, pids: set[int]) -> None:
        self.pids = pids

    async def held_by(self, pids: Collection[int]) -> int:
        return 0

    async def free_bytes(self) -> int:
        return 0

    async def compute_pids(self) -> set[int]:
        return self.pids

    def close(self) -> None:
        pass


async def test_with_nvml_only_processes_on_a_device_are_candidates(tmp_path: Path) -> None:
    _process(tmp_path, 10, _labels("job-a", "g1"))
    _process(tmp_path, 11, _labels("job-b", "g2"))
    finder = ProcessFinder(node="n1", memory=_Devices({11, 50}), own_pid=2, proc=tmp_path)
    assert finder.source == "nvml"
    assert [d.info.pid for d in await finder.scan()] == [11]  # 50 is gone by the read
