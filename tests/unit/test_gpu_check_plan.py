"""The GPU check's plan for the machines it is lent (scripts/gpu_check/plan.py), checked here."""

from __future__ import annotations

import pytest

from scripts.gpu_check.plan import (
    DEFAULT_BUDGET_SECONDS,
    GIB,
    MIB,
    PLAN_RATE,
    make_plan,
    moves,
)

H100_MIB = 81559
H200_MIB = 143771
HOST = 125 * GIB


def test_h100_jobs_hold_six_tenths_of_the_device_and_cannot_both_fit() -> None:
    plan = make_plan(device="cuda", gpu_bytes=H100_MIB * MIB, host_bytes=HOST,
                     backends=["cuda", "app"], switches=10)  # fmt: skip
    assert plan.job_bytes >= 0.6 * H100_MIB * MIB
    assert plan.job_bytes < 0.6 * H100_MIB * MIB + GIB // 10  # rounded up, not padded
    assert plan.oversubscribed
    # Two parked jobs and the reserve fit in the host.
    assert 2 * plan.job_bytes + 10 * GIB <= HOST
    assert plan.fits and plan.switches == 10
    # Each backend's share fits its ten switches at 4 GB/s, and all of it the 9 minutes.
    for name, seconds in plan.shares.items():
        assert seconds >= moves(name, 10) * plan.job_bytes / PLAN_RATE
    assert sum(plan.shares.values()) < DEFAULT_BUDGET_SECONDS <= 540


def test_h200_is_capped_and_says_it_is_not_the_oversubscribed_case() -> None:
    plan = make_plan(device="cuda", gpu_bytes=H200_MIB * MIB, host_bytes=HOST,
                     backends=["cuda", "app"], switches=10)  # fmt: skip
    assert plan.job_bytes < 0.6 * H200_MIB * MIB
    assert 2 * plan.job_bytes + 10 * GIB <= HOST
    assert not plan.oversubscribed
    assert any("capped by" in why for why in plan.why)
    assert any("NOT the oversubscribed case" in why for why in plan.why)
    assert plan.fits


def test_moves_count_the_lazy_second_job_the_sampler_and_the_final_park() -> None:
    assert moves("cuda", 10) == 20  # 1 + 9 * 2 + the last holder parked
    assert moves("app", 10) == 15  # 19, less the sampler's 4 unchanged offloads


def test_print_plan_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts.gpu_check.cli import main

    assert main(["--print-plan", "--gpu-mib", str(H100_MIB), "--host-gib", "125"]) == 0
    out = capsys.readouterr().out
    assert "47.80 GiB per job" in out and "cuda:" in out and "app:" in out and "why:" in out
