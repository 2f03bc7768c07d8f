"""``result.json`` (everything), ``result.md`` (the same, for people) and the summary table
that ends the check's stdout."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.gpu_check import verdict
from scripts.gpu_check.plan import Plan
from scripts.gpu_check.runner import Settings

GIB = 1 << 30
MIB = 1 << 20


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def build(
    args: argparse.Namespace,
    settings: Settings,
    machine: dict[str, Any],
    plan: Plan,
    pre: dict[str, Any],
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
            "size_gib": settings.size_bytes / GIB,
            "holds_per_job": [settings.holds(0), settings.holds(1)],
            "backends": args.backend_names,
            "budget_seconds": args.budget_seconds,
        },
        "machine": machine,
        "plan": plan.to_json(),
        "smoke": pre.get("smoke"),
        "floor": pre.get("floor"),
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


def _x(value: float | None, ratio: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _moved(r: dict[str, Any]) -> str:
    """Per switch, GiB copied out / skipped out / in: ``c/s/i`` p50 over the switches."""
    switches = r.get("per_switch") or []
    if not switches:
        return "-"
    copied = sorted(s["out_bytes"] - s["out_skipped_bytes"] for s in switches)
    skipped = sorted(s["out_skipped_bytes"] for s in switches)
    back = sorted(s["in_bytes"] for s in switches)
    mid = len(switches) // 2
    return f"{copied[mid] / GIB:.2f}/{skipped[mid] / GIB:.2f}/{back[mid] / GIB:.2f}"


def summary_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per backend (and the smoke step): what the table shows."""
    device = "cpu" if result["mode"].startswith("cpu") else "cuda"
    rows = [["backend", "status", "switches", "restores ok", "NVML",
             "out GB/s (x floor)", "in GB/s (x floor)", "GiB/switch out/skip/in"]]  # fmt: skip
    smoke = result.get("smoke")
    if smoke is not None:
        states = " > ".join(f"{step}:{state}" for step, state in smoke.get("states", []))
        status = "passed" if smoke.get("ok") else f"failed: {smoke.get('error', '')}"
        rows.append(["smoke", status, states or "-", str(smoke.get("child_check", "-")),
                     "-", "-", "-", "-"])  # fmt: skip
    for name, r in result["backends"].items():
        if "switches" not in r:
            why = r.get("reason") or "; ".join(r.get("findings", []))
            rows.append([name, f"{r['status']}: {why}"[:110], "-", "-", "-", "-", "-", "-"])
            continue
        sw, ck, t = r["switches"], r["checksums"], r.get("targets", {})
        nvml = verdict.nvml_label(r["nvml"]["status"], device)[:40]
        rows.append([
            name, r["status"], f"{sw['observed']}/{sw['target']}",
            f"{ck['matched']}/{ck['checked']}", nvml,
            _x(t.get("out_gbps"), t.get("out_x_floor")), _x(t.get("in_gbps"), t.get("in_x_floor")),
            _moved(r),
        ])  # fmt: skip
    return rows


def summary_table(result: dict[str, Any], code: int) -> str:
    """The lines that end stdout: the table, each backend's first findings, the exit status."""
    rows = summary_rows(result)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    floor = result.get("floor") or {}
    plan = result.get("plan") or {}
    head = (
        f"[gpu-check] SUMMARY: {result['mode'].split(':')[0]}, {plan.get('job_gib', '?')} GiB "
        f"per job, floor out {floor.get('out_gbps', 0):.1f} in {floor.get('in_gbps', 0):.1f} "
        f"GB/s, {result['seconds']:.0f} s"
    )
    lines = [head]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]  # fmt: skip
    for name, r in result["backends"].items():
        for finding in r.get("findings", [])[:3]:
            lines.append(f"  {name}: {finding}"[:300])
        app = r.get("targets", {})
        if "sampler_moves_nothing_out" in app:
            lines.append(
                f"  {name}: unchanged sampler out bytes per switch "
                f"{app['sampler_unchanged_out_bytes']} (target 0: "
                f"{'met' if app['sampler_moves_nothing_out'] else 'NOT met'}); floor "
                f"x{app['target_x_floor']}: {'met' if app['floor_met'] else 'NOT met'}"
            )
    lines.append(f"[gpu-check] exit status {code} ({'a backend failed' if code else 'no failure'})")
    return "\n".join(lines)


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


def _table(rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
                    for row in rows[1:]]  # fmt: skip


def _plan_lines(result: dict[str, Any]) -> list[str]:
    plan = result.get("plan") or {}
    lines = ["## Plan", ""]
    lines += [f"- {why}" for why in plan.get("why", [])]
    lines += [f"- time share {name}: {sec:.0f} s"
              for name, sec in plan.get("shares_seconds", {}).items()]  # fmt: skip
    floor = result.get("floor") or {}
    lines += ["", "## Copy floor", "", f"`{json.dumps(floor)}`", ""]
    return lines


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
    for key, a in r.get("adapter", {}).items():
        lines.append(
            f"- adapter {key.replace('_', ' ')}: {a['cycles']} cycles, MiB copied "
            f"{[b // MIB for b in a['copied_bytes']]}, skipped "
            f"{[b // MIB for b in a['skipped_bytes']]}; seconds {_range(a['seconds'])} (pin "
            f"{_range(a['pin_seconds'])}, copy {_range(a['copy_seconds'])}); GB/s "
            f"{_range(a['gbps'])}, copy only {_range(a['copy_only_gbps'])}"
        )
    for i, sw in enumerate(r.get("per_switch", []), 1):
        lines.append(
            f"- switch {i}: out {sw['out_job']} {sw['out_bytes'] / MIB:.0f} MiB "
            f"({sw['out_skipped_bytes'] / MIB:.0f} skipped) in {sw['out_seconds']:.2f} s; in "
            f"{sw['in_job'] or '-'} {sw['in_bytes'] / MIB:.0f} MiB in {sw['in_seconds']:.2f} s"
        )
    if r.get("targets"):
        lines.append(f"- targets: {r['targets']}")
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
        f"({result['seconds']:.0f} s). {s['size_gib']:.2f} GiB per job, {s['switches']} "
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
        *_table(summary_rows(result)),
        "",
        *_plan_lines(result),
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
