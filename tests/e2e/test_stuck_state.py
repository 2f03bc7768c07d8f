"""A job whose state can not leave the devices is the one faulted, never the job waiting.

Two real job processes trade one group through etcd, an orchestrator and an agent running
``--backend app``. The holder makes its own state unmovable while it holds (``.numpy()`` on a
tracked parameter pins its storage, as a real GRPO job's memory-mapped weights did), so its
offload hook fails at the switch to the waiter. The holder must learn it (GroupFaulted at its
next acquire), the waiter must not: it waits, with the reason in the group's status, and is
granted once the stuck job's processes are gone. Its first grant restored nothing, and once
every job exited nothing is shown resident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import ClusterFactory
from timeslice import NotFound, TimeSliceOrchestratorClient

HOLDER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from timeslice import GroupFaulted, TimeSliceOrchestratorClient
    from timeslice.offload import TorchOffloader

    job, target, socket = sys.argv[1:4]
    model = torch.nn.Linear(8, 8)
    offloader = TorchOffloader()
    offloader.add_module(model)
    reg = offloader.register("g-stuck", job_id=job, socket=socket)
    out = {}
    with TimeSliceOrchestratorClient(target=target, job_id=job) as client:
        client.acquire("g-stuck", timeout=30)
        model.weight.detach().numpy()  # from now on the storage can not be resized
        deadline = time.monotonic() + 30
        while not client.status("g-stuck").queue and time.monotonic() < deadline:
            time.sleep(0.01)
        client.yield_("g-stuck")
        deadline = time.monotonic() + 30
        while "could not be checkpointed" not in client.status("g-stuck").last_error:
            assert time.monotonic() < deadline, client.status("g-stuck")
            time.sleep(0.02)
        try:
            client.acquire("g-stuck", timeout=30)
            out["again"] = "granted"
        except GroupFaulted as exc:
            out["again"] = "faulted"
            out["error"] = str(exc)
        out["status_error"] = client.status("g-stuck").last_error
    reg.close()
    print(json.dumps(out))
    """
)

WAITER = textwrap.dedent(
    """
    import json, sys
    import torch
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.offload import TorchOffloader

    job, target, socket = sys.argv[1:4]
    model = torch.nn.Linear(8, 8)
    before = model.weight.detach().clone()
    offloader = TorchOffloader()
    offloader.add_module(model)
    reg = offloader.register("g-stuck", job_id=job, socket=socket)
    with TimeSliceOrchestratorClient(target=target, job_id=job) as client:
        grant = client.acquire("g-stuck", timeout=90)
        intact = torch.equal(model.weight, before)
        client.yield_("g-stuck")
    reg.close()
    print(json.dumps(dict(restored=grant.restored, previous=grant.previous_job_id,
                          intact=intact)))
    """
)


def _holder(client: TimeSliceOrchestratorClient) -> str:
    try:
        return client.status("g-stuck").holder_job_id
    except NotFound:
        return ""  # not created yet


def test_a_holder_whose_state_can_not_move_is_faulted_not_the_waiter(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    cluster = cluster_factory(agents=1, backend="app")
    socket = str(cluster.agent_sockets["node-0"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(source: str, job: str) -> subprocess.Popen[str]:
        script = tmp_path / f"{job}.py"
        script.write_text(source)
        command = [sys.executable, str(script), job, cluster.target, socket]
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    with TimeSliceOrchestratorClient(cluster.target, job_id="observer") as observer:
        holder = start(HOLDER, "job-x")
        deadline = time.monotonic() + 60
        while _holder(observer) != "job-x":
            assert time.monotonic() < deadline and holder.poll() is None, holder.stderr
            time.sleep(0.02)
        waiter = start(WAITER, "job-y")

        out, err = holder.communicate(timeout=120)
        assert holder.returncode == 0, err[-3000:]
        held = json.loads(out.strip().splitlines()[-1])
        # The job whose state could not move is told, with its own hook's error.
        assert held["again"] == "faulted", held
        assert "job-x" in held["error"] and "can not be resized" in held["error"], held
        assert "job-y waits" in held["status_error"], held

        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err[-3000:]  # never GroupFaulted
        waited = json.loads(out.strip().splitlines()[-1])
        # Granted once job-x's processes were gone; nothing of job-y had ever been parked.
        assert waited == {"restored": False, "previous": None, "intact": True}, waited

        status = observer.status("g-stuck")
        assert [f.job_id for f in status.faulted] != ["job-y"]
        # Every job exited: nothing is resident any more.
        deadline = time.monotonic() + 10
        while any(n.resident_job_id for n in status.nodes):
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
            status = observer.status("g-stuck")
