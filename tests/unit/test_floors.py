"""Floors that match the folders: nothing under ``libs/`` imports a package of ``services/``.

``libs/`` (the SDK, the generated protos, the tools) is the lower floor; the services stand on
it. A name both need lives in ``libs/`` (``timeslice.agent_contract`` holds the agent's backend
kinds and its journal's line shape for the tools). The tools still *launch* the services, as
processes (``python -m timeslice_agent``), which is not an import. Every module is parsed with
``ast``, so an import inside a function, a ``TYPE_CHECKING`` block or an ``import_module`` call
with a literal name counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs"
SERVICES = ROOT / "services"


def service_packages() -> frozenset[str]:
    return frozenset(p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists())


def imported(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``; relative ones stay in their
    own package, under the same folder, so they are left out."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def upward_imports(root: Path, forbidden: frozenset[str]) -> list[str]:
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported(path.read_text(encoding="utf-8")):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_the_check_sees_every_form_of_import() -> None:
    source = (
        "import timeslice_agent.config\n"
        "from timeslice_orchestrator import app\n"
        "from . import sibling\n"
        "def f():\n"
        "    from timeslice_agent.journal import JournalEntry\n"
        "    importlib.import_module('timeslice_orchestrator.http')\n"
        "import timeslice.errors\n"
    )
    assert sorted(m for _, m in imported(source)) == [
        "timeslice.errors",
        "timeslice_agent.config",
        "timeslice_agent.journal",
        "timeslice_orchestrator",
        "timeslice_orchestrator.http",
    ]


def test_nothing_under_libs_imports_a_service() -> None:
    services = service_packages()
    assert {"timeslice_orchestrator", "timeslice_agent"} <= services
    bad = upward_imports(LIBS, services)
    assert not bad, "libs/ must not import services/ (move the shared name down):\n" + "\n".join(
        bad
    )
