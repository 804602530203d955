"""The shape of the ``policies`` package: no import cycles, a schema that runs nothing, one API.

Imports are read from the source with :mod:`ast`, all of them: those under
``if TYPE_CHECKING:`` and inside functions count too, since a cycle hidden
there is still two modules that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "policies"

#: Modules the policy-file models may import: each other and helpers that only check values.
SCHEMA_MODULES = frozenset(
    {
        "policies._schema",
        "policies._schema_admission",
        "policies._schema_fields",
        "policies._schema_budgets",
        "policies._schema_verifiers",
    }
)
CHECKING_HELPERS = frozenset(
    {"policies._glob", "policies._regex", "policies._text", "policies._json_schema"}
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str = "policies") -> set[str]:
    """Every ``package`` module ``path`` imports (``from policies import X`` is the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package:
                # ``from policies import _x`` names a module; anything else is the package.
                for alias in node.names:
                    sub = f"{package}.{alias.name}"
                    found.add(sub if (PACKAGE / f"{alias.name}.py").exists() else package)
            elif node.module.split(".")[0] == package:
                found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.glob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_the_graph_is_read_from_every_module() -> None:
    graph = import_graph()
    assert "policies._schema" in graph
    assert "policies._schema_fields" in graph["policies._schema"]
    assert "policies._spend" in graph["policies._model_table"]


def test_policies_has_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_a_cycle_is_found_and_shown() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_type_checking_import_counts(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from policies._spend import RunSpend\n"
        "def f():\n"
        "    import policies._slo\n"
    )
    assert imported_modules(module) == {"policies._spend", "policies._slo"}


def test_the_schema_imports_no_runtime_code() -> None:
    graph = import_graph()
    for name in sorted(SCHEMA_MODULES):
        assert graph[name] <= SCHEMA_MODULES | CHECKING_HELPERS, name
    for name in sorted(CHECKING_HELPERS):
        assert not graph[name] & SCHEMA_MODULES, name


@pytest.mark.parametrize("folder", ["supervisor", "remediators", "bench", "examples"])
def test_callers_use_the_public_api(folder: str) -> None:
    private = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in imported_modules(path)
        if name != "policies"
    }
    assert not private
