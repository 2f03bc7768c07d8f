"""Figures from one backend's run: the jobs' hold events and the agent's directive journal.

Nothing here is modelled: throughput is bytes the agent reported (NVML-measured where NVML
attributes memory to the pids, else the bytes the workers or their hooks reported) over the
time between the directive's arrival and its ack, both from the agent's journal; switch time
is from the holder's ``yield_`` call to the waiter's grant, both measured by the jobs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

GB = 1e9  # GB/s means 10^9 bytes per second, the unit PCIe and copy engines are quoted in
MOVES = ("checkpoint", "restore")


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Count, median, minimum and maximum (None figures when there are no values)."""
    data = sorted(values)
    if not data:
        return {"count": 0, "p50": None, "min": None, "max": None}
    return {"count": len(data), "p50": statistics.median(data), "min": data[0], "max": data[-1]}


@dataclass(frozen=True)
class HoldEvent:
    """One hold of one job, as the job recorded it."""

    job: int
    data: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


def journal_moves(journal: Sequence[dict[str, Any]], jobs: set[str]) -> dict[str, Any]:
    """Per direction: directives, bytes, seconds and GB/s of the OK moves of ``jobs``.

    ``bytes_moved`` is what left (or came back to) the device; of it, ``bytes_skipped`` left
    without a copy (the host copy was current). GB/s count the copied bytes only.
    """
    out: dict[str, Any] = {}
    for kind in MOVES:
        entries = [e for e in journal if e["kind"] == kind and e["job"] in jobs]
        moved = [e for e in entries if e["status"] == "ok" and e["bytes_moved"] > 0]
        copied = [e for e in moved if _copied(e) > 0]
        seconds = [e["finished_at"] - e["started_at"] for e in copied]
        out[kind] = {
            "directives": len(entries),
            "ok": sum(1 for e in entries if e["status"] == "ok"),
            "moved": len(moved),
            "bytes_total": sum(e["bytes_moved"] for e in moved),
            "bytes_skipped_total": sum(e.get("bytes_skipped", 0) for e in moved),
            "bytes": summary(e["bytes_moved"] for e in moved),
            "seconds": summary(seconds),
            "gbps": summary(
                _copied(e) / s / GB for e, s in zip(copied, seconds, strict=True) if s > 0
            ),
        }
    out["not_ok"] = [
        {k: e.get(k, "") for k in ("kind", "job", "status", "error", "epoch")}
        for e in journal
        if e["status"] != "ok" and e["job"] in jobs
    ]
    return out


def _copied(entry: dict[str, Any]) -> int:
    return int(entry["bytes_moved"]) - int(entry.get("bytes_skipped", 0))


def per_switch(journal: Sequence[dict[str, Any]], jobs: set[str]) -> list[dict[str, Any]]:
    """Each OK checkpoint of ``jobs`` in order, with the restore that followed it: the bytes
    one switch moved out (copied and skipped) and in."""
    moves = sorted(
        (e for e in journal if e["job"] in jobs and e["status"] == "ok" and e["kind"] in MOVES),
        key=lambda e: e["started_at"],
    )
    switches: list[dict[str, Any]] = []
    for entry in moves:
        if entry["kind"] == "checkpoint":
            switches.append({
                "out_job": entry["job"],
                "out_bytes": entry["bytes_moved"],
                "out_skipped_bytes": entry.get("bytes_skipped", 0),
                "out_seconds": entry["finished_at"] - entry["started_at"],
                "in_job": "", "in_bytes": 0, "in_seconds": 0.0,
            })  # fmt: skip
        elif switches and not switches[-1]["in_job"]:
            switches[-1].update(
                in_job=entry["job"],
                in_bytes=entry["bytes_moved"],
                in_seconds=entry["finished_at"] - entry["started_at"],
            )
    return switches


