"""The compose `demo` profile's job: two jobs time-slice one group, so switches happen.

Mounted read-only into the timeslice image at /demo (the image has the SDK). Two roles:

``workers --socket SOCK``
    One stand-in GPU worker per job (a sleeping child process), registered with the node agent
    at SOCK for ``--group`` with ``--state-gb`` of (emulated) device state; holds the
    registrations until stopped. It must share the agent's pid namespace (compose
    ``pid: service:agent-N``): the agent checks who registers through ``SO_PEERCRED``.

``switch``
    Both jobs, each with its own certificate (``/certs/job-<id>.crt``), loop concurrently:
    acquire the group, "train" for ``--hold`` seconds, yield, spend ``--gap`` seconds off the
    accelerators. Whenever one yields while the other waits, the orchestrator switches the
    group: the agents checkpoint the first job's workers and restore the second's, which is
    the ``timeslice.switch`` trace in Jaeger. Prints one line per grant; with ``--switches N``
    (> 0) exits 0 after N switches, otherwise runs until stopped.

Settings come from the command line and the environment (``TIMESLICE_TARGET``,
``TIMESLICE_TLS_CA``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from timeslice import AsyncTimeSliceClient, register


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def workers(args: argparse.Namespace) -> int:
    stop = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sleepers = {job: subprocess.Popen(["sleep", "infinity"]) for job in args.jobs}
    registrations = []
    try:
        for job, proc in sleepers.items():
            registrations.append(
                register(
                    args.group,
                    job_id=job,
                    pid=proc.pid,
                    socket=args.socket,
                    state_bytes=int(args.state_gb * (1 << 30)),
                    timeout=60,
                )
            )
            log(f"registered {job} (pid {proc.pid}) in {args.group} at {args.socket}")
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        for registration in registrations:
            registration.close()
        for proc in sleepers.values():
            proc.kill()
            proc.wait()
    return 0


async def one_job(
    args: argparse.Namespace,
    index: int,
    job: str,
    seen: list[dict[str, object]],
    done: asyncio.Event,
) -> None:
    client = AsyncTimeSliceClient(
        job_id=job,
        tls_ca=os.environ.get("TIMESLICE_TLS_CA"),
        tls_cert=f"{args.certs}/job-{job}.crt",
        tls_key=f"{args.certs}/job-{job}.key",
    )
    async with client:
        await asyncio.sleep(index * args.hold / 2)  # start out of step
        while not done.is_set():
            grant = await client.acquire(args.group, timeout=600)
            switched = bool(grant.previous_job_id) and grant.previous_job_id != job
            seen.append(
                {
                    "job": job,
                    "epoch": grant.epoch,
                    "previous": grant.previous_job_id,
                    "restored": grant.restored,
                    "switch_seconds": grant.switch_seconds,
                    "switched": switched,
                }
            )
            log(
                f"{job}: granted (epoch {grant.epoch}, waited {grant.waited_seconds:.1f} s"
                + (
                    f", switched from {grant.previous_job_id} in {grant.switch_seconds:.2f} s"
                    if switched
                    else ""
                )
                + ")"
            )
            if args.switches and sum(1 for s in seen if s["switched"]) >= args.switches:
                done.set()
            await asyncio.sleep(args.hold)
            await client.yield_(args.group)
            await asyncio.sleep(args.gap)


async def switch(args: argparse.Namespace) -> list[dict[str, object]]:
    seen: list[dict[str, object]] = []
    done = asyncio.Event()
    tasks = [
        asyncio.create_task(one_job(args, i, job, seen, done)) for i, job in enumerate(args.jobs)
    ]
    try:
        if args.switches:
            await done.wait()
        else:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    log(f"done: {sum(1 for s in seen if s['switched'])} switches in {len(seen)} grants")
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="job.py")
    parser.add_argument("role", choices=["workers", "switch"])
    parser.add_argument("--group", default="demo-pool")
    parser.add_argument("--jobs", type=lambda s: s.split(","), default=["demo-a", "demo-b"])
    parser.add_argument("--socket", help="workers: the node agent's worker socket")
    parser.add_argument("--state-gb", type=float, default=8.0, help="workers: per worker")
    parser.add_argument("--certs", default="/certs", help="switch: job-<id>.crt/.key here")
    parser.add_argument("--hold", type=float, default=3.0, help="switch: seconds per hold")
    parser.add_argument("--gap", type=float, default=1.0, help="switch: seconds between holds")
    parser.add_argument("--switches", type=int, default=0, help="switch: stop after N (0: never)")
    parser.add_argument("--result", help="switch: write the grants here as JSON")
    args = parser.parse_args(argv)
    if args.role == "workers":
        if not args.socket:
            parser.error("workers needs --socket")
        return workers(args)
    seen = asyncio.run(switch(args))
    if args.result:
        Path(args.result).write_text(json.dumps({"grants": seen}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
