"""The ``app`` backend end to end: two real processes hold torch state and trade one group.

Each job is its own Python process with a model (tied weights) and an Adam optimizer tracked
by :class:`timeslice.offload.TorchOffloader`, registered with the node agent through its
hooks. The jobs alternate acquire/yield through a real orchestrator, etcd and agent running
``--backend app``; every switch makes the agent call the holder's offload hook and the next
job's restore hook. At each grant a job checks that its whole state (parameters, gradients,
optimizer moments) is bit-exact what it left at its last yield, then trains one step.

On CPU the "device" is host memory, so this proves the mechanism and the wiring (the hooks
run, storages are really freed while parked, contents survive); device bandwidth and the
NVML checks are the GPU check's business (``scripts/gpu-check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ClusterFactory
from timeslice_agent.journal import read_journal
from timeslice_tools.history import Hold, check_mutual_exclusion

JOB = textwrap.dedent(
    """
    import hashlib, json, sys, time
    import torch
    from timeslice import TimeSliceOrchestratorClient, register
    from timeslice.offload import TorchOffloader

    job, target, socket, rounds, seed = sys.argv[1:6]
    torch.manual_seed(int(seed))
    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, torch.nn.Linear(32, 32), torch.nn.ReLU(), head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tensors = lambda: [p.detach() for p in model.parameters()] + [
        p.grad for p in model.parameters() if p.grad is not None
    ] + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]

    def digest():
        h = hashlib.sha256()
        for t in tensors():
            # Not .numpy(): a storage numpy has seen can no longer be resized (offloaded).
            h.update(bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()))
        return h.hexdigest()

    def step():
        x = torch.randint(0, 64, (16, 8))
        loss = model(x).float().logsumexp(-1).mean()
        opt.zero_grad(); loss.backward(); opt.step()

    step()  # optimizer state exists from here on
    offloader = TorchOffloader()
    offloader.add_module(model)
    offloader.add_optimizer(opt)
    parked = []
    real_offload = offloader.offload
    def offload_and_check():
        moved = real_offload()
        # While parked, every tracked storage is really empty.
        parked.append(all(t.untyped_storage().nbytes() == 0 for t in tensors()))
        return moved
    reg = register("g-app", job_id=job, socket=socket, on_checkpoint=offload_and_check,
                   on_restore=offloader.restore, state_bytes=offloader.device_bytes)
    expected = digest()
    out = []
    with TimeSliceOrchestratorClient(target=target, job_id=job) as client:
        for i in range(int(rounds)):
            grant = client.acquire("g-app", timeout=60)
            start = time.monotonic()
            ok = digest() == expected
            step()
            expected = digest()
            # Hold until the other job waits (bounded), so that every yield but the last
            # one is a real switch, however loaded the machine is.
            wait_until = time.monotonic() + 20
            while i < int(rounds) - 1 and time.monotonic() < wait_until:
                if client.status("g-app").queue:
                    break
                time.sleep(0.005)
            end = time.monotonic()
            client.yield_("g-app")
            out.append(dict(epoch=grant.epoch, ticket=grant.ticket, start=start, end=end,
                            intact=ok))
        # Stay registered until a switch away from this job is over: leaving mid-offload is
        # a real failure mode, but not the one this test is about.
        wait_until = time.monotonic() + 20
        while time.monotonic() < wait_until:
            st = client.status("g-app")
            switching = st.switch is not None and bool(st.switch.switch_id)
            if not st.queue and not switching:
                break
            time.sleep(0.01)
    reg.close()
    print(json.dumps(dict(job=job, holds=out, parked=parked,
                          stats=str(offloader.last_stats))))
    """
)

ROUNDS = 14


def test_two_torch_jobs_switch_twenty_times_with_state_intact(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    cluster = cluster_factory(agents=1, backend="app")
    socket = str(cluster.agent_sockets["node-0"])
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), job, cluster.target, socket, str(ROUNDS), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed, job in enumerate(("job-x", "job-y"))
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    holds = [
        Hold(r["job"], "g-app", h["epoch"], h["ticket"], h["start"], h["end"])
        for r in results
        for h in r["holds"]
    ]
    assert len(holds) == 2 * ROUNDS
    check_mutual_exclusion(holds)
    for r in results:
        assert all(h["intact"] for h in r["holds"]), f"{r['job']}: state changed while parked"
        assert r["parked"] and all(r["parked"]), f"{r['job']}: storages not freed when parked"

    entries = read_journal(cluster.agent_journals["node-0"])
    checkpoints = [e for e in entries if e.kind == "checkpoint" and e.status == "ok"]
    restores = [e for e in entries if e.kind == "restore" and e.status == "ok"]
    assert len(checkpoints) >= 20 and len(restores) >= 20, (len(checkpoints), len(restores))
    for job in ("job-x", "job-y"):
        # Each offload reported its bytes; the last eviction of a job may find it gone (its
        # registration closes right after its last yield), and then moves nothing.
        mine = sorted((e for e in checkpoints if e.job == job), key=lambda e: e.started_at)
        assert all(e.bytes_moved > 0 for e in mine[:-1]), [e.bytes_moved for e in mine]
    assert not [e for e in entries if e.status not in ("ok",)], entries
    # Each job was restored as often as it was parked, give or take the one still parked.
    for r in results:
        assert len(r["parked"]) >= 9


SAMPLER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.offload import TorchOffloader

    job, target, socket, rounds, train = sys.argv[1:6]
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offloader = TorchOffloader(keep_pinned=True)
    offloader.add_module(model)
    reg = offloader.register("g-skip", job_id=job, socket=socket)
    last = [p.detach().clone() for p in model.parameters()]
    intact = []
    with TimeSliceOrchestratorClient(target=target, job_id=job) as client:
        for i in range(int(rounds)):
            client.acquire("g-skip", timeout=60)
            # Each hold finds exactly what the last one left: bit-exact after every switch.
            intact.append(all(torch.equal(p, q) for p, q in zip(model.parameters(), last)))
            with torch.no_grad():
                model(torch.ones(4, 64))  # a sampler only reads its weights
            if train == "1":
                loss = model(torch.ones(4, 64)).sum()
                opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
                opt.zero_grad(set_to_none=True)
            wait_until = time.monotonic() + 20
            while i < int(rounds) - 1 and time.monotonic() < wait_until:
                if client.status("g-skip").queue:
                    break
                time.sleep(0.005)
            last = [p.detach().clone() for p in model.parameters()]
            client.yield_("g-skip")
        wait_until = time.monotonic() + 20
        while time.monotonic() < wait_until:
            st = client.status("g-skip")
            if not st.queue and not (st.switch is not None and bool(st.switch.switch_id)):
                break
            time.sleep(0.01)
    reg.close()
    print(json.dumps(dict(job=job, intact=intact)))
    """
)


