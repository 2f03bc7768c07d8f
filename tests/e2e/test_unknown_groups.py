"""A group nobody serves (a mistyped name) is not granted silently: a warning on the grant,
the SDK's log and the CLI's stderr, or a refusal in strict mode that writes nothing.

Real etcd, replica, sim agent and CLI processes; docs/groups.md defines "known".
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tests.conftest import ClusterFactory
from tests.integration.etcdview import snapshot
from timeslice import AsyncTimeSliceClient, register
from timeslice.errors import NotFound
from timeslice_tools.dev.cluster import LocalCluster

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]
TYPO = "trainer-grup"


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``timeslice ARGS`` as the session's operator (which may act as any job)."""
    return subprocess.run(
        [*TIMESLICE, *args, "--target", cluster.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=cluster.client_env,
    )


def keys_of(keys: dict[str, tuple[bytes, int]], group: str) -> list[str]:
    return [k for k in keys if f"/groups/{group}/" in k]


def unknown_warning_checks(text: str, group: str) -> None:
    assert f"group {group} is not known" in text, text
    assert "no node serves it" in text, text
    assert "timeslice groups" in text, text  # how to check the name


async def test_an_unknown_group_is_granted_with_a_warning_a_served_one_without(
    cluster_factory: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory(agents=1)
    socket = str(cluster.agent_sockets["node-0"])
    caplog.set_level(logging.WARNING, logger="timeslice")
    with register("trainer-group", job_id="a", socket=socket):
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
        ):
            served = await a.acquire("trainer-group", timeout=20)
            assert served.warning == ""
            await a.yield_("trainer-group")
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

            typo = await b.acquire(TYPO, timeout=20)
            unknown_warning_checks(typo.warning, TYPO)
            logged = [r for r in caplog.records if r.name == "timeslice"]
            assert [r.levelno for r in logged] == [logging.WARNING], logged
            unknown_warning_checks(logged[0].getMessage(), TYPO)
            await b.yield_(TYPO)
            # Created by that first acquire, still nobody serves it: warned again.
            again = await b.acquire(TYPO, timeout=20)
            unknown_warning_checks(again.warning, TYPO)
            await b.yield_(TYPO)

            # Known once an operator made it: pinned, then unpinned (created by an operator).
            pinned = cli(cluster, "members", "ops-group", "--set", "node-0")
            assert pinned.returncode == 0, pinned.stderr
            grant = await b.acquire("ops-group", timeout=20)
            assert grant.warning == ""
            await b.yield_("ops-group")
            cleared = cli(cluster, "members", "ops-group", "--clear")
            assert cleared.returncode == 0, cleared.stderr
            grant = await b.acquire("ops-group", timeout=20)
            assert grant.warning == ""
            await b.yield_("ops-group")

        # A strict client of this lenient replica is refused, and nothing is written.
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a", strict_groups=True) as strict_a,
            AsyncTimeSliceClient(cluster.target, job_id="b", strict_groups=True) as strict_b,
        ):
            with pytest.raises(NotFound) as refused:
                await strict_b.acquire("other-typo", timeout=20)
            unknown_warning_checks(refused.value.message, "other-typo")
            assert (await strict_a.acquire("trainer-group", timeout=20)).warning == ""
            await strict_a.yield_("trainer-group")
        assert keys_of(await snapshot(cluster), "other-typo") == []

    # At a shell the CLI refuses an unknown group (exit 3: not found, nothing written); with
    # --allow-unknown it holds it, says why on stderr once, and exits 0.
    warned = cli(cluster, "acquire", "cli-typo", "--job", "b", "--hold", "0", "--allow-unknown")
    assert warned.returncode == 0, warned.stderr
    lines = warned.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: "), warned.stderr
    unknown_warning_checks(lines[0], "cli-typo")
    refused_cli = cli(cluster, "acquire", "cli-typo2", "--job", "b", "--hold", "0")
    assert refused_cli.returncode == 3, (refused_cli.returncode, refused_cli.stderr)
    unknown_warning_checks(refused_cli.stderr, "cli-typo2")
    assert keys_of(await snapshot(cluster), "cli-typo2") == []


async def test_strict_replica_refuses_unknown_groups_and_writes_nothing(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=1, orchestrator_args=["--strict-groups"])
    socket = str(cluster.agent_sockets["node-0"])
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="a") as a,
        AsyncTimeSliceClient(cluster.target, job_id="b") as b,
    ):
        with register("trainer-group", job_id="a", socket=socket):
            grant = await a.acquire("trainer-group", timeout=20)
            assert grant.warning == ""
            await a.yield_("trainer-group")
            # b's session exists first, so the refusal's own writes are all that could differ.
            with pytest.raises(NotFound):
                await b.acquire("yet-another-typo", timeout=20)
            before = await snapshot(cluster)
            with pytest.raises(NotFound) as refused:
                await b.acquire(TYPO, timeout=20)
            unknown_warning_checks(refused.value.message, TYPO)
            assert "strict" in refused.value.message
            after = await snapshot(cluster)
            assert keys_of(after, TYPO) == []
            assert before == after
        # A worker registered after the refusal makes the name known: granted.
        with register(TYPO, job_id="b", socket=socket):
            assert (await b.acquire(TYPO, timeout=20)).warning == ""
            await b.yield_(TYPO)
