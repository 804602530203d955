"""Classification predicates: small callables compiled once from a rule's ``match``.

A classify call builds one :class:`Subject` (the facts rules look at, computed
once per span) and runs each rule's conditions in order of cost: flags and
integer set lookups before globs, globs before attributes, regexes last. A
condition is a tiny object with ``__call__(subject) -> bool``; nothing reads
raw YAML on the hot path.

Regexes are :class:`policies._regex.PolicyRegex`: each search is bounded in
time, and one that hits the limit counts as no match (counted on the pattern,
logged once), so a crafted message costs one slow span, never a stalled loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Protocol

from policies._glob import GlobSet
from policies._regex import PolicyRegex
from supervisor.records import AttrValue, ErrorEvidence, Role, SpanRecord

#: Free text is searched only this far: span content is untrusted, and the
#: time limit of a search should only ever stop a pathological pattern.
MAX_TEXT_CHARS: Final = 8192


#: Bits of :attr:`Subject.missing`: which pieces of evidence a span lacks. A rule
#: whose conditions need a missing piece is skipped with one integer test.
NEEDS_PROVIDER_CODE: Final = 1
NEEDS_HTTP_STATUS: Final = 2
NEEDS_GRPC_CODE: Final = 4
NEEDS_FINISH_REASON: Final = 8
NEEDS_EXCEPTION_TYPE: Final = 16
NEEDS_ERROR_TYPE: Final = 32
NEEDS_TEXT: Final = 64
NEEDS_INVALID_TOOL_CALLS: Final = 128
NEEDS_SWALLOWED: Final = 256


class Subject:
    """The facts about one failing span that rules match on, computed once."""

    __slots__ = (
        "error",
        "error_last",
        "error_type",
        "exc_last",
        "exc_type",
        "finish_reasons",
        "folded_text",
        "missing",
        "record",
        "text",
    )

    def __init__(self, record: SpanRecord, evidence: ErrorEvidence) -> None:
        self.record = record
        self.error = evidence
        self.exc_type = evidence.exception_type
        self.exc_last = evidence.exception_type.rpartition(".")[2]
        self.error_type = evidence.error_type
        self.error_last = evidence.error_type.rpartition(".")[2]
        self.finish_reasons = tuple(r.lower() for r in evidence.finish_reasons)
        self.text = evidence.text()[:MAX_TEXT_CHARS]
        self.folded_text = self.text.casefold()
        missing = 0
        if not evidence.provider_code:
            missing |= NEEDS_PROVIDER_CODE
        if evidence.http_status is None:
            missing |= NEEDS_HTTP_STATUS
        if evidence.grpc_code is None:
            missing |= NEEDS_GRPC_CODE
        if not evidence.finish_reasons:
            missing |= NEEDS_FINISH_REASON
        if not evidence.exception_type:
            missing |= NEEDS_EXCEPTION_TYPE
        if not evidence.error_type:
            missing |= NEEDS_ERROR_TYPE
        if not self.text:
            missing |= NEEDS_TEXT
        if not evidence.invalid_tool_calls:
            missing |= NEEDS_INVALID_TOOL_CALLS
        if not evidence.swallowed:
            missing |= NEEDS_SWALLOWED
        self.missing = missing


class Condition(Protocol):
    """One test of a rule; ``cost`` orders the tests of a rule, cheapest first.

    ``needs`` names the evidence (``NEEDS_*`` bits) without which it cannot hold.
    """

    cost: int
    needs: int

    def __call__(self, subject: Subject, /) -> bool: ...


class Swallowed:
    __slots__ = ("expected", "needs")
    cost = 0

    def __init__(self, expected: bool) -> None:
        self.expected = expected
        self.needs = NEEDS_SWALLOWED if expected else 0

    def __call__(self, s: Subject) -> bool:
        return s.error.swallowed is self.expected


class InvalidToolCall:
    __slots__ = ("expected", "needs")
    cost = 0

    def __init__(self, expected: bool) -> None:
        self.expected = expected
        self.needs = NEEDS_INVALID_TOOL_CALLS if expected else 0

    def __call__(self, s: Subject) -> bool:
        return bool(s.error.invalid_tool_calls) is self.expected


class HttpStatusIn:
    __slots__ = ("codes",)
    cost = 1
    needs = NEEDS_HTTP_STATUS

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.codes = frozenset(c for lo, hi in ranges for c in range(lo, hi + 1))

    def __call__(self, s: Subject) -> bool:
        return s.error.http_status in self.codes


class GrpcCodeIn:
    __slots__ = ("codes",)
    cost = 1
    needs = NEEDS_GRPC_CODE

    def __init__(self, codes: list[int]) -> None:
        self.codes = frozenset(codes)

    def __call__(self, s: Subject) -> bool:
        return s.error.grpc_code in self.codes


class RoleIn:
    __slots__ = ("roles",)
    cost = 1
    needs = 0

    def __init__(self, roles: list[str]) -> None:
        self.roles = frozenset(Role(r) for r in roles)

    def __call__(self, s: Subject) -> bool:
        return s.record.role in self.roles


class ProviderCode:
    __slots__ = ("globs",)
    cost = 2
    needs = NEEDS_PROVIDER_CODE

    def __init__(self, patterns: list[str]) -> None:
        self.globs = GlobSet(patterns)

    def __call__(self, s: Subject) -> bool:
        code = s.error.provider_code
        return bool(code) and self.globs(code)


class FinishReason:
    __slots__ = ("reasons",)
    cost = 2
    needs = NEEDS_FINISH_REASON

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = frozenset(r.lower() for r in reasons)

    def __call__(self, s: Subject) -> bool:
        return any(r in self.reasons for r in s.finish_reasons)


class ExceptionType:
    """Globs on the full dotted type name or its last component."""

    __slots__ = ("globs",)
    cost = 3
    needs = NEEDS_EXCEPTION_TYPE

    def __init__(self, patterns: list[str]) -> None:
        self.globs = GlobSet(patterns)

    def __call__(self, s: Subject) -> bool:
        if not s.exc_type:
            return False
        return self.globs(s.exc_type) or (s.exc_last != s.exc_type and self.globs(s.exc_last))


class ErrorType:
    """Globs on ``error.type``, full or last dotted component."""

    __slots__ = ("globs",)
    cost = 3
    needs = NEEDS_ERROR_TYPE

    def __init__(self, patterns: list[str]) -> None:
        self.globs = GlobSet(patterns)

    def __call__(self, s: Subject) -> bool:
        if not s.error_type:
            return False
        return self.globs(s.error_type) or (
            s.error_last != s.error_type and self.globs(s.error_last)
        )


class RecordGlob:
    """Globs on one string field of the record (service, dependency, span name)."""

    __slots__ = ("get", "globs")
    cost = 3
    needs = 0

    def __init__(self, get: Callable[[SpanRecord], str], patterns: list[str]) -> None:
        self.get = get
        self.globs = GlobSet(patterns)

    def __call__(self, s: Subject) -> bool:
        return self.globs(self.get(s.record))


class Attributes:
    """Every listed attribute is present and equal (or, for ``{regex}``, matches)."""

    __slots__ = ("tests",)
    cost = 4
    needs = 0

    def __init__(
        self,
        conditions: Mapping[str, tuple[str, str | int | float | bool]],
        rule: str = "",
    ) -> None:
        tests: list[tuple[str, Callable[[AttrValue], bool]]] = []
        for key, (how, expected) in conditions.items():
            if how == "regex":
                label = _label(rule, f"attribute {key}")
                tests.append((key, _regex_test(PolicyRegex(str(expected), label=label))))
            else:
                tests.append((key, _equal_test(expected)))
        self.tests = tuple(tests)

    def __call__(self, s: Subject) -> bool:
        attributes = s.record.attributes
        for key, test in self.tests:
            if key not in attributes or not test(attributes[key]):
                return False
        return True


def _label(rule: str, what: str) -> str:
    """Where a pattern comes from, for the line its first timeout logs."""
    return f"rule {rule} {what}" if rule else f"rule {what}"


def _equal_test(expected: str | int | float | bool) -> Callable[[AttrValue], bool]:
    # ``True == 1`` in Python; an attribute test must not confuse them.
    is_bool = isinstance(expected, bool)

    def test(value: AttrValue) -> bool:
        return isinstance(value, bool) is is_bool and value == expected

    return test


def _regex_test(pattern: PolicyRegex) -> Callable[[AttrValue], bool]:
    def test(value: AttrValue) -> bool:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return False
        return pattern.matches(str(value)[:MAX_TEXT_CHARS])

    return test


_IGNORECASE: Final = "(?i)"


class Message:
    """Regexes searched in the exception and status messages (bounded in length and time).

    A pattern is searched only when the text holds the literal start of one of
    its top-level alternatives (:func:`literal_prefixes`, compared case-folded
    under a leading ``(?i)``): most messages hold none of a rule's words, and a
    substring test costs far less than a search, whose engine would try an
    alternation of different words at every character.
    """

    __slots__ = ("tests",)
    cost = 5
    needs = NEEDS_TEXT

    def __init__(self, patterns: list[str], rule: str = "") -> None:
        label = _label(rule, "message")
        tests: list[tuple[bool, tuple[str, ...] | None, PolicyRegex]] = []
        for pattern in patterns:
            caseless = pattern.startswith(_IGNORECASE)
            prefixes = literal_prefixes(pattern.removeprefix(_IGNORECASE))
            if caseless and prefixes is not None:
                prefixes = tuple(prefix.casefold() for prefix in prefixes)
            tests.append((caseless, prefixes, PolicyRegex(pattern, label=label)))
        self.tests = tuple(tests)

    def __call__(self, s: Subject) -> bool:
        if not s.text:
            return False
        for caseless, prefixes, pattern in self.tests:
            if prefixes is not None:
                haystack = s.folded_text if caseless else s.text
                if not any(prefix in haystack for prefix in prefixes):
                    continue
            if pattern.matches(s.text):
                return True
        return False


_META: Final = frozenset("\\.^$*+?{}[]()|")
_QUANTIFIERS: Final = frozenset("?*{")
_MIN_PREFIX: Final = 3


def literal_prefixes(pattern: str) -> tuple[str, ...] | None:
    """The literal each top-level alternative must start with, or None when one has none.

    A match of the pattern contains one of these strings, so a text without
    any of them cannot match.
    """
    alternatives: list[str] = []
    depth = 0
    in_class = False
    start = 0
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
            if pattern[i + 1 : i + 2] == "]":
                i += 1
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            alternatives.append(pattern[start:i])
            start = i + 1
        i += 1
    alternatives.append(pattern[start:])
    prefixes: list[str] = []
    for alternative in alternatives:
        end = 0
        while end < len(alternative) and alternative[end] not in _META:
            end += 1
        if alternative[end : end + 1] in _QUANTIFIERS and end < len(alternative):
            end -= 1  # the last literal is optional or repeated
        if end < _MIN_PREFIX:
            return None
        prefixes.append(alternative[:end])
    return tuple(prefixes)