def adapter_cycles(events: Sequence[HoldEvent]) -> dict[str, Any]:
    """The app adapter's own offload and restore figures, in the job processes (copies and
    pinning, no control plane), per role."""
    out: dict[str, Any] = {}
    for kind in ("offload", "restore"):
        for role in ("trainer", "sampler"):
            stats = [e[f"adapter_{kind}"] for e in events
                     if e.get(f"adapter_{kind}") and e.get("role") == role]  # fmt: skip
            out[f"{kind}_{role}"] = {
                "cycles": len(stats),
                "copied_bytes": [s["copied_bytes"] for s in stats],
                "skipped_bytes": [s.get("skipped_bytes", 0) for s in stats],
                "seconds": summary(s["seconds"] for s in stats),
                "pin_seconds": summary(s.get("pin_seconds", 0.0) for s in stats),
                "copy_seconds": summary(s.get("copy_seconds", 0.0) for s in stats),
                "gbps": summary(
                    s["copied_bytes"] / s["seconds"] / GB
                    for s in stats
                    if s["seconds"] > 0 and s["copied_bytes"] > 0
                ),
                "copy_only_gbps": summary(
                    s["copied_bytes"] / s["copy_seconds"] / GB
                    for s in stats
                    if s.get("copy_seconds", 0) > 0 and s["copied_bytes"] > 0
                ),
            }
    return out


def switches_seen(
    events: Sequence[HoldEvent], journal: Sequence[dict[str, Any]], jobs: set[str]
) -> dict[str, Any]:
    """Per switch: holder's ``yield_`` to waiter's grant, and the bytes moved in between."""
    seconds: list[float] = []
    rates: list[float] = []
    orchestrator: list[float] = []
    for event in events:
        if not event["switched"]:
            continue
        yields = [
            e["yield_at"]
            for e in events
            if e.job != event.job and e["yield_at"] <= event["granted_at"]
        ]
        if not yields:
            continue
        start, end = max(yields), event["granted_at"]
        seconds.append(end - start)
        orchestrator.append(event["orchestrator_switch_seconds"])
        moved = sum(
            e["bytes_moved"]
            for e in journal
            if e["job"] in jobs and e["status"] == "ok" and e["kind"] in MOVES
            and start <= e["started_at"] and e["finished_at"] <= end
        )  # fmt: skip
        if moved > 0 and end > start:
            rates.append(moved / (end - start) / GB)
    return {
        "seconds": summary(seconds),
        "gbps_both_directions": summary(rates),
        "orchestrator_switch_seconds": summary(orchestrator),
    }


def checksums(events: Sequence[HoldEvent]) -> dict[str, Any]:
    """Every grant was checked word by word; the ones after a switch are the restores that
    matter (``corrupted``: where the self-test flipped a byte)."""
    after = [e for e in events if e["switched"]]
    return {
        "checked": len(events),
        "checked_after_switch": len(after),
        "matched": sum(1 for e in events if e["checksum_ok"]),
        "mismatched": [
            {"job": e.job, "hold": e["hold"], "what": e.get("mismatch", "")}
            for e in events
            if not e["checksum_ok"]
        ],
        "corrupted": [
            {"job": e.job, "hold": e["hold"], "what": e["corrupted"]}
            for e in events
            if e.get("corrupted")
        ],
        "seconds": summary(e["checksum_seconds"] for e in events),
    }


def nvml_check(events: Sequence[HoldEvent], *, skipped: str, limit_bytes: int) -> dict[str, Any]:
    """While a job holds the group after a switch, the peer holds at most ``limit_bytes``.

    ``skipped`` non-empty: NVML was not used (the reason). A check NVML cannot answer (it
    attributes no memory to the jobs' own pids, as in another pid namespace) is inconclusive.
    """
    if skipped:
        return {"status": f"skipped: {skipped}"}
    after = [e for e in events if e["switched"]]
    if not after:
        return {"status": "not checked: no switch happened"}
    base: dict[str, Any] = {
        "limit_bytes": limit_bytes,
        "peer_bytes": summary(e.get("nvml_peer_bytes", 0) for e in after),
        "own_bytes": summary(e.get("nvml_own_bytes", 0) for e in after),
    }
    if not any(e.get("nvml_own_bytes", 0) > 0 for e in after):
        # Then "the peer holds 0 bytes" proves nothing either.
        listed = sorted({p for e in after for p in e.get("nvml_pids_listed", [])})
        listed_own = any(e.get("nvml_own_listed") for e in after)
        return {
            **base,
            "status": "inconclusive: NVML attributes no device memory to the holding job's "
            f"own pid (listed: {listed_own}; pid namespace or sandbox?); other pids it "
            f"listed: {listed}",
        }
    over = [
        {"job": e.job, "hold": e["hold"], "peer_bytes": e.get("nvml_peer_bytes", 0)}
        for e in after
        if e.get("nvml_peer_bytes", 0) > limit_bytes
    ]
    return {**base, "status": "failed" if over else "passed", "over_limit": over}
