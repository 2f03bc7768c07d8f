"""Judging a backend's figures, the GPU targets, and the check's exit status. Pure functions.

A backend **passed** only when every switch happened, every restore compared equal word by
word, no directive failed, no job failed, and NVML showed the switched-out job's memory freed.
It **failed** on any finding. When all else held but NVML could not tell (skipped, or
inconclusive because it attributes no memory to the jobs' pids), it is **unverified**: never a
pass, never hidden. On CPU there is no device memory to check, so NVML does not apply there.

The exit status is 1 when any backend failed (or the check broke), else 0.
"""

from __future__ import annotations

from typing import Any

PASSED, FAILED, UNVERIFIED, SKIPPED = "passed", "failed", "unverified", "skipped"
APP_FLOOR_TARGET = 0.85  # the app adapter, per direction, as a fraction of the copy floor


def findings(figures: dict[str, Any], *, switches: int) -> list[str]:
    """What went wrong, in words (empty: nothing)."""
    found: list[str] = []
    observed = figures["switches"]["observed"]
    if observed < switches:
        found.append(f"only {observed} of {switches} switches happened")
    checks = figures["checksums"]
    for bad in checks["mismatched"]:
        found.append(
            f"restore MISMATCH: job {bad['job']} hold {bad['hold']}: {bad.get('what') or '?'}"
        )
    if checks["checked_after_switch"] < min(observed, switches):
        found.append(
            f"only {checks['checked_after_switch']} of {observed} switched-in grants checked"
        )
    if figures["nvml"]["status"] == FAILED:
        found.append(f"NVML: the switched-out job held memory: {figures['nvml']['over_limit']}")
    for entry in figures["journal"]["not_ok"]:
        found.append(
            f"{entry['kind']} {str(entry['status']).upper()} (job {entry['job']}): {entry['error']}"
        )
    return found


def status(found: list[str], nvml_status: str, *, device: str) -> str:
    """The backend's status from its findings and NVML's answer (module docstring)."""
    if found:
        return FAILED
    if device == "cpu" or nvml_status == PASSED:
        return PASSED
    return UNVERIFIED


def nvml_label(nvml_status: str, device: str) -> str:
    return "n/a (CPU)" if device == "cpu" else nvml_status


def exit_status(backends: dict[str, dict[str, Any]], *, broke: bool = False) -> int:
    """1 when any backend failed or errored or the check itself broke, else 0."""
    if broke or any(r.get("status") in (FAILED, "error") for r in backends.values()):
        return 1
    return 0


def _ratio(value: float | None, floor: float | None) -> float | None:
    if value is None or not floor:
        return None
    return value / floor


def targets(name: str, figures: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """The GPU targets of one backend against the copy floor (figures only; no pass/fail).

    ``app``: the adapter's GB/s per direction as a ratio of the floor (target
    :data:`APP_FLOOR_TARGET`), and the sampler's offloads after its first copying nothing.
    ``cuda``: the journal's GB/s per direction against the same floor.
    """
    out_floor, in_floor = floor.get("out_gbps"), floor.get("in_gbps")
    if name == "app" and "adapter" in figures:
        adapter = figures["adapter"]
        out = adapter["offload_trainer"]["gbps"]["p50"]
        back = adapter["restore_trainer"]["gbps"]["p50"]
        if back is None:
            back = adapter["restore_sampler"]["gbps"]["p50"]
        # From the agent's journal: the sampler's checkpoints after its first, bytes copied.
        sampler = [sw for sw in figures.get("per_switch", []) if sw["out_job"].endswith("-1")]
        sampler_out = [sw["out_bytes"] - sw["out_skipped_bytes"] for sw in sampler[1:]]
        result: dict[str, Any] = {
            "out_gbps": out,
            "in_gbps": back,
            "out_x_floor": _ratio(out, out_floor),
            "in_x_floor": _ratio(back, in_floor),
            "target_x_floor": APP_FLOOR_TARGET,
            "sampler_unchanged_out_bytes": sampler_out,
            "sampler_moves_nothing_out": bool(sampler_out) and not any(sampler_out),
        }
        result["floor_met"] = all(
            r is not None and r >= APP_FLOOR_TARGET
            for r in (result["out_x_floor"], result["in_x_floor"])
        )
        return result
    journal = figures["journal"]
    out = journal["checkpoint"]["gbps"]["p50"]
    back = journal["restore"]["gbps"]["p50"]
    return {
        "out_gbps": out,
        "in_gbps": back,
        "out_x_floor": _ratio(out, out_floor),
        "in_x_floor": _ratio(back, in_floor),
    }
