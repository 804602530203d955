"""Semantic verifiers: checks on what a span returned, not on whether it raised.

A span can end OK and still be wrong: an empty answer, prose where JSON was
promised, a leaked key, a token count far over budget. A verifier that fails
makes the span fail as class ``semantic``, kind ``verification_failed``
(DESIGN's vocabulary)::

    verifiers:
      - name: answer-is-json
        match: {service: "billing-*", role: llm}      # all optional, all must hold
        output_json_schema: {type: object, required: [answer]}
      - name: no-keys-leaked
        output_regex: {pattern: "sk-[A-Za-z0-9]{20,}", must_match: false}
      - name: tokens-bounded
        match: {role: llm}
        attribute_range: {key: llm.token_count.total, max: 8000}
      - name: final-answer
        final_answer_empty: true

Each verifier has exactly one check: ``output_empty``, ``output_regex``,
``output_json``, ``output_json_schema``, ``attribute_range`` or
``final_answer_empty`` (on a run's root ``agent``/``chain`` span, which ends
last and carries the run's answer).

Span content is untrusted, so every check is bounded:

* regexes are compiled at load and searched in at most the first
  :data:`MAX_REGEX_CHARS` characters of the output. With the ``regex`` package
  each search also runs under a :data:`REGEX_TIMEOUT_S` time limit; a timeout
  leaves the span unjudged and is reported once, and a verifier that times out
  :data:`MAX_TIMEOUTS` times is switched off until the policy is reloaded.
  Without ``regex`` (plain ``re`` cannot be interrupted) only the first
  :data:`MAX_REGEX_CHARS_NO_TIMEOUT` characters are searched and load also
  rejects two repeats in a row over the same characters (``a.*b.*c``).
  Either way, load rejects the shapes that backtrack exponentially
  (``(a+)+``, ``(.*)*``, ``(a|a)*``): the same policy loads the same on every
  machine, and the mistake is reported with its field path instead of costing
  a timeout per span.
* JSON is parsed with orjson up to :data:`MAX_JSON_CHARS`; JSON Schemas are
  checked at load (metaschema, size, local ``$ref`` only, their ``pattern``
  regexes), run with an O(n) ``uniqueItems``, and report one error per span
  (``format`` is an annotation, as jsonschema does by default).
* an output as long as the normalizer's cut (:data:`NORMALIZED_OUTPUT_CHARS`)
  may have been cut: a JSON document that ends early there, or a pattern that
  must match but is not found in it, leaves the span unjudged rather than
  failing it on text the agent never wrote.

A span that already failed is not verified: its failure is classified by the
rules, and a second verdict on the same span would report it twice.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from types import ModuleType
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import (
    AfterValidator,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)

from policies._glob import GlobSet
from policies._schema import (
    MAX_REGEX_LEN,
    Description,
    Globs,
    Name,
    Roles,
    _list_of,
    _Strict,
)
from supervisor.records import AttrValue, FailureClass, Role, SpanRecord

__all__ = [
    "MAX_JSON_CHARS",
    "MAX_REGEX_CHARS",
    "MAX_TIMEOUTS",
    "NORMALIZED_OUTPUT_CHARS",
    "REGEX_TIMEOUT_S",
    "VERIFICATION_CLASS",
    "VERIFICATION_KIND",
    "AttributeRangeSpec",
    "OutputRegexSpec",
    "VerificationFailure",
    "VerifierError",
    "VerifierMatch",
    "VerifierSet",
    "VerifierSpec",
    "Verifiers",
    "backtracking_problem",
    "compile_verifiers",
]

log = logging.getLogger("spanvisor.verifiers")

#: What a failed verification is classified as (DESIGN's vocabulary).
VERIFICATION_CLASS: Final = FailureClass.SEMANTIC
VERIFICATION_KIND: Final = "verification_failed"

MAX_VERIFIERS: Final = 256
#: Characters of output searched by a regex when ``regex`` bounds each search in time.
MAX_REGEX_CHARS: Final = 64 * 1024
#: Characters searched with plain ``re`` (no time limit): the bound rule messages use.
MAX_REGEX_CHARS_NO_TIMEOUT: Final = 8 * 1024
#: Time limit of one regex search (``regex`` only).
REGEX_TIMEOUT_S: Final = 0.05
#: Timeouts after which a verifier stops running until the policy is reloaded.
MAX_TIMEOUTS: Final = 5
#: Longest output parsed as JSON (the normalizer's own parse limit).
MAX_JSON_CHARS: Final = 256 * 1024
#: Where the normalizer cuts ``output_text`` (``supervisor.normalize.attributes.MAX_OUTPUT_CHARS``;
#: a test keeps the two equal). An output this long may end where the cut was.
NORMALIZED_OUTPUT_CHARS: Final = 4 * 1024
#: Bounds of a JSON Schema in a policy file.
MAX_SCHEMA_NODES: Final = 10_000
MAX_SCHEMA_DEPTH: Final = 32
#: Quantifiers beyond which a pattern is not analysed (too costly to be worth it at load).
MAX_ANALYSED_REPEATS: Final = 100
#: Errors a JSON Schema check looks at to pick the most relevant one.
_SCHEMA_ERRORS_CONSIDERED: Final = 8
_MAX_MESSAGE: Final = 200
_MAX_SHOWN_PATTERN: Final = 60

_REGEX: ModuleType | None
try:  # the `regex` package: same syntax as `re`, plus a time limit per search.
    _REGEX = importlib.import_module("regex")
except ImportError:  # pragma: no cover - depends on the environment
    _REGEX = None


def _jsonschema() -> Any:
    """The ``jsonschema`` package, imported on first use (only JSON Schema checks need it)."""
    try:
        return importlib.import_module("jsonschema")
    except ImportError:  # pragma: no cover - depends on the environment
        return None


# --------------------------------------------------------------------------- load-time checks

RegexFlag = Literal["ignorecase", "multiline", "dotall", "verbose", "ascii"]
_RE_FLAGS: Final[Mapping[str, int]] = {
    "ignorecase": re.IGNORECASE,
    "multiline": re.MULTILINE,
    "dotall": re.DOTALL,
    "verbose": re.VERBOSE,
    "ascii": re.ASCII,
}


def _re_flags(names: Iterable[str]) -> int:
    value = 0
    for name in names:
        value |= _RE_FLAGS[name]
    return value


def _show(pattern: str) -> str:
    return pattern if len(pattern) <= _MAX_SHOWN_PATTERN else pattern[:_MAX_SHOWN_PATTERN] + "..."


def _short(text: str, limit: int = _MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


Searcher = Callable[[str], bool]


def _compile_search(pattern: str, flags: Sequence[str]) -> tuple[Searcher, bool]:
    """A search function for ``pattern`` and whether it runs under a time limit.

    Raises what the engine raises for a bad pattern. ``TimeoutError`` from the
    returned function means the search was stopped at :data:`REGEX_TIMEOUT_S`.
    """
    engine = _REGEX
    if engine is not None:
        bits = 0
        for name in flags:
            bits |= int(getattr(engine, name.upper()))
        compiled: Any = engine.compile(pattern, bits)

        def search_limited(text: str) -> bool:
            return compiled.search(text, timeout=REGEX_TIMEOUT_S) is not None

        return search_limited, True
    plain = re.compile(pattern, _re_flags(flags))

    def search(text: str) -> bool:
        return plain.search(text) is not None

    return search, False


def check_verifier_regex(pattern: str, flags: Sequence[str] = ()) -> str:
    """Return ``pattern`` if it compiles and cannot backtrack badly, else raise ``ValueError``.

    The exponential shapes are rejected whatever the engine (see the module
    docstring); the polynomial ones only when no time limit will bound them.
    """
    if len(pattern) > MAX_REGEX_LEN:
        raise ValueError(f"regex longer than {MAX_REGEX_LEN} characters")
    try:
        _, limited = _compile_search(pattern, flags)
    except Exception as exc:  # re.error, regex.error (not a re.error), RecursionError...
        raise ValueError(f"bad regex {_show(pattern)!r}: {exc}") from None
    problem = backtracking_problem(pattern, _re_flags(flags), polynomial=not limited)
    if problem:
        raise ValueError(f"regex {_show(pattern)!r} {problem}")
    return pattern


# A parsed pattern is walked with Python's own regex parser (the tree ``re``
# compiles), so the analysis sees exactly the syntax the engine does.
_sre: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
_sc: Any = importlib.import_module(
    "re._constants" if sys.version_info >= (3, 11) else "sre_constants"
)
_LITERAL: Any = _sc.LITERAL
_NOT_LITERAL: Any = _sc.NOT_LITERAL
_ANY: Any = _sc.ANY
_IN: Any = _sc.IN
_RANGE: Any = _sc.RANGE
_CATEGORY: Any = _sc.CATEGORY
_NEGATE: Any = _sc.NEGATE
_BRANCH: Any = _sc.BRANCH
_SUBPATTERN: Any = _sc.SUBPATTERN
_REPEATS: Any = frozenset({_sc.MAX_REPEAT, _sc.MIN_REPEAT})
_POSSESSIVE: Any = getattr(_sc, "POSSESSIVE_REPEAT", None)
_ATOMIC: Any = getattr(_sc, "ATOMIC_GROUP", None)
_ASSERTS: Any = frozenset({_sc.ASSERT, _sc.ASSERT_NOT})
_GROUPREF: Any = _sc.GROUPREF
_GROUPREF_EXISTS: Any = _sc.GROUPREF_EXISTS
_MAXREPEAT: Any = _sc.MAXREPEAT
_CATEGORIES: Final[Mapping[Any, Callable[[str], bool]]] = {
    _sc.CATEGORY_DIGIT: str.isdecimal,
    _sc.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    _sc.CATEGORY_SPACE: str.isspace,
    _sc.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    _sc.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    _sc.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}
#: Characters tried besides ASCII and the pattern's own literals: non-ASCII
#: letters, digits and spaces, and characters that case-fold to ASCII.
_SAMPLES: Final = frozenset(
    {0xA0, 0xC9, 0xE9, 0x17F, 0x212A, 0x0663, 0x2028, 0x3000, 0x4E2D, 0x1F600}
)
_EXPONENTIAL = "can take exponential time on some inputs: "
_ATOMIC_HINT = "; remove the nesting, or make the inner part atomic, e.g. (?>a+)"

Node = tuple[Any, Any]


class _RegexShape:
    """The parts of a parsed pattern that decide how badly it can backtrack.

    Character sets are approximated on a finite sample of code points (ASCII,
    a few others, and every literal the pattern names): enough to tell ``\\d``
    from ``,`` or ``\\w`` from ``\\s``, which is what separates a safe nested
    repeat (``(\\d+,)*``) from a catastrophic one (``(\\d+)*``).
    """

    def __init__(self, parsed: Any) -> None:
        self.parsed = parsed
        self.ignorecase = bool(int(parsed.state.flags) & re.IGNORECASE)
        points: set[int] = set(range(128)) | _SAMPLES
        self.repeats = 0
        self._collect(parsed, points)
        if self.ignorecase:
            for point in list(points):
                for variant in (chr(point).lower(), chr(point).upper()):
                    if len(variant) == 1:
                        points.add(ord(variant))
        self.universe = frozenset(points)
        groups: dict[str, set[int]] = {}
        for point in points:
            groups.setdefault(chr(point).lower(), set()).add(point)
        self._fold = {p: frozenset(groups[chr(p).lower()]) for p in points}
        self._alphabets: dict[int, frozenset[int]] = {}
        self._minimums: dict[int, int] = {}

    def _collect(self, seq: Any, points: set[int]) -> None:
        for op, av in seq:
            if op is _LITERAL or op is _NOT_LITERAL:
                points.add(int(av))
            elif op is _IN:
                for item_op, item_av in av:
                    if item_op is _LITERAL:
                        points.add(int(item_av))
                    elif item_op is _RANGE:
                        points.update((int(item_av[0]), int(item_av[1])))
            elif op is _SUBPATTERN and int(av[1]) & re.IGNORECASE:
                self.ignorecase = True
            if op in _REPEATS or op is _POSSESSIVE:
                self.repeats += 1
            for child in self._children(op, av):
                self._collect(child, points)

    @staticmethod
    def _children(op: Any, av: Any) -> list[Any]:
        if op is _SUBPATTERN:
            return [av[3]]
        if op in _REPEATS or op is _POSSESSIVE:
            return [av[2]]
        if op is _BRANCH:
            return list(av[1])
        if op is _ATOMIC:
            return [av]
        if op in _ASSERTS:
            return [av[1]]
        if op is _GROUPREF_EXISTS:
            return [av[1]] if av[2] is None else [av[1], av[2]]
        return []

    # -- character sets and lengths

    def _folded(self, points: Iterable[int]) -> frozenset[int]:
        if not self.ignorecase:
            return frozenset(points)
        return frozenset(q for p in points for q in self._fold.get(p, (p,)))

    def _class(self, items: Any) -> frozenset[int]:
        negate = False
        members: set[int] = set()
        for op, av in items:
            if op is _NEGATE:
                negate = True
            elif op is _LITERAL:
                members.add(int(av))
            elif op is _RANGE:
                low, high = int(av[0]), int(av[1])
                members.update(p for p in self.universe if low <= p <= high)
            elif op is _CATEGORY and av in _CATEGORIES:
                test = _CATEGORIES[av]
                members.update(p for p in self.universe if test(chr(p)))
            else:
                members.update(self.universe)
        folded = self._folded(members)
        return self.universe - folded if negate else folded

    def node_alphabet(self, node: Node) -> frozenset[int]:
        """Every sampled character the node may consume."""
        op, av = node
        if op is _LITERAL:
            return self._folded((int(av),))
        if op is _NOT_LITERAL:
            return self.universe - self._folded((int(av),))
        if op is _IN:
            return self._class(av)
        if op in _ASSERTS or op is _sc.AT:
            return frozenset()
        children = self._children(op, av)
        if op is _ANY or op is _GROUPREF or not children:
            return self.universe
        result: frozenset[int] = frozenset()
        for child in children:
            result |= self.alphabet(child)
        return result

    def alphabet(self, seq: Any) -> frozenset[int]:
        key = id(seq)
        if key not in self._alphabets:
            result: frozenset[int] = frozenset()
            for node in seq:
                result |= self.node_alphabet(node)
            self._alphabets[key] = result
        return self._alphabets[key]

    def node_min(self, node: Node) -> int:
        """The fewest characters the node can match."""
        op, av = node
        if op in (_LITERAL, _NOT_LITERAL, _ANY, _IN):
            return 1
        if op is _SUBPATTERN:
            return self.min_len(av[3])
        if op is _ATOMIC:
            return self.min_len(av)
        if op in _REPEATS or op is _POSSESSIVE:
            return min(int(av[0]) * self.min_len(av[2]), 1 << 30)
        if op is _BRANCH:
            return min(self.min_len(b) for b in av[1])
        if op is _GROUPREF_EXISTS:
            return min(self.min_len(av[1]), 0 if av[2] is None else self.min_len(av[2]))
        return 0

    def min_len(self, seq: Any) -> int:
        key = id(seq)
        if key not in self._minimums:
            self._minimums[key] = min(sum(self.node_min(n) for n in seq), 1 << 30)
        return self._minimums[key]

    def first(self, seq: Any) -> tuple[frozenset[int], bool]:
        """Characters a match of ``seq`` may start with, and whether it may be empty."""
        found: set[int] = set()
        for node in seq:
            op, av = node
            if op is _SUBPATTERN:
                chars, nullable = self.first(av[3])
            elif op is _ATOMIC:
                chars, nullable = self.first(av)
            elif op in _REPEATS or op is _POSSESSIVE:
                chars, nullable = self.first(av[2])
                nullable = nullable or int(av[0]) == 0
            elif op is _BRANCH:
                firsts = [self.first(b) for b in av[1]]
                chars = frozenset().union(*(f for f, _ in firsts))
                nullable = any(n for _, n in firsts)
            else:
                chars, nullable = self.node_alphabet(node), self.node_min(node) == 0
            found |= chars
            if not nullable:
                return frozenset(found), False
        return frozenset(found), True

    # -- the shapes

    @staticmethod
    def flatten(seq: Any) -> list[Node]:
        """The nodes of ``seq`` with plain groups opened: ``(a+)b`` is ``a+ b``."""
        out: list[Node] = []
        for op, av in seq:
            if op is _SUBPATTERN:
                out.extend(_RegexShape.flatten(av[3]))
            else:
                out.append((op, av))
        return out

    def _variable_repeats(self, seq: Any, out: list[Any]) -> list[Any]:
        """Bodies of the repeats inside ``seq`` that can backtrack over a varying count."""
        for op, av in seq:
            if op in _REPEATS:
                if av[1] == _MAXREPEAT or int(av[1]) > int(av[0]):
                    out.append(av[2])
                self._variable_repeats(av[2], out)
            elif op is _SUBPATTERN:
                self._variable_repeats(av[3], out)
            elif op is _BRANCH:
                for branch in av[1]:
                    self._variable_repeats(branch, out)
            elif op is _GROUPREF_EXISTS:
                for child in self._children(op, av):
                    self._variable_repeats(child, out)
        return out

    def _ambiguous(self, branches: Any) -> bool:
        """Two alternatives can both be empty or start with the same character."""
        nullables = 0
        total = 0
        union: set[int] = set()
        for branch in branches:
            chars, nullable = self.first(branch)
            nullables += nullable
            total += len(chars)
            union |= chars
        return nullables > 1 or total != len(union)

    def repeated_body_problem(self, body: Any) -> str | None:
        """Why repeating ``body`` can backtrack exponentially, or None."""
        if self.min_len(body) == 0:
            return _EXPONENTIAL + "it repeats a part that can match the empty string"
        items = self.flatten(body)
        mandatory = [self.node_alphabet(n) for n in items if self.node_min(n) > 0]
        for inner in self._variable_repeats(body, []):
            chars = self.alphabet(inner)
            # A mandatory part the inner repeat cannot consume fixes where each
            # round ends; without one, the rounds can split the text many ways.
            if not any(chars.isdisjoint(m) for m in mandatory):
                return (
                    _EXPONENTIAL + "a repeated group contains a part that repeats over"
                    " the same characters" + _ATOMIC_HINT
                )
        for op, av in items:
            if op is _BRANCH and self._ambiguous(av[1]):
                return _EXPONENTIAL + "it repeats alternatives that can match the same text"
        return None

    def exponential(self, seq: Any) -> str | None:
        for op, av in seq:
            if op in _REPEATS and (av[1] == _MAXREPEAT or int(av[1]) >= 2):
                problem = self.repeated_body_problem(av[2])
                if problem:
                    return problem
            for child in self._children(op, av):
                problem = self.exponential(child)
                if problem:
                    return problem
        return None

    def _separated(self, body: Any, chars: frozenset[int]) -> bool:
        """Every round of ``body`` consumes a character outside ``chars``."""
        return any(
            self.node_min(n) > 0 and chars.isdisjoint(self.node_alphabet(n))
            for n in self.flatten(body)
        )

    def _trade(self, first: Any, second: Any) -> bool:
        """Two repeats in a row can hand each other long stretches of text.

        Not when they share no character, nor when one's every round needs a
        character the other cannot take (``\\w+(\\.\\w+)*``): then they can
        only trade within one round.
        """
        first_chars, second_chars = self.alphabet(first), self.alphabet(second)
        return not (
            first_chars.isdisjoint(second_chars)
            or self._separated(first, second_chars)
            or self._separated(second, first_chars)
        )

    def polynomial(self, seq: Any, top: bool) -> str | None:
        """Two unbounded repeats in a row over shared characters (``a.*b.*c``)."""
        items = self.flatten(seq)
        for i, (op, av) in enumerate(items):
            if op not in _REPEATS or av[1] != _MAXREPEAT:
                continue
            chars = self.alphabet(av[2])
            for j in range(i + 1, len(items)):
                other_op, other_av = items[j]
                if other_op in _REPEATS and other_av[1] == _MAXREPEAT:
                    trailing = top and j == len(items) - 1  # always succeeds: no retrying
                    if not trailing and self._trade(av[2], other_av[2]):
                        return (
                            "can take polynomial time on long outputs: two repeated parts"
                            " in a row can match the same characters; separate them with"
                            " a character the first cannot match (the `regex` package's"
                            " time limit lifts this check)"
                        )
                if self.node_min(items[j]) > 0 and chars.isdisjoint(self.node_alphabet(items[j])):
                    break  # a separator: later repeats cannot trade text with this one
        for op, av in items:
            for child in self._children(op, av):
                problem = self.polynomial(child, top=False)
                if problem:
                    return problem
        return None


def backtracking_problem(pattern: str, flags: int = 0, *, polynomial: bool = True) -> str | None:
    """Why ``pattern`` can make a backtracking engine slow, or None if it looks safe.

    A static heuristic, so it errs both ways on rare shapes: it rejects the
    textbook catastrophes (a repeat inside a repeat over the same characters,
    a repeated part that can be empty, repeated overlapping alternatives) and,
    with ``polynomial``, two unbounded repeats in a row over shared characters.
    Atomic groups and possessive quantifiers are trusted. A pattern Python's
    parser cannot read (``regex``-only syntax) is left to the time limit.
    """
    try:
        parsed = _sre.parse(pattern, flags)
    except (re.error, RecursionError, OverflowError, ValueError, TypeError):
        return None
    try:
        shape = _RegexShape(parsed)
        if shape.repeats > MAX_ANALYSED_REPEATS:
            if not polynomial:
                return None
            return (
                f"has more than {MAX_ANALYSED_REPEATS} quantifiers: too many to check"
                " for slow backtracking"
            )
        problem = shape.exponential(parsed)
        if problem is None and polynomial:
            problem = shape.polynomial(parsed, top=True)
    except RecursionError:
        return "nests too deeply to check for slow backtracking"
    return problem


_DATA_KEYWORDS: Final = frozenset({"const", "enum", "examples", "default"})


def _schema_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$]*", key) else f"{path}[{key!r}]"


def _walk_schema(schema: Mapping[str, Any]) -> None:
    """Check that a schema is plain, bounded JSON that needs nothing from outside.

    Remote ``$ref`` are refused: the sidecar never fetches a schema. ``pattern``
    and ``patternProperties`` are run by jsonschema with ``re`` (no time limit),
    so they get the full backtracking check.
    """
    stack: list[tuple[object, str, int, bool]] = [(schema, "$", 0, False)]
    nodes = 0
    while stack:
        value, path, depth, data = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"JSON Schema has more than {MAX_SCHEMA_NODES} values")
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} at {path}")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"JSON Schema key {key!r} at {path} is not a string")
                here = _schema_path(path, key)
                if not data:
                    _check_keyword(key, item, here)
                stack.append((item, here, depth + 1, data or key in _DATA_KEYWORDS))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                stack.append((item, _schema_path(path, index), depth + 1, data))
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"JSON Schema value at {path} is not a finite number")
        elif not (value is None or isinstance(value, (str, int, bool))):
            raise ValueError(
                f"JSON Schema value at {path} is a {type(value).__name__}, not JSON"
                " (quote dates and times)"
            )


def _check_keyword(key: str, item: object, path: str) -> None:
    if key in ("$ref", "$dynamicRef") and isinstance(item, str) and not item.startswith("#"):
        raise ValueError(
            f"JSON Schema {key} {item!r} at {path} is not local: only references"
            " inside the schema ('#/$defs/...') are allowed"
        )
    patterns: list[str] = []
    if key == "pattern" and isinstance(item, str):
        patterns.append(item)
    elif key == "patternProperties" and isinstance(item, dict):
        patterns.extend(k for k in item if isinstance(k, str))
    for pattern in patterns:
        if len(pattern) > MAX_REGEX_LEN:
            raise ValueError(f"JSON Schema regex at {path} is longer than {MAX_REGEX_LEN}")
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError, ValueError) as exc:
            raise ValueError(f"JSON Schema regex {_show(pattern)!r} at {path}: {exc}") from None
        problem = backtracking_problem(pattern, 0, polynomial=True)
        if problem:
            raise ValueError(f"JSON Schema regex {_show(pattern)!r} at {path} {problem}")


_PROBES: Final[tuple[object, ...]] = (None, True, 0, 0.5, "", [], {})


def _schema_validator(schema: Mapping[str, Any]) -> Any:
    """A validator for ``schema`` (its declared draft, else 2020-12), or raise ``ValueError``."""
    jsonschema = _jsonschema()
    if jsonschema is None:
        raise ValueError(
            "output_json_schema needs the jsonschema package (pip install 'jsonschema>=4.18')"
        )
    validators: Any = jsonschema.validators
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        raise ValueError("JSON Schema $schema must be a string")
    cls: Any = validators.validator_for(schema, default=None)
    if cls is None:
        if declared is not None:
            raise ValueError(f"JSON Schema $schema {_short(declared, 80)!r} is not a known draft")
        cls = jsonschema.Draft202012Validator
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(
            f"invalid JSON Schema at {exc.json_path}: {_short(str(exc.message))}"
        ) from None
    try:  # a schema that refers to itself without end fails on anything: say so now
        fast: Any = validators.extend(cls, {"uniqueItems": _unique_items})
        validator: Any = fast(schema)
        for probe in _PROBES:
            for _ in islice(validator.iter_errors(probe), 1):
                pass
    except RecursionError:
        raise ValueError("JSON Schema refers to itself without end ($ref loop)") from None
    except Exception as exc:
        raise ValueError(f"JSON Schema cannot be used: {_short(str(exc))}") from None
    return validator


def _equality_key(value: object) -> object:
    """A hashable key equal for JSON values JSON Schema calls equal (``1`` and ``1.0``)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, (int, float)):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("l", tuple(_equality_key(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, _equality_key(v)) for k, v in value.items()))
    return ("z", None)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``uniqueItems`` in O(n): jsonschema's own compares every pair of unhashable items."""
    if unique is True and isinstance(instance, list) and len(instance) > 1:
        keys = {_equality_key(item) for item in instance}
        if len(keys) != len(instance):
            error: Any = _jsonschema().ValidationError
            yield error(f"{_short(repr(instance), 80)} has non-unique elements")


