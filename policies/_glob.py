"""Shell-style globs, checked at load and compiled once into one matcher.

A policy names dependencies, services and exception types with globs
(``openai:*``, ``*Timeout*``). Literal patterns go in a set (one hash lookup);
the others are translated with :mod:`fnmatch` and joined into one regex, so a
list of globs costs one ``match`` call however long it is. Matching is
case-sensitive (``fnmatchcase`` semantics) and ``*`` also matches dots.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Final

_GLOB_CHARS: Final = frozenset("*?[")
MAX_GLOB_LEN: Final = 512
#: A usable glob: every ``[`` closed. A ``]`` right after ``[`` or ``[!`` is a literal
#: member of the set (``fnmatch``'s rule), so ``[]]`` and ``[!]]`` are closed, ``[]``
#: and ``[!]`` are not. The alternatives never overlap, so matching is linear; the
#: policy file's JSON Schema carries the same pattern, for editors.
GLOB_PATTERN: Final = r"^(?:[^\[]|\[(?:!?\][^\]]*|![^\]]+|[^\]!][^\]]*)\])*$"
_GLOB: Final = re.compile(GLOB_PATTERN)


def check_glob(pattern: str) -> str:
    """Return ``pattern`` if it is a usable glob, else raise ``ValueError`` saying why."""
    if not pattern:
        raise ValueError("empty glob; use '*' to match anything")
    if len(pattern) > MAX_GLOB_LEN:
        raise ValueError(f"glob longer than {MAX_GLOB_LEN} characters")
    if not _GLOB.fullmatch(pattern):
        raise ValueError(f"bad glob {pattern!r}: unclosed '[' (write '[[]' for a literal '[')")
    return pattern


class GlobSet:
    """Matches a string against any of several globs; built once, called per span."""

    __slots__ = ("_exact", "_regex", "patterns")

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns: tuple[str, ...] = tuple(check_glob(p) for p in patterns)
        self._exact = frozenset(p for p in self.patterns if not _GLOB_CHARS & set(p))
        wild = [fnmatch.translate(p) for p in self.patterns if _GLOB_CHARS & set(p)]
        self._regex = re.compile("|".join(wild)) if wild else None

    def __call__(self, value: str) -> bool:
        if value in self._exact:
            return True
        return self._regex is not None and self._regex.match(value) is not None

    def __repr__(self) -> str:
        return f"GlobSet({list(self.patterns)!r})"
