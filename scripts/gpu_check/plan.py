"""How big each job is, how many switches, and how the time budget is shared: the plan.

The point of the product is two jobs that cannot both fit on the device, so each job holds at
least :data:`DEVICE_SHARE` of the device's memory (read from the device). Two limits cap that:

- host memory: at the peak of a switch both jobs are parked in host memory (the holder was just
  checkpointed, the waiter is not restored yet), so two states plus :data:`HOST_RESERVE_GIB`
  must fit in the host;
- time: the whole command must end within :data:`COMMAND_SECONDS` with, per backend, time for
  ``switches`` switches at :data:`PLAN_RATE` (a pessimistic data rate: ``cuda-checkpoint`` is
  quoted at 5-8 GB/s, pinned copies run far faster).

Bytes a backend moves for ``n`` switches of jobs of ``S`` bytes: job 1 builds its state in its
first hold, so the first switch moves ``S`` out only and each later one ``S`` out and ``S`` in.
``cuda`` then parks the last holder (lock and checkpoint before the kill,
NVIDIA/cuda-checkpoint#53): ``2n S`` in all. ``app``: job 1 is a sampler whose weights do not
change, so after its first offload it copies nothing out: ``(2n - 1 - (n // 2 - 1)) S``.

Pure: :func:`make_plan` reads nothing; ``scripts/gpu-check --print-plan`` prints its answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20
GB = 1e9

DEVICE_SHARE = 0.6
PLAN_RATE = 4 * GB  # bytes/s every planned move is assumed to run at
COMMAND_SECONDS = 540.0  # the whole command, wheel install included (9 minutes)
INSTALL_SECONDS = 15.0  # wheel install and interpreter start, before the budget's clock starts
DEFAULT_BUDGET_SECONDS = COMMAND_SECONDS - INSTALL_SECONDS
# Before the backends: machine probe, the driver smoke step, the copy floor.
PRE_SECONDS = 35.0
# Per backend, besides moving bytes: services and job processes start, checks, teardown.
BACKEND_OVERHEAD_SECONDS = 15.0
REPORT_SECONDS = 3.0
# Host memory kept out of the jobs' share: the agent's --host-reserve-gb (2 GB), the job
# processes' own memory (torch, CUDA runtime), the services, the page cache of the wheels.
HOST_RESERVE_GIB = 10.0
SIZE_STEP = GIB // 10  # sizes are rounded to 0.1 GiB (up for the minimum, down for caps)
CPU_DEFAULT_GIB = 0.05


def moves(backend: str, switches: int) -> int:
    """State-sized moves ``backend`` makes for ``switches`` switches (module docstring)."""
    if backend == "app":
        sampler_outs = max(0, switches // 2 - 1)  # its offloads after the first copy nothing
        return 2 * switches - 1 - sampler_outs
    return 2 * switches  # cuda, cuda-cli: every switch, plus parking the last holder


@dataclass(frozen=True)
class Plan:
    """The sizes and time shares a run uses, and why."""

    device: str
    gpu_bytes: int  # 0 on CPU
    host_bytes: int
    job_bytes: int
    switches: int
    budget_seconds: float
    shares: dict[str, float]  # seconds per backend, in run order
    fits: bool  # the shares fit the budget at PLAN_RATE
    why: list[str] = field(default_factory=list)

    @property
    def oversubscribed(self) -> bool:
        """The two jobs cannot both fit on the device (the case the product is for)."""
        return self.gpu_bytes > 0 and 2 * self.job_bytes > self.gpu_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "job_bytes": self.job_bytes,
            "job_gib": round(self.job_bytes / GIB, 2),
            "switches": self.switches,
            "budget_seconds": self.budget_seconds,
            "shares_seconds": self.shares,
            "fits_at_plan_rate": self.fits,
            "oversubscribed": self.oversubscribed,
            "plan_rate_gbps": PLAN_RATE / GB,
            "why": self.why,
        }


def _round_up(n: float) -> int:
    return math.ceil(n / SIZE_STEP) * SIZE_STEP


def _round_down(n: float) -> int:
    return max(SIZE_STEP, math.floor(n / SIZE_STEP) * SIZE_STEP)


def seconds_needed(backend: str, switches: int, job_bytes: int) -> float:
    """A backend's time share: its moves at :data:`PLAN_RATE` plus its fixed overhead."""
    return moves(backend, switches) * job_bytes / PLAN_RATE + BACKEND_OVERHEAD_SECONDS


