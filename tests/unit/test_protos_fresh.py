"""The committed generated code must match what `make protos` produces from protos/."""

from __future__ import annotations

import filecmp
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_protogen() -> object:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["protogen"] = module
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    protogen = _load_protogen()
    fresh = tmp_path / "timeslice_proto"
    protogen.generate(fresh)  # type: ignore[attr-defined]
    committed = _files(ROOT / "libs" / "timeslice_proto")
    regenerated = _files(fresh)
    assert sorted(committed) == sorted(regenerated), "files differ: run `make protos`"
    stale = [
        name
        for name in committed
        if not filecmp.cmp(committed[name], regenerated[name], shallow=False)
    ]
    assert not stale, f"stale generated files (run `make protos`): {stale}"
