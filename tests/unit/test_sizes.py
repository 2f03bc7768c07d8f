"""Rooms that stay small: a hand-written class over 400 lines or module over 700 is listed in
docs/architecture.md ("Sizes") with the reason it is one piece, or this fails.

Run as a module (``python -m tests.unit.test_sizes``) it prints every class and module over
its bound, listed or not.
"""

from __future__ import annotations

import ast
import re

from tests.unit.test_test_layout import DOC, ROOT, modules

MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 700
SECTION = "## Sizes"


def oversized() -> dict[str, list[str]]:
    """Each hand-written module over a bound: what is over (``module 766``, ``Foo 420``)."""
    found: dict[str, list[str]] = {}
    for rel in modules():
        source = (ROOT / rel).read_text()
        over = []
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            over.append(f"module {lines}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    over.append(f"{node.name} {size}")
        if over:
            found[str(rel)] = over
    return found


def listed() -> set[str]:
    """The modules the "Sizes" table of docs/architecture.md names."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    table = text[start : end if end != -1 else len(text)]
    return set(re.findall(r"^\| `([^`]+\.py)` \|", table, re.MULTILINE))


def test_every_oversized_room_is_listed_with_its_reason() -> None:
    unlisted = {path: over for path, over in oversized().items() if path not in listed()}
    assert not unlisted, (
        f"over {MAX_CLASS_LINES} lines a class or {MAX_MODULE_LINES} a module, and not in "
        f'the "Sizes" table of docs/architecture.md: {unlisted}; cut it, or list it with why '
        "it is one concept read top to bottom"
    )


def test_every_listed_room_is_still_oversized() -> None:
    # A row outlives its reason once the room is cut: the table lists what is big today.
    stale = listed() - set(oversized())
    assert not stale, f'rows of the "Sizes" table no longer over a bound: {sorted(stale)}'


if __name__ == "__main__":
    for path, over in sorted(oversized().items()):
        print(f"{path}: {', '.join(over)}{'' if path in listed() else '  (not listed)'}")
