"""Start one container's command as a "pod" of this machine: run inside a private mount and
UTS namespace (``unshare --mount --uts --propagation private python podns.py SPEC``).

No container engine runs here, so a pod is emulated with what a root process can do without
one, and nothing of it is visible on the host or left behind when the pod's process exits:

- **A root of its own.** A tmpfs becomes the pod's ``/``; every entry of the host's ``/`` is a
  symlink into ``/.host`` (a recursive bind of the host's root). A ``mountPath`` that does not
  exist on the host (``/etc/timeslice/tls``, ``/tls``, ``/var/lib/etcd``) is made on that tmpfs:
  each ancestor on the way is "shadowed", replaced by a real directory whose entries are
  symlinks to the host's, so ``/etc`` keeps all of the host's files and gains ``timeslice/``.
  The volume's directory (a Secret's files, a PVC's or a hostPath's directory) is then bind-mounted
  there, read-only where the manifest says so.
- **Its own /etc/hosts and hostname.** The hosts file names every pod and Service of the test
  with its loopback address (127.x.y.z: all of 127/8 is on ``lo``), so the DNS names in the
  manifests resolve as cluster DNS would; the hostname is the pod's name (Kubernetes sets it).

Then it chroots into that root, changes to the container's working directory and execs the
container's command with exactly the environment it was given (the spec's ``env``): the pid
the test started is the service's own. The spec is JSON, written by :mod:`tests.deploy.pods`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import socket
import sys
from pathlib import PurePosixPath
from typing import Any

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
HOST = "/.host"

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount(
    source: str, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _populate(here: str, path: PurePosixPath) -> None:
    """Fill the tmpfs directory ``here`` with symlinks to the entries of the host's ``path``."""
    try:
        entries = os.listdir(str(path))
    except (FileNotFoundError, NotADirectoryError):
        entries = []  # new to the host too: nothing to mirror
    for entry in entries:
        if str(path) == "/" and entry == HOST.lstrip("/"):
            continue
        os.symlink(HOST + str(path / entry), os.path.join(here, entry))


def _mirror(root: str, path: PurePosixPath) -> None:
    """Make ``root + path`` a real directory of the tmpfs whose entries are the host's."""
    here = root + str(path)
    if os.path.isdir(here) and not os.path.islink(here):
        return
    if os.path.islink(here):
        os.unlink(here)
    os.mkdir(here)
    _populate(here, path)


def _make_parents(root: str, path: PurePosixPath) -> None:
    """Every ancestor of ``path`` becomes a real (shadowing) directory of the pod's root."""
    for ancestor in reversed(path.parents):
        if str(ancestor) != "/":
            _mirror(root, ancestor)


def _make_point(root: str, path: PurePosixPath, *, directory: bool) -> str:
    _make_parents(root, path)
    here = root + str(path)
    if os.path.islink(here):
        os.unlink(here)
    if directory:
        os.makedirs(here, exist_ok=True)
    elif not os.path.exists(here):
        open(here, "wb").close()
    return here


def build_root(spec: dict[str, Any]) -> str:
    root = str(spec["root"])
    mount("tmpfs", root, "tmpfs", 0, "mode=0755")
    os.mkdir(root + HOST)
    mount("/", root + HOST, None, MS_BIND | MS_REC)
    _populate(root, PurePosixPath("/"))
    for volume in spec["mounts"]:
        target = PurePosixPath(volume["path"])
        source = str(volume["source"])
        here = _make_point(root, target, directory=os.path.isdir(source))
        mount(source, here, None, MS_BIND | MS_REC)
        if volume.get("read_only"):
            mount(source, here, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    for path, content in spec["files"].items():
        here = _make_point(root, PurePosixPath(path), directory=False)
        with open(here, "w", encoding="utf-8") as f:
            f.write(content)
    return root


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec: dict[str, Any] = json.load(f)
    root = build_root(spec)
    socket.sethostname(spec["hostname"])
    os.chroot(root)
    os.chdir(spec.get("workdir") or "/")
    argv: list[str] = spec["argv"]
    env: dict[str, str] = spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"pod {spec['hostname']}: cannot exec {argv[0]}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
