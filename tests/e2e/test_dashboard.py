"""The dashboard in a real headless browser (Debian's chromium, driven by Selenium), against a
real cluster: the page shows a group and its holder, then changes without a reload when a
switch happens; names are shown as text, never run. And 200 open event streams do not stop a
replica from serving gRPC.

A screenshot is kept: ``dashboard.png`` in the test's tmp dir, copied to ``artifacts/``.
The browser must be installed (``.ci/run`` installs it): a missing browser fails the test.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.conftest import ClusterFactory
from tests.integration.etcdview import etcd_client
from timeslice import AsyncTimeSliceClient, register
from timeslice.cli.base import call, parse_targets
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import GroupStats
from timeslice_proto.timeslice.placement.v1 import CreatePoolRequest, PlacementStub
from timeslice_proto.timeslice.v1 import TimeSliceStub
from timeslice_tools.dev.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
SIM = ["--sim-state-gb", "0.25", "--sim-bandwidth-gbps", "5"]
# A group name no client may use (the API checks ids), written to etcd directly: the page
# must show it as text. No '/' (it would split the key).
POOL = "dash-pool"
POOL_GROUPS = ["pool-g1", "pool-g2"]
EVIL = "x<script>window.__xss=1<\\script><img src=x onerror=window.__xss=2>"


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name) or (
            f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None
        )
        if found:
            return found
    pytest.fail(
        f"no {' or '.join(names)} on this machine: install Debian's chromium and "
        "chromium-driver (apt-get install -y chromium chromium-driver; .ci/run does)"
    )


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = _binary("chromium", "chromium-browser")
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,900",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(_binary("chromedriver")), options=options)
    except WebDriverException as exc:
        pytest.fail(f"chromium did not start: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()


async def wait_for(
    driver: WebDriver, what: str, check: Callable[[WebDriver], bool], timeout: float = 20
) -> None:
    """Poll the page (in a thread: Selenium blocks) until ``check`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await asyncio.to_thread(check, driver):
                return
        except StaleElementReferenceException:
            pass  # redrawn while we looked: look again

        if time.monotonic() > deadline:
            text = await asyncio.to_thread(lambda: driver.find_element(By.TAG_NAME, "body").text)
            raise AssertionError(f"the page never showed {what}; it shows:\n{text}")
        await asyncio.sleep(0.2)


def cell(driver: WebDriver, group: str, field: str) -> str:
    """The text of one field of a group's row, read in one go (rows are redrawn live)."""
    text = driver.execute_script(
        """
        const rows = document.querySelectorAll("#groups tbody tr");
        for (const row of rows) {
          if (row.getAttribute("data-group") === arguments[0]) {
            const c = row.querySelector('[data-field="' + arguments[1] + '"]');
            return c ? c.textContent : "";
          }
        }
        return "";
        """,
        group,
        field,
    )
    return str(text)


def node_backend(driver: WebDriver, node: str, field: str = "backend") -> str:
    """The backend (or another ``field``) cell of a node's row in the nodes view."""
    text = driver.execute_script(
        """
        const row = document.querySelector('#nodes tbody tr[data-node="' + arguments[0] + '"]');
        const c = row ? row.querySelector('[data-field="' + arguments[1] + '"]') : null;
        return c ? c.textContent : "";
        """,
        node,
        field,
    )
    return str(text)


def host_shown(text: str) -> bool:
    """A host memory cell as the page must show it: the figure this replica heard (a sim
    agent's modelled host: emulated) with its age, or the replica that holds it."""
    heard = re.fullmatch(r"[0-9.]+ [kMGT]?B freeemulated[0-9.]+ s ago", text)
    return heard is not None or re.fullmatch(r"reported to r[0-9]+", text) is not None


def swatch_color(driver: WebDriver, group: str) -> str:
    """The colour of a group's swatch in the groups table (as the browser computed it)."""
    found = driver.execute_script(
        """
        for (const row of document.querySelectorAll("#groups tbody tr")) {
          if (row.getAttribute("data-group") === arguments[0]) {
            return getComputedStyle(row.querySelector(".swatch")).backgroundColor;
          }
        }
        return "";
        """,
        group,
    )
    return str(found)


def timeline_switches(driver: WebDriver, group: str) -> list[str]:
    found = driver.execute_script(
        """
        for (const row of document.querySelectorAll("#timeline .tl-row")) {
          if (row.getAttribute("data-group") === arguments[0]) {
            return Array.from(row.querySelectorAll('[data-kind="switch"]'), e => e.textContent);
          }
        }
        return [];
        """,
        group,
    )
    return [str(t) for t in found]


def recent_groups(driver: WebDriver) -> list[str]:
    found = driver.execute_script(
        """return Array.from(document.querySelectorAll("#recent tbody tr"),
                             r => r.getAttribute("data-group"));"""
    )
    return [str(g) for g in found]


async def place_one(cluster: LocalCluster, client: AsyncTimeSliceClient) -> str:
    """Create a placement pool (as the operator) and place one role of ``client``'s job in
    it; the placement's reason."""

    async def create(stub: TimeSliceStub, timeout: float) -> object:
        request = CreatePoolRequest(POOL, POOL_GROUPS)
        return await PlacementStub(stub.channel).create_pool(request, timeout=timeout)

    await call(parse_targets(cluster.target), "CreatePool", create)
    answer = await client.place(POOL, ["sampler"])
    (role,) = answer.roles
    assert role.group_id == POOL_GROUPS[0], answer
    return role.reason


def pool_text(driver: WebDriver, table: str) -> str:
    """The text of one table (groups, assignments) of the pool's part of the pools view."""
    text = driver.execute_script(
        """
        const pool = document.querySelector('#pools [data-pool="' + arguments[0] + '"]');
        const t = pool ? pool.querySelector('[data-field="' + arguments[1] + '"]') : null;
        return t ? Array.from(t.rows).slice(1).map((r) => r.textContent).join("\\n") : "";
        """,
        POOL,
        table,
    )
    return str(text)


async def write_evil_group(cluster: LocalCluster) -> None:
    etcd = etcd_client(cluster)
    try:
        stats = GroupStats(last_error=f"boom <b>{EVIL}</b>")
        await etcd.put(Keyspace(cluster.prefix).stats(EVIL), stats.encode())
    finally:
        await etcd.close()


async def test_the_page_follows_a_switch_live(
    cluster_factory: ClusterFactory, browser: WebDriver, tmp_path: Path
) -> None:
    cluster = cluster_factory(replicas=2, agents=2, agent_args=SIM)
    sockets = cluster.agent_sockets
    workers = [
        register("train", job_id=job, socket=str(sockets[node]))
        for job in ("rollout-a", "trainer-b")
        for node in sockets
    ]
    await write_evil_group(cluster)
    # The second replica: every replica mirrors every group, whichever drives it.
    url = f"http://{cluster.replica_http[1]}/"
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="rollout-a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="trainer-b") as b,
            AsyncTimeSliceClient(cluster.targets, job_id="eval-c") as c,
        ):
            await a.acquire("train", timeout=30)
            # A placement pool with one role placed: the page reads pools from etcd.
            reason = await place_one(cluster, a)
            await asyncio.to_thread(browser.get, url)
            await wait_for(
                browser, "the live stream", lambda d: "live" in d.find_element(By.ID, "conn").text
            )
            await wait_for(
                browser,
                "rollout-a holding train",
                lambda d: "rollout-a" in cell(d, "train", "holder"),
            )
            # The evil name is shown as text, and nothing in it ran.
            await wait_for(
                browser,
                "the odd group's name",
                lambda d: EVIL in d.find_element(By.ID, "groups").text,
            )
            assert await asyncio.to_thread(browser.execute_script, "return window.__xss") is None
            # The nodes view: each node's backend, labelled emulated (the sim backend).
            await wait_for(
                browser,
                "every node's backend, emulated",
                lambda d: all(node_backend(d, n) == "simemulated" for n in sockets),
            )
            await wait_for(
                browser,
                "every node's host memory free, or the replica holding it",
                lambda d: all(host_shown(node_backend(d, n, "host")) for n in sockets),
            )
            assert "over " in cell(browser, "train", "duty")  # the span the duty is over
            train_color = await asyncio.to_thread(swatch_color, browser, "train")
            assert train_color.startswith("rgb"), train_color
            # A second group (sorting before it) leaves train's colour as it was.
            await c.acquire("aaa-eval", timeout=30)
            await wait_for(
                browser, "the second group", lambda d: "eval-c" in cell(d, "aaa-eval", "holder")
            )
            assert await asyncio.to_thread(swatch_color, browser, "train") == train_color
            assert await asyncio.to_thread(swatch_color, browser, "aaa-eval") != train_color
            await c.yield_("aaa-eval")
            # A marker that a reload would lose.
            await asyncio.to_thread(browser.execute_script, "window.__marker = 42")

            waiter = asyncio.create_task(b.acquire("train", timeout=30))
            await wait_for(
                browser, "trainer-b queued", lambda d: "trainer-b" in cell(d, "train", "queue")
            )
            await asyncio.sleep(1.5)  # a visible hold on the chart
            await a.yield_("train")
            await waiter
            await wait_for(
                browser,
                "trainer-b holding train",
                lambda d: "trainer-b" in cell(d, "train", "holder"),
            )
            await wait_for(
                browser, "the switch in the recent list", lambda d: "train" in recent_groups(d)
            )
            row = await asyncio.to_thread(
                browser.execute_script,
                'return document.querySelector("#recent tbody tr").textContent',
            )
            assert "rollout-a" in row and "trainer-b" in row and "committed" in row, row
            assert "emulated" in row, row  # a sim switch time is not a measurement
            # The group's timeline: the switch, who to whom, how long, emulated.
            handover = "rollout-a \u2192 trainer-b"
            await wait_for(
                browser,
                "the switch on train's timeline",
                lambda d: any(handover in e for e in timeline_switches(d, "train")),
            )
            switches = await asyncio.to_thread(timeline_switches, browser, "train")
            (entry,) = [e for e in switches if handover in e]
            assert "took" in entry and entry.endswith("emulated"), entry
            assert await asyncio.to_thread(browser.execute_script, "return window.__marker") == 42
            assert await asyncio.to_thread(browser.execute_script, "return window.__xss") is None
            # rollout-a asks again: the queue shows it while trainer-b holds.
            again = asyncio.create_task(a.acquire("train", timeout=60))
            await wait_for(
                browser, "rollout-a queued", lambda d: "rollout-a" in cell(d, "train", "queue")
            )
            # The chart draws a line for the group (a point every few seconds).
            await wait_for(
                browser,
                "the duty cycle chart",
                lambda d: (
                    "train" in d.find_element(By.ID, "legend").text
                    and bool(d.find_elements(By.CSS_SELECTOR, "#chart polyline"))
                ),
                timeout=15,
            )
            await asyncio.sleep(0.5)
            shot = tmp_path / "dashboard.png"
            assert await asyncio.to_thread(browser.save_screenshot, str(shot))
            ARTIFACTS.mkdir(exist_ok=True)
            shutil.copy(shot, ARTIFACTS / "dashboard.png")
            # The pools section: the pool, its groups' duty, the role's group and reason.
            await wait_for(
                browser,
                "the placement pool",
                lambda d: (
                    pool_text(d, "groups").startswith(f"{POOL_GROUPS[0]}")
                    and reason in pool_text(d, "assignments")
                ),
            )
            assert "rollout-a/sampler" in await asyncio.to_thread(pool_text, browser, "groups")
            assignments = await asyncio.to_thread(pool_text, browser, "assignments")
            assert POOL_GROUPS[0] in assignments and "provisional" in assignments, assignments
            await asyncio.to_thread(
                browser.execute_script, 'document.getElementById("pools").scrollIntoView()'
            )
            pools_shot = tmp_path / "dashboard-pools.png"
            assert await asyncio.to_thread(browser.save_screenshot, str(pools_shot))
            shutil.copy(pools_shot, ARTIFACTS / "dashboard-pools.png")
            # And the story below: the timeline and the nodes view.
            await asyncio.to_thread(
                browser.execute_script, 'document.getElementById("timeline").scrollIntoView()'
            )
            story = tmp_path / "dashboard-timeline.png"
            assert await asyncio.to_thread(browser.save_screenshot, str(story))
            shutil.copy(story, ARTIFACTS / "dashboard-timeline.png")
            await b.yield_("train")
            await again
            await a.yield_("train")
    finally:
        for w in workers:
            w.close()


async def test_200_event_streams_leave_grpc_serving(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        replicas=1, agents=1, orchestrator_args=["--dashboard-max-streams", "200"]
    )
    http = cluster.replica_http[0]
    worker = register("g", job_id="j", socket=str(cluster.agent_sockets[cluster.nodes[0]]))

    async def acquire_and_yield(client: AsyncTimeSliceClient) -> float:
        start = time.monotonic()
        await client.acquire("g", timeout=10)
        await client.yield_("g")
        return time.monotonic() - start

    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="j") as client,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            baseline = await acquire_and_yield(client)
            streams = [await session.get(f"http://{http}/events") for _ in range(200)]
            assert all(s.status == 200 for s in streams)
            for s in streams:  # each got its snapshot
                async with asyncio.timeout(10):
                    assert (await s.content.readline()).startswith(b"retry:")
            # One more is refused, and says so.
            async with session.get(f"http://{http}/events") as refused:
                assert refused.status == 503
            # Every stream gets the change an acquire makes; gRPC keeps serving meanwhile.
            loaded = [await acquire_and_yield(client) for _ in range(3)]
            assert max(loaded) < 5.0, (baseline, loaded)
            health = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://{http}/healthz", timeout=5).read()
            )
            assert health == b"ok\n"
            print(f"acquire+yield: {baseline:.3f} s alone, {loaded} s with 200 streams open")
            for s in streams:
                s.close()
    finally:
        worker.close()