# --------------------------------------------------------------------------- the spec models


def _true_only(value: bool) -> bool:
    if value is not True:
        raise ValueError("set it to true or leave it out: false checks nothing")
    return value


def _check_key(value: str) -> str:
    if value.strip() != value:
        raise ValueError(f"attribute key {value!r} has surrounding spaces")
    return value


def _check_schema_dict(value: dict[str, Any]) -> dict[str, Any]:
    _walk_schema(value)
    _schema_validator(value)
    return value


def _number(value: object) -> int | float:
    """A bound as written (``8000`` stays an int, so messages say 8000, not 8000.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a bound must be a number, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a bound must be a finite number")
    return value


TrueOnly = Annotated[bool, AfterValidator(_true_only)]
Number = int | float
Bound = Annotated[Number, PlainValidator(_number, json_schema_input_type=float)]


class VerifierMatch(_Strict):
    """Which spans a verifier looks at: all given conditions must hold; none means every span."""

    service: Globs | None = None
    role: Roles | None = None
    span_name: Globs | None = None


class OutputRegexSpec(_Strict):
    """A regex searched in the span's output."""

    # Declared before ``pattern`` so the pattern's validator can compile with them.
    flags: Annotated[list[RegexFlag], _list_of(str), Field(max_length=5)] = Field(
        default_factory=list
    )
    pattern: Annotated[str, Field(min_length=1)]
    must_match: bool = Field(
        default=True, description="true: the output must match; false: it must not."
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str, info: ValidationInfo) -> str:
        flags: list[str] = info.data.get("flags", [])
        return check_verifier_regex(value, flags)