def test_an_unchanged_sampler_moves_no_bytes_out_and_the_journal_says_so(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    """A sampler whose weights do not change between holds (keep_pinned) is released without
    a copy from its second checkpoint on; a trainer beside it copies its written state. The
    agent's journal reports both: bytes moved, and of them bytes skipped."""
    cluster = cluster_factory(agents=1, backend="app")
    socket = str(cluster.agent_sockets["node-0"])
    script = tmp_path / "sampler.py"
    script.write_text(SAMPLER)
    rounds = 5
    procs = {
        job: subprocess.Popen(
            [sys.executable, str(script), job, cluster.target, socket, str(rounds), train],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for job, train in (("sampler", "0"), ("trainer", "1"))
    }
    for job, proc in procs.items():
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err[-3000:]
        intact = json.loads(out.strip().splitlines()[-1])["intact"]
        assert len(intact) == rounds and all(intact), (job, intact)

    entries = read_journal(cluster.agent_journals["node-0"])
    assert not [e for e in entries if e.status != "ok"], entries
    state = (64 * 256 + 256 + 256 * 64 + 64) * 4
    moves = {
        job: sorted(
            (e for e in entries if e.kind == "checkpoint" and e.job == job and e.bytes_moved),
            key=lambda e: e.started_at,
        )
        for job in procs
    }
    sampler = moves["sampler"]
    assert len(sampler) >= 3, sampler
    # The first checkpoint has no host copy to reuse; every later one skips everything.
    assert sampler[0].bytes_moved == state and sampler[0].bytes_skipped == 0
    assert all(e.bytes_moved == state == e.bytes_skipped for e in sampler[1:]), sampler
    trainer = moves["trainer"]
    assert len(trainer) >= 3, trainer
    # An SGD step writes every parameter in place: nothing of the trainer may be skipped.
    assert all(e.bytes_moved == state and e.bytes_skipped == 0 for e in trainer), trainer
    restores = [e for e in entries if e.kind == "restore" and e.bytes_moved]
    assert restores and all(e.bytes_skipped == 0 for e in restores)