def make_plan(
    *,
    device: str,
    gpu_bytes: int,
    host_bytes: int,
    backends: list[str],
    switches: int,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    size_override: int = 0,
) -> Plan:
    """The plan for a device of ``gpu_bytes`` (0: CPU) on a host of ``host_bytes``."""
    why: list[str] = []
    movable = budget_seconds - PRE_SECONDS - REPORT_SECONDS
    movable -= BACKEND_OVERHEAD_SECONDS * len(backends)
    total_moves = sum(moves(b, switches) for b in backends)
    if size_override:
        job = size_override
        why.append(f"{job / GIB:.2f} GiB per job: set by --size-gb")
    elif device == "cpu" or not gpu_bytes:
        job = int(CPU_DEFAULT_GIB * GIB)
        why.append(f"{job / GIB:.2f} GiB per job: CPU mode default (host copies only)")
    else:
        want = _round_up(DEVICE_SHARE * gpu_bytes)
        host_cap = _round_down((host_bytes - HOST_RESERVE_GIB * GIB) / 2)
        time_cap = _round_down(movable * PLAN_RATE / max(1, total_moves))
        job = min(want, host_cap, time_cap)
        why.append(
            f"wanted {want / GIB:.1f} GiB per job: {DEVICE_SHARE:g} x the device's "
            f"{gpu_bytes / MIB:.0f} MiB, two such jobs cannot both fit on it"
        )
        why.append(
            f"host cap {host_cap / GIB:.1f} GiB: two parked jobs plus a {HOST_RESERVE_GIB:g} GiB "
            f"reserve within {host_bytes / GIB:.0f} GiB of host memory"
        )
        why.append(
            f"time cap {time_cap / GIB:.1f} GiB: {total_moves} state-sized moves "
            f"({', '.join(f'{b} {moves(b, switches)}' for b in backends)}) at "
            f"{PLAN_RATE / GB:g} GB/s in {movable:.0f} s"
        )
        if job < want:
            limit = "host memory" if job == host_cap else "the time budget"
            why.append(f"capped by {limit}: {job / GIB:.1f} GiB per job")
    shares = {b: seconds_needed(b, switches, job) for b in backends}
    need = PRE_SECONDS + REPORT_SECONDS + sum(shares.values())
    fits = need <= budget_seconds
    why.append(
        f"needs {need:.0f} s of the {budget_seconds:.0f} s budget at {PLAN_RATE / GB:g} GB/s "
        f"({PRE_SECONDS:.0f} s probe, smoke step and copy floor; {BACKEND_OVERHEAD_SECONDS:.0f} s "
        "per backend to start and stop)"
        + ("" if fits else ": DOES NOT FIT, the last backend may run out of time")
    )
    if gpu_bytes:
        if 2 * job > gpu_bytes:
            why.append(
                f"two jobs ({2 * job / GIB:.1f} GiB) exceed the device "
                f"({gpu_bytes / GIB:.1f} GiB): every switch must really free it"
            )
        else:
            why.append(
                f"two jobs ({2 * job / GIB:.1f} GiB) fit on the device together "
                f"({gpu_bytes / GIB:.1f} GiB): NOT the oversubscribed case on this machine"
            )
    return Plan(device, gpu_bytes, host_bytes, job, switches, budget_seconds, shares, fits, why)


def format_plan(plan: Plan) -> str:
    """The plan in lines, as ``--print-plan`` and a run print it."""
    gpu = f"{plan.gpu_bytes / MIB:.0f} MiB" if plan.gpu_bytes else "none (CPU mode)"
    lines = [
        f"plan: device {plan.device}, GPU {gpu}, host {plan.host_bytes / GIB:.0f} GiB",
        f"plan: {plan.job_bytes / GIB:.2f} GiB per job ({plan.job_bytes / GB:.1f} GB), "
        f"{plan.switches} switches per backend, budget {plan.budget_seconds:.0f} s",
    ]
    for name, seconds in plan.shares.items():
        lines.append(
            f"plan: {name}: {seconds:.0f} s ({moves(name, plan.switches)} moves of "
            f"{plan.job_bytes / GB:.1f} GB at {PLAN_RATE / GB:g} GB/s + "
            f"{BACKEND_OVERHEAD_SECONDS:.0f} s)"
        )
    lines += [f"plan: why: {reason}" for reason in plan.why]
    return "\n".join(lines)
