"""Every ```python block of README.md compiles, imports what it uses, and the quick ones run.

A snippet a reader copies must not fail on a missing import: each block is
compiled, each of its imports is done for real, and every name it uses must be
bound in the block (an import, an assignment, a ``def``), be a builtin, or be
one the reader supplies. The last non-blank line before the opening fence may
carry a marker, an HTML comment the rendered page does not show:

* ``<!-- snippet: given graph, task -->``: names the reader's own code supplies;
* ``<!-- snippet: run -->``: the block is self-contained and quick (loopback
  at most), so it is run as well.
"""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\s*$")
_MARKER = re.compile(r"<!--\s*snippet:\s*(?P<what>run|given\b(?P<names>[^>]*?))\s*-->")


@dataclass(frozen=True)
class Snippet:
    line: int  # of the opening fence, 1-based
    source: str
    run: bool
    given: frozenset[str]

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def snippets(text: str) -> list[Snippet]:
    """The ```python blocks of ``text``, each with the marker before it, if any."""
    lines = text.splitlines()
    found: list[Snippet] = []
    index = 0
    while index < len(lines):
        if not _FENCE.match(lines[index]):
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"README.md:{index + 1}: a ```python block is never closed")
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marker = _MARKER.search(before)
        run = marker is not None and marker["what"] == "run"
        given = frozenset(
            name for name in re.split(r"[\s,]+", (marker["names"] or "") if marker else "") if name
        )
        source = "\n".join(lines[index + 1 : end]) + "\n"
        found.append(Snippet(index + 1, source, run, given))
        index = end + 1
    return found


def unbound_names(source: str, filename: str) -> set[str]:
    """Names ``source`` uses at module level (or as globals inside functions) but never binds."""
    top = symtable.symtable(source, filename, "exec")
    bound = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            at_top = table is top or symbol.is_global()
            if at_top and symbol.is_referenced():
                used.add(symbol.get_name())
    return used - bound - set(dir(builtins))


def imports_of(source: str, filename: str) -> str:
    """Only the import statements of ``source`` (at any depth), to be run on their own."""
    tree = ast.parse(source, filename)
    statements = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    return "\n".join(ast.unparse(node) for node in statements) + "\n"


README_SNIPPETS = snippets(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_snippets() -> None:
    assert len(README_SNIPPETS) >= 2


@pytest.mark.parametrize("snippet", README_SNIPPETS, ids=lambda s: s.where)
def test_each_snippet_compiles_and_imports_what_it_uses(snippet: Snippet) -> None:
    code = compile(snippet.source, snippet.where, "exec")
    assert code is not None
    exec(compile(imports_of(snippet.source, snippet.where), snippet.where, "exec"), {})
    missing = unbound_names(snippet.source, snippet.where) - snippet.given
    assert not missing, (
        f"{snippet.where} uses {sorted(missing)} without importing or defining them"
        " (or list them in a `<!-- snippet: given ... -->` marker if the reader supplies them)"
    )
    unused = snippet.given - unbound_names(snippet.source, snippet.where)
    assert not unused, f"{snippet.where}: the marker gives {sorted(unused)}, which it never uses"


@pytest.mark.parametrize("snippet", [s for s in README_SNIPPETS if s.run], ids=lambda s: s.where)
def test_self_contained_snippets_run(snippet: Snippet) -> None:
    exec(compile(snippet.source, snippet.where, "exec"), {"__name__": "readme_snippet"})


def test_snippets_type_check(tmp_path: Path) -> None:
    """mypy (the project's settings) on every block, the names a reader supplies typed ``Any``."""
    files = []
    for number, snippet in enumerate(README_SNIPPETS):
        given = "".join(f"{name}: Any\n" for name in sorted(snippet.given))
        path = tmp_path / f"readme_snippet_{number}.py"
        path.write_text(f"from typing import Any\n{given}{snippet.source}", encoding="utf-8")
        files.append(str(path))
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--cache-dir",
            str(tmp_path / "cache"),
            # A snippet's `def f() -> str: ...` stands for the reader's function, and a
            # decorator may name the function it decorates (the fallback calls it again).
            "--disable-error-code=empty-body",
            "--disable-error-code=has-type",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=README.parent,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- the checker itself ------------------------------------------------------------------


def test_a_missing_import_is_found() -> None:
    text = (
        "<!-- snippet: given graph -->\n"
        "```python\n"
        "import threading\n"
        "pool = ThreadPoolExecutor(8)\n"
        "threading.Thread(target=lambda: graph.invoke(task)).start()\n"
        "```\n"
    )
    (snippet,) = snippets(text)
    assert snippet.given == {"graph"} and not snippet.run
    assert unbound_names(snippet.source, "x") - snippet.given == {"ThreadPoolExecutor", "task"}


def test_a_run_marker_and_names_bound_in_the_block() -> None:
    text = (
        "Some text. <!-- snippet: run -->\n\n"
        "```python\n"
        "from math import tau\n"
        "def half(x: float = tau) -> float: return helper(x) / 2\n"
        "def helper(x: float) -> float: return x\n"
        "```\n"
    )
    (snippet,) = snippets(text)
    assert snippet.run and snippet.line == 3
    assert unbound_names(snippet.source, "x") == set()