class AttributeRangeSpec(_Strict):
    """A numeric span attribute within [min, max] (either bound may be left out)."""

    key: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_check_key)]
    min: Bound | None = None
    max: Bound | None = None
    required: bool = Field(default=False, description="A missing attribute fails the check.")

    @model_validator(mode="after")
    def _coherent(self) -> AttributeRangeSpec:
        if self.min is None and self.max is None:
            raise ValueError("attribute_range needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"attribute_range min ({self.min}) is above max ({self.max})")
        return self


JsonSchemaDict = Annotated[dict[str, Any], AfterValidator(_check_schema_dict)]

#: The checks a verifier may have, exactly one per verifier.
CHECKS: Final = (
    "output_empty",
    "output_regex",
    "output_json",
    "output_json_schema",
    "attribute_range",
    "final_answer_empty",
)
_FINAL_ROLES: Final = frozenset({Role.AGENT, Role.CHAIN})


class VerifierSpec(_Strict):
    """One semantic verifier: spans it looks at, and the one check their output must pass."""

    name: Name
    description: Description | None = None
    match: VerifierMatch = Field(default_factory=VerifierMatch)
    output_empty: TrueOnly | None = Field(default=None, description="Fails on an empty output.")
    output_regex: OutputRegexSpec | None = None
    output_json: TrueOnly | None = Field(
        default=None, description="Fails when the output is not JSON."
    )
    output_json_schema: JsonSchemaDict | None = Field(
        default=None, description="Fails when the output is not JSON valid under this schema."
    )
    attribute_range: AttributeRangeSpec | None = None
    final_answer_empty: TrueOnly | None = Field(
        default=None,
        description="Fails when a run's root agent/chain span ends with an empty output.",
    )

    @model_validator(mode="after")
    def _one_check(self) -> VerifierSpec:
        found = [name for name in CHECKS if getattr(self, name) is not None]
        if len(found) != 1:
            what = "none" if not found else " and ".join(found)
            raise ValueError(
                f"verifier {self.name!r} needs exactly one check among {', '.join(CHECKS)};"
                f" found {what}"
            )
        roles = self.match.role
        if self.final_answer_empty and roles and not _FINAL_ROLES & {Role(r) for r in roles}:
            raise ValueError(
                f"final_answer_empty looks at root agent or chain spans; match.role {roles}"
                " leaves none"
            )
        return self

    @property
    def check(self) -> str:
        """The name of this verifier's check."""
        return next(name for name in CHECKS if getattr(self, name) is not None)


def _unique_names(specs: list[VerifierSpec]) -> list[VerifierSpec]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two verifiers are named {spec.name!r}")
        seen.add(spec.name)
    return specs


#: A policy file's ``verifiers:`` list (names unique).
Verifiers = Annotated[
    list[VerifierSpec], Field(max_length=MAX_VERIFIERS), AfterValidator(_unique_names)
]


# --------------------------------------------------------------------------- compiled form


@dataclass(frozen=True, slots=True)
class VerificationFailure:
    """A verifier's verdict on one span: it failed, and why (one short line)."""

    verifier: str
    message: str


@dataclass(frozen=True, slots=True)
class VerifierError:
    """A verifier could not judge a span (timeout, oversized output...): reported once per cause."""

    verifier: str
    message: str


class _Unjudged(Exception):
    """Raised by a check that cannot judge this span; ``key`` names the cause for reporting once."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


Check = Callable[[SpanRecord], "str | None"]


def _is_blank(text: str) -> bool:
    return not text or text.isspace()


def _output_empty(record: SpanRecord) -> str | None:
    return "output is empty" if _is_blank(record.output_text) else None


def _final_answer_empty(record: SpanRecord) -> str | None:
    return "final answer is empty" if _is_blank(record.output_text) else None


class _OutputRegex:
    __slots__ = ("cut_at", "limit", "must_match", "search", "shown", "timed")

    def __init__(self, spec: OutputRegexSpec, cut_at: int | None) -> None:
        self.search, self.timed = _compile_search(spec.pattern, spec.flags)
        self.limit = MAX_REGEX_CHARS if self.timed else MAX_REGEX_CHARS_NO_TIMEOUT
        self.must_match = spec.must_match
        self.shown = _show(spec.pattern)
        self.cut_at = cut_at

    def __call__(self, record: SpanRecord) -> str | None:
        text = record.output_text
        checked = text if len(text) <= self.limit else text[: self.limit]
        try:
            found = self.search(checked)
        except TimeoutError:
            raise _Unjudged(
                "timeout",
                f"regex /{self.shown}/ timed out after {REGEX_TIMEOUT_S * 1000:.0f} ms on a"
                f" {len(checked)}-character output; the span was not judged",
            ) from None
        if found is not self.must_match:
            if found:
                return f"output matches /{self.shown}/"
            cut = len(text) > self.limit or (self.cut_at is not None and len(text) >= self.cut_at)
            if cut:
                raise _Unjudged(
                    "cut",
                    f"/{self.shown}/ was not found in an output that may go on past"
                    f" {len(checked)} characters; such outputs are not judged",
                )
            return f"output does not match /{self.shown}/"
        return None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class _OutputJson:
    __slots__ = ("cut_at", "validator")

    def __init__(self, validator: Any, cut_at: int | None) -> None:
        self.validator = validator
        self.cut_at = cut_at

    def parse(self, text: str) -> tuple[object, str | None]:
        """The document, or the reason the text is not JSON."""
        if len(text) > MAX_JSON_CHARS:
            raise _Unjudged(
                "too_long", f"an output over {MAX_JSON_CHARS} characters was not parsed as JSON"
            )
        try:
            return orjson.loads(text), None
        except orjson.JSONDecodeError as exc:
            ended_early = "end of data" in exc.msg or "EOF" in exc.msg
        if ended_early and self.cut_at is not None and len(text) >= self.cut_at:
            raise _Unjudged(
                "cut", f"JSON output cut at {len(text)} characters by normalization; not judged"
            )
        # orjson refuses some valid JSON (integers over 64 bits); json has the
        # clearer message ("Expecting value") when the text really is not JSON.
        try:
            return json.loads(text, parse_constant=_no_constant), None
        except json.JSONDecodeError as exc:
            return None, f"output is not JSON: {exc.msg} at {exc.lineno}:{exc.colno}"
        except ValueError as exc:
            return None, f"output is not JSON: {_short(str(exc), 80)}"
        except RecursionError:
            raise _Unjudged("too_deep", "an output nests too deeply to parse") from None

    def __call__(self, record: SpanRecord) -> str | None:
        document, problem = self.parse(record.output_text)
        if problem is not None or self.validator is None:
            return problem
        try:
            errors = list(islice(self.validator.iter_errors(document), _SCHEMA_ERRORS_CONSIDERED))
        except RecursionError:
            raise _Unjudged("too_deep", "an output nests too deeply to check") from None
        if not errors:
            return None
        best: Any = _jsonschema().exceptions.best_match(errors)
        return f"output fails the JSON Schema at {best.json_path}: {_short(str(best.message), 120)}"


def _as_number(value: AttrValue) -> Number | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return None if isinstance(value, float) and math.isnan(value) else value
    if isinstance(value, str) and 0 < len(value) <= 64:
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
        return None if math.isnan(number) else number
    return None


def _shown_value(value: AttrValue) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _short(repr(value), 60)


class _AttributeRange:
    __slots__ = ("high", "key", "low", "required")

    def __init__(self, spec: AttributeRangeSpec) -> None:
        self.key = spec.key
        self.low = spec.min
        self.high = spec.max
        self.required = spec.required

    def __call__(self, record: SpanRecord) -> str | None:
        value = record.attributes.get(self.key)
        if value is None:
            return f"attribute {self.key} is missing" if self.required else None
        number = _as_number(value)
        if number is None:
            return f"attribute {self.key} = {_shown_value(value)} is not a number"
        if self.low is not None and number < self.low:
            return f"attribute {self.key} = {_shown_value(value)} is below {self.low}"
        if self.high is not None and number > self.high:
            return f"attribute {self.key} = {_shown_value(value)} is above {self.high}"
        return None


class _Verifier:
    """One compiled verifier: its selector, its check, and what it has already reported."""

    __slots__ = (
        "check",
        "name",
        "on_error",
        "reported",
        "roles",
        "root_only",
        "service",
        "span_name",
        "timeouts",
    )

    def __init__(
        self,
        spec: VerifierSpec,
        check: Check,
        on_error: Callable[[VerifierError], None],
    ) -> None:
        self.name = spec.name
        self.check = check
        self.on_error = on_error
        self.service = GlobSet(spec.match.service) if spec.match.service else None
        self.span_name = GlobSet(spec.match.span_name) if spec.match.span_name else None
        roles = frozenset(Role(r) for r in spec.match.role) if spec.match.role else frozenset(Role)
        self.root_only = spec.final_answer_empty is True
        self.roles = roles & _FINAL_ROLES if self.root_only else roles
        self.reported: set[str] = set()
        self.timeouts = 0

    def report(self, key: str, message: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            self.on_error(VerifierError(self.name, message))

    def run(self, record: SpanRecord) -> str | None:
        try:
            return self.check(record)
        except _Unjudged as unjudged:
            self.report(unjudged.key, unjudged.message)
            if unjudged.key == "timeout":
                self.timeouts += 1
                if self.timeouts >= MAX_TIMEOUTS:
                    self.report(
                        "disabled",
                        f"switched off after {MAX_TIMEOUTS} regex timeouts until the policy"
                        " is reloaded",
                    )
        except Exception as exc:  # a verifier must never take the pipeline down
            self.report(
                f"crash:{type(exc).__name__}",
                f"check failed with {type(exc).__name__}: {_short(str(exc), 120)}",
            )
        return None

    @property
    def disabled(self) -> bool:
        return self.timeouts >= MAX_TIMEOUTS


_MAX_CACHED_SERVICES: Final = 1024
_NONE: Final[tuple[_Verifier, ...]] = ()


def _log_error(error: VerifierError) -> None:
    log.warning("verifier %s: %s", error.verifier, error.message)


class VerifierSet:
    """Compiled verifiers, indexed by service and role so unconcerned spans cost a lookup.

    ``check`` runs on every normalized span: the verifiers that apply to a
    (service, role) pair are resolved once and cached, so a span that no
    verifier selects costs two dict lookups.
    """

    __slots__ = ("_by_service", "_on_error", "_verifiers", "errors")

    def __init__(
        self,
        checks: Sequence[tuple[VerifierSpec, Check]] = (),
        on_error: Callable[[VerifierError], None] | None = None,
    ) -> None:
        self._on_error = on_error or _log_error
        self._verifiers = tuple(_Verifier(spec, check, self._report) for spec, check in checks)
        self._by_service: dict[str, Mapping[Role, tuple[_Verifier, ...]]] = {}
        #: Every error reported so far (bounded: once per verifier and cause).
        self.errors: list[VerifierError] = []

    def _report(self, error: VerifierError) -> None:
        self.errors.append(error)
        self._on_error(error)

    def __len__(self) -> int:
        return len(self._verifiers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self._verifiers)

    def _for(self, service: str, role: Role) -> tuple[_Verifier, ...]:
        by_role = self._by_service.get(service)
        if by_role is None:
            applicable = [v for v in self._verifiers if v.service is None or v.service(service)]
            by_role = {r: tuple(v for v in applicable if r in v.roles) for r in Role}
            if len(self._by_service) >= _MAX_CACHED_SERVICES:
                self._by_service.clear()
            self._by_service[service] = by_role
        return by_role.get(role, _NONE)

    def wants(self, service: str, role: Role, span_name: str) -> bool:
        """Whether any verifier may look at such a span (final-answer ones also need a root)."""
        if not self._verifiers:
            return False
        return any(v.span_name is None or v.span_name(span_name) for v in self._for(service, role))

    def check(self, record: SpanRecord) -> list[VerificationFailure]:
        """The verifiers that fail on ``record``, in policy order; ``[]`` when all pass.

        Spans with error evidence are skipped (the rules classify them), and a
        check that cannot judge a span reports a :class:`VerifierError` once
        instead of raising.
        """
        if not self._verifiers or record.error is not None:
            return []
        candidates = self._for(record.service, record.role)
        if not candidates:
            return []
        failures: list[VerificationFailure] = []
        for verifier in candidates:
            if verifier.span_name is not None and not verifier.span_name(record.name):
                continue
            if verifier.root_only and record.parent_span_id:
                continue
            if verifier.timeouts >= MAX_TIMEOUTS:
                continue
            message = verifier.run(record)
            if message is not None:
                failures.append(VerificationFailure(verifier.name, message))
        return failures


def compile_verifiers(
    specs: Iterable[VerifierSpec],
    *,
    on_error: Callable[[VerifierError], None] | None = None,
    output_cut_at: int | None = NORMALIZED_OUTPUT_CHARS,
) -> VerifierSet:
    """Compile validated specs into a :class:`VerifierSet`.

    ``on_error`` receives each :class:`VerifierError` once (default: a log
    warning); the set also keeps them in ``errors``. ``output_cut_at`` is the
    length at which outputs may have been cut upstream (``None``: never).
    """
    checks: list[tuple[VerifierSpec, Check]] = []
    for spec in specs:
        check: Check
        if spec.output_empty:
            check = _output_empty
        elif spec.final_answer_empty:
            check = _final_answer_empty
        elif spec.output_regex is not None:
            check = _OutputRegex(spec.output_regex, output_cut_at)
        elif spec.output_json:
            check = _OutputJson(None, output_cut_at)
        elif spec.output_json_schema is not None:
            check = _OutputJson(_schema_validator(spec.output_json_schema), output_cut_at)
        elif spec.attribute_range is not None:
            check = _AttributeRange(spec.attribute_range)
        else:  # pragma: no cover - VerifierSpec guarantees one check
            raise ValueError(f"verifier {spec.name!r} has no check")
        checks.append((spec, check))
    return VerifierSet(checks, on_error)
