"""The SDK inside Ray: clients and decorated functions travel to Ray workers and work there.

Real Ray on CPU (a local ``ray.init``), real cluster. Two jobs, each with a rollout actor and a
trainer actor, share two groups; the clients are made in the driver and pickled into the actors
(each copy opens its own session in its worker). A decorated function captured by a Ray task
works too. Checked on the recorded history: no two holds of a group overlap, both jobs used
both groups, every phase ran.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from tests.conftest import ClusterFactory
from timeslice import TimeSliceOrchestratorClient
from timeslice_tools.history import Hold, check_mutual_exclusion

ROOT = Path(__file__).resolve().parents[2]
PHASES = 8
GROUPS = ("rollout-pool", "trainer-pool")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    env_vars = {
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("libs", "services", ".")),
        # The suite's TLS files (the pickled clients name them; workers need no more).
        **{k: v for k, v in os.environ.items() if k.startswith("TIMESLICE_")},
    }
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env_vars},
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class PhaseActor:
    """One role of a job (rollout or trainer): runs its accelerator phase over and over."""

    def __init__(self, client: TimeSliceOrchestratorClient, group: str) -> None:
        self.client = client

        @client.on_accelerators(group_id=group, timeout=60)
        def phase() -> dict[str, Any]:
            grant = client.grants()[group]
            began = time.time()
            time.sleep(random.uniform(0.005, 0.02))
            return {"job": client.job_id, "group": group, "epoch": grant.epoch} | {
                "ticket": grant.ticket,
                "granted_at": began,
                "released_at": time.time(),
            }

        self.phase = phase

    def run(self, times: int) -> list[dict[str, Any]]:
        return [self.phase() for _ in range(times)]

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.client.close()


async def test_two_ray_jobs_share_two_groups_through_actors(
    cluster_factory: ClusterFactory, local_ray: None
) -> None:
    cluster = cluster_factory(agents=0)
    clients = [TimeSliceOrchestratorClient(cluster.targets, job_id=j) for j in ("ray-a", "ray-b")]
    try:
        actors = [PhaseActor.remote(c, g) for c in clients for g in GROUPS]  # type: ignore[attr-defined]
        pids = ray.get([a.pid.remote() for a in actors], timeout=60)
        assert os.getpid() not in pids and len(set(pids)) == len(actors)  # each its own process
        records = ray.get([a.run.remote(PHASES) for a in actors], timeout=120)
        ray.get([a.close.remote() for a in actors], timeout=30)
        for client in clients:
            assert client.session_id is None  # made here, used only in the workers
    finally:
        for client in clients:
            client.close()
    holds = [
        Hold(r["job"], r["group"], r["epoch"], r["ticket"], r["granted_at"], r["released_at"])
        for batch in records
        for r in batch
    ]
    assert len(holds) == len(actors) * PHASES
    for group in GROUPS:
        assert {h.job for h in holds if h.group == group} == {"ray-a", "ray-b"}, group
    check_mutual_exclusion(holds)


async def test_a_decorated_function_captured_by_a_ray_task_runs_in_the_worker(
    cluster_factory: ClusterFactory, local_ray: None
) -> None:
    cluster = cluster_factory(agents=0)
    with TimeSliceOrchestratorClient(cluster.targets, job_id="ray-task") as client:

        @client.on_accelerators(group_id="trainer-pool", timeout=60)
        def train_step() -> tuple[int, int]:
            return os.getpid(), client.grants()["trainer-pool"].epoch

        @ray.remote
        def task() -> tuple[int, int]:
            return train_step()

        pid, epoch = ray.get(task.remote(), timeout=120)
        assert pid != os.getpid() and epoch > 0
        # The worker's copy gave the group back when the step ended.
        assert client.acquire("trainer-pool", timeout=10).epoch > epoch


async def test_an_actor_method_and_a_task_decorated_directly_hold_the_group_per_call(
    cluster_factory: ClusterFactory, local_ray: None
) -> None:
    # Decorated once, where they are defined: the client made here travels with the class and
    # the function (one copy, with its own session, per Ray worker process).
    cluster = cluster_factory(agents=0)
    with TimeSliceOrchestratorClient(cluster.targets, job_id="ray-direct") as client:

        @ray.remote
        class Trainer:
            @client.on_accelerators(group_id="trainer-pool", timeout=60)
            def step(self, x: int) -> tuple[int, int, int]:
                return os.getpid(), client.grants()["trainer-pool"].epoch, x * 2

            def held(self) -> list[str]:
                return sorted(client.grants())

        @ray.remote
        @client.on_accelerators(group_id="rollout-pool", timeout=60)
        def rollout(x: int) -> tuple[int, int]:
            return os.getpid(), client.grants()["rollout-pool"].epoch + x

        trainer = Trainer.remote()  # type: ignore[attr-defined]
        steps = ray.get([trainer.step.remote(i) for i in range(3)], timeout=120)
        assert [s[2] for s in steps] == [0, 2, 4]
        epochs = [s[1] for s in steps]
        assert epochs == sorted(set(epochs)) and epochs[0] > 0  # a new hold per call
        assert ray.get(trainer.held.remote(), timeout=30) == []  # given back after each call
        pid, epoch = ray.get(rollout.remote(0), timeout=120)
        assert os.getpid() not in (pid, steps[0][0]) and epoch > 0
        # Both were given back: the driver's own copy gets each group at once.
        assert client.acquire("trainer-pool", timeout=10).epoch > epochs[-1]
        assert client.acquire("rollout-pool", timeout=10).epoch > epoch
