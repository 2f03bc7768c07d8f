"""Tests you can find from the file: every module has a test file named after it, or a row in
docs/architecture.md that says which tests cover it.

The rule (docs/architecture.md, "Where a module's tests are"): the tests of ``.../<name>.py``
are in ``tests/**/test_<name>.py`` or ``tests/**/test_<name>_<topic>.py``, where ``<name>``
may carry one of the module's folders in front (``timeslice_`` dropped, ``_`` of a private
module dropped): ``services/timeslice_agent/jobs.py`` -> ``tests/agent/test_agent_jobs.py``,
``libs/timeslice_tools/dev/timeline.py`` -> ``tests/dev/test_dev_timeline.py``. A module no
such file covers has a row in the table there, with the test files that do (unit tests under
another name, or the whole-system tests that are the only ones that can reach it). A new
module with neither fails here; so does a row whose module or test file no longer exists.

Run as a script (``python tests/unit/test_test_layout.py``) it prints the modules without a
test file of their name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TABLE_TITLE = "### Modules whose tests are not named after them"
# Generated code (make protos) and packages' faces are not modules with behaviour of their own.
SKIPPED_NAMES = frozenset({"__init__.py", "__main__.py"})
SKIPPED_DIRS = frozenset({"timeslice_proto", "__pycache__"})


def modules() -> list[Path]:
    """Every hand-written module under libs/ and services/, relative to the repository."""
    found = []
    for top in ("libs", "services"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if path.name in SKIPPED_NAMES or SKIPPED_DIRS & set(rel.parts):
                continue
            found.append(rel)
    return sorted(found)


def _test_file_stems() -> set[str]:
    """What follows ``test_`` in every test file's name."""
    return {p.stem.removeprefix("test_") for p in (ROOT / "tests").rglob("test_*.py")}


def names_for(module: Path) -> set[str]:
    """The stems a test file of ``module`` may have (without ``test_`` and ``_<topic>``)."""
    name = module.stem.lstrip("_")
    folders = {part.removeprefix("timeslice_") for part in module.parts[1:-1]}
    folders |= set(module.parts[1:-1])
    return {name} | {f"{folder}_{name}" for folder in folders}


def named_test(module: Path, stems: set[str]) -> bool:
    return any(s == n or s.startswith(n + "_") for s in stems for n in names_for(module))


def mapped(doc: str) -> dict[str, list[str]]:
    """The table of docs/architecture.md: module -> the test files that cover it."""
    _, found, rest = doc.partition(TABLE_TITLE)
    assert found, f"docs/architecture.md has no {TABLE_TITLE!r} section"
    table: dict[str, list[str]] = {}
    for line in rest.splitlines():
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        (module,) = re.findall(r"`([^`]+)`", cells[1])
        table[module] = re.findall(r"`([^`]+)`", cells[2])
    return table


def unmatched(stems: set[str] | None = None) -> list[Path]:
    stems = _test_file_stems() if stems is None else stems
    return [m for m in modules() if not named_test(m, stems)]


def test_the_naming_rule_reads_folders_and_topics() -> None:
    jobs = Path("services/timeslice_agent/jobs.py")
    assert named_test(jobs, {"agent_jobs"})
    assert named_test(jobs, {"jobs_table"})
    assert named_test(Path("libs/timeslice/_release.py"), {"release"})
    assert not named_test(jobs, {"agent_jobsx"})
    assert not named_test(jobs, {"jobtable"})


def test_every_module_has_tests_named_after_it_or_listed() -> None:
    table = mapped(DOC.read_text())
    missing = [str(m) for m in unmatched() if str(m) not in table]
    assert not missing, (
        "modules with no tests/**/test_<module>.py and no row in docs/architecture.md "
        f"({TABLE_TITLE!r}): add a test file named after each, or a row naming the tests "
        f"that cover it: {missing}"
    )


def test_every_row_names_a_module_and_test_files_that_exist() -> None:
    table = mapped(DOC.read_text())
    assert len(table) > 10, "the table was not read"
    stale = [m for m in table if not (ROOT / m).is_file()]
    assert not stale, f"rows for modules that no longer exist: {stale}"
    absent = [
        f"{m}: {t}" for m, ts in table.items() for t in ts if not (ROOT / "tests" / t).is_file()
    ]
    assert not absent, f"rows naming test files that do not exist: {absent}"
    empty = [m for m, ts in table.items() if not ts]
    assert not empty, f"rows naming no test file: {empty}"


if __name__ == "__main__":
    for module in unmatched():
        print(module)
