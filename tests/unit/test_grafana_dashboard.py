"""The Grafana dashboard compose ships (``compose/grafana/dashboards/timeslice.json``): every
query names series the services export (read from their own registries, as
``test_metrics_documented`` does), byte rates are in bytes per second, and the panels a job
owner and an operator look for first are there: acquire wait p50 / p99, agents connected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.unit.test_metrics_documented import exported

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "timeslice.json"
# A histogram family ``x`` is queried as ``x_bucket``, ``x_sum`` and ``x_count``.
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def panels() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return found


def series_in(expr: str) -> set[str]:
    return set(re.findall(r"\btimeslice_[a-z0-9_]+", expr))


def exposed_as(name: str, families: set[str]) -> bool:
    if name in families:
        return True
    return any(name.endswith(s) and name.removesuffix(s) in families for s in _HISTOGRAM_SUFFIXES)


def test_series_are_read_with_their_histogram_suffixes() -> None:
    families = {"timeslice_acquire_wait_seconds", "timeslice_grants_total"}
    assert exposed_as("timeslice_acquire_wait_seconds_bucket", families)
    assert exposed_as("timeslice_grants_total", families)
    assert not exposed_as("timeslice_grants", families)
    assert not exposed_as("timeslice_acquire_wait_bucket", families)
    assert series_in('max by (group) (timeslice_group_held{group=~"$group"})') == {
        "timeslice_group_held"
    }


async def test_every_query_names_an_exported_series() -> None:
    families = await exported()
    missing = {
        (panel["title"], name)
        for panel in panels()
        for target in panel["targets"]
        for name in series_in(target["expr"])
        if not exposed_as(name, families)
    }
    assert not missing, f"queries of series no service exports: {sorted(missing)}"
    assert all(series_in(t["expr"]) for p in panels() for t in p["targets"])


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels():
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, (panel["title"], cells[(x, y)])
                cells[(x, y)] = panel["title"]


def test_byte_rates_are_in_bytes_per_second() -> None:
    rates = 0
    for panel in panels():
        exprs = [t["expr"] for t in panel["targets"]]
        # No scaling to GB/s or the like: Grafana picks the prefix from the unit.
        assert not any(re.search(r"/\s*1e\d", e) for e in exprs), panel["title"]
        assert not re.search(r"[GMk]B/s|gbps", panel["title"], re.I), panel["title"]
        byte_rate = any(
            "bytes_per_second" in e or re.search(r"rate\(timeslice_[a-z_]*bytes", e) for e in exprs
        )
        if byte_rate:
            rates += 1
            assert panel["fieldConfig"]["defaults"]["unit"] == "Bps", panel["title"]
    assert rates >= 3  # bytes moved, bandwidth by node, agent bandwidth


def test_a_job_owner_finds_acquire_wait_and_an_operator_agents_connected() -> None:
    by_title = {p["title"]: p for p in panels()}
    wait = next(p for t, p in by_title.items() if t.startswith("Acquire wait"))
    exprs = [t["expr"] for t in wait["targets"]]
    assert wait["fieldConfig"]["defaults"]["unit"] == "s"
    for q in ("0.5", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({q},")
            and "timeslice_acquire_wait_seconds_bucket" in e
            for e in exprs
        ), (q, exprs)
    assert wait["gridPos"]["y"] == 0  # first thing on the page
    agents = by_title["Agents connected"]
    assert any("timeslice_agents_connected" in t["expr"] for t in agents["targets"])


def test_acquire_wait_is_shown_per_group_under_the_group_variable() -> None:
    (per_group,) = [p for p in panels() if p["title"].startswith("Acquire wait p50 / p99 by group")]
    exprs = [t["expr"] for t in per_group["targets"]]
    assert per_group["fieldConfig"]["defaults"]["unit"] == "s"
    for q in ("0.5", "0.99"):
        # Every replica exports the same per-group figure: max, never sum.
        assert any(
            e.startswith("max by (group) (timeslice_group_acquire_wait_seconds{")
            and 'group=~"$group"' in e
            and f'quantile="{q}"' in e
            for e in exprs
        ), (q, exprs)
    assert all("{{group}}" in t["legendFormat"] for t in per_group["targets"])
