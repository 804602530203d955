"""No import cycles anywhere in the packages: each module can be read after what it imports.

Imports are read from the source with :mod:`ast`, all of them (inside functions
and under ``TYPE_CHECKING`` too): a cycle hidden in a function is still two
modules that cannot be understood one without the other. ``from pkg import X``
counts as importing ``pkg.X`` when that is a module, else ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_policies_imports import find_cycle

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "policies", "remediators")


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the package it is an attribute of."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_owner(a.name, known) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in known else _owner(node.module, known))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def test_the_packages_have_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = import_graph()
    graph["supervisor.normalize.wire"].add("supervisor.normalize.span")
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
