"""``result.json`` (everything) and ``result.md`` (the same, for people) of a GPU check run."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.gpu_check.runner import Settings

GIB = 1 << 30


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def build(
    args: argparse.Namespace,
    settings: Settings,
    machine: dict[str, Any],
    backends: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    """The result document: settings, machine, per-backend figures, every failure in words."""
    finished = datetime.now(UTC).timestamp()
    failures = [
        f"{name}: {finding}"
        for name, result in backends.items()
        for finding in result.get("findings", [])
    ]
    mode = (
        "cpu: CPU tensors, no GPU involved; throughput figures are host memory copies"
        if settings.device == "cpu"
        else "gpu"
    )
    return {
        "tool": "scripts/gpu-check",
        "mode": mode,
        "started_at": _iso(started),
        "finished_at": _iso(finished),
        "seconds": finished - started,
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            "size_gib": args.size_gb,
            "holds_per_job": [settings.holds(0), settings.holds(1)],
            "backends": args.backend_names,
            "budget_seconds": args.budget_seconds,
        },
        "machine": machine,
        "backends": backends,
        "failures": failures,
    }


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    (out / "result.md").write_text(markdown(result))


def write_broken(out: Path, trace: str) -> None:
    """What is left to write when the check itself failed: the traceback."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"error": trace}, indent=2) + "\n")
    text = f"# timeslice GPU check\n\nThe check itself broke:\n\n```\n{trace}```\n"
    (out / "result.md").write_text(text)


def summary_line(result: dict[str, Any]) -> str:
    parts = [f"{name} {r['status']}" for name, r in result["backends"].items()]
    return f"[gpu-check] done in {result['seconds']:.0f} s: {', '.join(parts)}"


def _range(s: dict[str, Any] | None, digits: int = 2) -> str:
    """``p50 (min-max)`` of a summary, or a dash when it has no values."""
    if not s or not s.get("count"):
        return "-"
    return f"{s['p50']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f}, n={s['count']})"


def _machine_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    nvml = m.get("nvml", {})
    devices = nvml.get("devices") or m.get("torch", {}).get("devices") or []
    gpu = ", ".join(
        f"{d.get('name')} ({d.get('memory_total_bytes', d.get('memory_bytes', 0)) / GIB:.0f} GiB)"
        for d in devices
    )
    host = m.get("host", {})
    torch_info = m.get("torch", {})
    return [
        ("GPU", gpu or "none"),
        ("driver", nvml.get("driver_version", nvml.get("error", "-"))),
        ("CUDA (driver)", nvml.get("cuda_driver_version", "-")),
        ("nvidia-smi", m.get("nvidia_smi", {}).get("banner", "-")),
        ("torch", f"{torch_info.get('torch_version', torch_info.get('error', '-'))} "
                  f"(CUDA {torch_info.get('torch_cuda_version')})"),
        ("host", f"{host.get('kernel')}, {host.get('cpu_count')} CPUs, "
                 f"{host.get('memtotal_bytes', 0) / GIB:.0f} GiB RAM, Python {host.get('python')}"),
        ("kernel says", host.get("proc_version", "-")),
        ("cuda-checkpoint", m.get("cuda_checkpoint_binary") or "not on PATH"),
    ]  # fmt: skip


def _backend_row(name: str, r: dict[str, Any]) -> str:
    if r["status"] in ("skipped", "error") or "switches" not in r:
        why = r.get("reason") or "; ".join(r.get("findings", []))
        return f"| {name} | {r['status']}: {why} | | | | | | |"
    sw, ck, journal = r["switches"], r["checksums"], r["journal"]
    return (
        f"| {name} | {r['status']} | {sw['observed']}/{sw['target']} "
        f"| {ck['matched']}/{ck['checked']} | {r['nvml']['status']} "
        f"| {_range(journal['checkpoint']['gbps'])} | {_range(journal['restore']['gbps'])} "
        f"| {_range(r['switch_seen_by_waiter']['seconds'])} |"
    )


def _details(name: str, r: dict[str, Any]) -> list[str]:
    if "journal" not in r:
        return []
    lines = [f"### {name}", "", r.get("description", ""), ""]
    for kind in ("checkpoint", "restore"):
        j = r["journal"][kind]
        lines.append(
            f"- {kind}: {j['moved']} moves of {j['directives']} directives, "
            f"{j['bytes_total'] / GIB:.2f} GiB total; GiB per move {_gib(j['bytes'])}; "
            f"seconds {_range(j['seconds'])}; GB/s {_range(j['gbps'])}"
        )
    seen = r["switch_seen_by_waiter"]
    lines.append(
        f"- switch, holder's yield to waiter's grant: seconds {_range(seen['seconds'])}; "
        f"GB/s both directions {_range(seen['gbps_both_directions'])}"
    )
    lines.append(
        "- switch as the orchestrator timed it: seconds "
        f"{_range(seen['orchestrator_switch_seconds'])}"
    )
    if "adapter_restore" in r:
        a = r["adapter_restore"]
        lines.append(
            f"- adapter restore in the job process: seconds {_range(a['seconds'])}; "
            f"GB/s {_range(a['gbps'])}"
        )
    nv = r["nvml"]
    if "peer_bytes" in nv:
        lines.append(
            f"- NVML while holding after a switch: own GiB {_gib(nv['own_bytes'])}, "
            f"peer GiB {_gib(nv['peer_bytes'])}, limit {nv['limit_bytes'] / GIB:.2f}"
        )
    lines.append(f"- checksum seconds {_range(r['checksums']['seconds'], 3)}")
    lines.append(f"- orchestrator: {r.get('orchestrator_group_status')}")
    return [*lines, ""]


def _gib(s: dict[str, Any]) -> str:
    if not s.get("count"):
        return "-"
    return f"{s['p50'] / GIB:.2f} ({s['min'] / GIB:.2f}-{s['max'] / GIB:.2f})"


def markdown(result: dict[str, Any]) -> str:
    """The human-readable report."""
    s = result["settings"]
    lines = [
        "# timeslice GPU check",
        "",
        f"Mode: **{result['mode']}**. {result['started_at']} to {result['finished_at']} "
        f"({result['seconds']:.0f} s). {s['size_gib']:g} GiB per job, {s['switches']} "
        f"switches wanted per backend, keep_pinned={s['keep_pinned']}.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in _machine_rows(result["machine"])),
        "",
        "## Results",
        "",
        "GB/s = 10^9 bytes/s; p50 (min-max, n). Checkpoint/restore: bytes and time per "
        "directive from the agent's journal. Switch: holder's yield to waiter's grant.",
        "",
        "| backend | status | switches | checksums ok | NVML | checkpoint GB/s | restore GB/s "
        "| switch s |",
        "|---|---|---|---|---|---|---|---|",
        *(_backend_row(name, r) for name, r in result["backends"].items()),
        "",
        "## Failures",
        "",
        *([f"- {f}" for f in result["failures"]] or ["- none"]),
        "",
        "## Details",
        "",
    ]
    for name, r in result["backends"].items():
        lines += _details(name, r)
    return "\n".join(lines) + "\n"
