"""The checks a verifier runs on one span's output, each bounded on untrusted content.

Whether an output was recorded, and whether it is empty, are the record's
(:attr:`SpanRecord.output_recorded`, :attr:`SpanRecord.says_nothing`): a check
asks them, and never takes an output that was not recorded for an empty one.

A check returns why the span fails (one short line) or None, and raises
:class:`Unjudged` when it cannot judge this span: an output too long to parse,
one the normalizer may have cut, a regex search stopped at its time limit.
:mod:`policies._verifiers` reports those once per cause.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Final

import orjson

from policies._json_schema import OutputSchema
from policies._regex import REGEX_TIMEOUT_S, PolicyRegex
from policies._schema_verifiers import AttributeRangeSpec, Number, OutputRegexSpec, VerifierSpec
from policies._text import short
from supervisor.records import AttrValue, SpanRecord

__all__ = [
    "EMPTINESS_CHECKS",
    "MAX_JSON_CHARS",
    "MAX_REGEX_CHARS",
    "NORMALIZED_OUTPUT_CHARS",
    "Check",
    "Unjudged",
    "compile_check",
]

#: Characters of output a regex searches (each search is also bounded in time).
MAX_REGEX_CHARS: Final = 64 * 1024
#: Longest output parsed as JSON (the normalizer's own parse limit).
MAX_JSON_CHARS: Final = 256 * 1024
#: Where the normalizer cuts ``output_text`` (``supervisor.normalize.attributes.MAX_OUTPUT_CHARS``;
#: a test keeps the two equal). An output this long may end where the cut was.
NORMALIZED_OUTPUT_CHARS: Final = 4 * 1024


class Unjudged(Exception):
    """Raised by a check that cannot judge this span; ``key`` names the cause for reporting once."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


Check = Callable[[SpanRecord], "str | None"]


#: The checks that ask only whether an output is empty (cheap to screen for).
EMPTINESS_CHECKS: Final = frozenset({"output_empty", "final_answer_empty"})


def _is_blank(text: str) -> bool:
    return not text or text.isspace()


def _not_recorded() -> Unjudged:
    return Unjudged(
        "not_recorded",
        "spans that recorded no output (content capture off, hidden outputs) are not judged",
    )


def _output_empty(record: SpanRecord) -> str | None:
    if not record.output_recorded:
        raise _not_recorded()
    return "output is empty" if record.says_nothing else None


def _final_answer_empty(record: SpanRecord) -> str | None:
    if not record.output_recorded:
        raise _not_recorded()
    return "final answer is empty" if record.says_nothing else None


class _OnContent:
    """A check of an output's text, run only on outputs that were recorded and are text.

    An output that was not recorded is not judged (reported once), and an LLM
    turn that only calls tools has no text to judge: it passes.
    """

    __slots__ = ("check",)

    def __init__(self, check: Check) -> None:
        self.check = check

    def __call__(self, record: SpanRecord) -> str | None:
        if not record.output_recorded:
            raise _not_recorded()
        if record.calls_tools and _is_blank(record.output_text):
            return None
        return self.check(record)


class _OutputRegex:
    __slots__ = ("cut_at", "must_match", "regex")

    def __init__(self, spec: OutputRegexSpec, cut_at: int | None) -> None:
        self.regex = PolicyRegex(spec.pattern, spec.flags)
        self.must_match = spec.must_match
        self.cut_at = cut_at

    def __call__(self, record: SpanRecord) -> str | None:
        text = record.output_text
        checked = text if len(text) <= MAX_REGEX_CHARS else text[:MAX_REGEX_CHARS]
        shown = self.regex.shown
        try:
            found = self.regex.search(checked)
        except TimeoutError:
            raise Unjudged(
                "timeout",
                f"regex /{shown}/ timed out after {REGEX_TIMEOUT_S * 1000:.0f} ms on a"
                f" {len(checked)}-character output; the span was not judged",
            ) from None
        if found is not self.must_match:
            if found:
                return f"output matches /{shown}/"
            cut = len(text) > MAX_REGEX_CHARS or (
                self.cut_at is not None and len(text) >= self.cut_at
            )
            if cut:
                raise Unjudged(
                    "cut",
                    f"/{shown}/ was not found in an output that may go on past"
                    f" {len(checked)} characters; such outputs are not judged",
                )
            return f"output does not match /{shown}/"
        return None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class _OutputJson:
    __slots__ = ("cut_at", "schema")

    def __init__(self, schema: OutputSchema | None, cut_at: int | None) -> None:
        self.schema = schema
        self.cut_at = cut_at

    def parse(self, text: str) -> tuple[object, str | None]:
        """The document, or the reason the text is not JSON."""
        if len(text) > MAX_JSON_CHARS:
            raise Unjudged(
                "too_long", f"an output over {MAX_JSON_CHARS} characters was not parsed as JSON"
            )
        try:
            return orjson.loads(text), None
        except orjson.JSONDecodeError as exc:
            ended_early = "end of data" in exc.msg or "EOF" in exc.msg
        if ended_early and self.cut_at is not None and len(text) >= self.cut_at:
            raise Unjudged(
                "cut", f"JSON output cut at {len(text)} characters by normalization; not judged"
            )
        # orjson refuses some valid JSON (integers over 64 bits); json has the
        # clearer message ("Expecting value") when the text really is not JSON.
        try:
            return json.loads(text, parse_constant=_no_constant), None
        except json.JSONDecodeError as exc:
            return None, f"output is not JSON: {exc.msg} at {exc.lineno}:{exc.colno}"
        except ValueError as exc:
            return None, f"output is not JSON: {short(str(exc), 80)}"
        except RecursionError:
            raise Unjudged("too_deep", "an output nests too deeply to parse") from None

    def __call__(self, record: SpanRecord) -> str | None:
        document, problem = self.parse(record.output_text)
        if problem is not None or self.schema is None:
            return problem
        try:
            return self.schema.problem(document)
        except RecursionError:
            raise Unjudged("too_deep", "an output nests too deeply to check") from None
        except TimeoutError:
            raise Unjudged(
                "timeout",
                f"the JSON Schema's regexes took over {REGEX_TIMEOUT_S * 1000:.0f} ms on one"
                " output; the span was not judged",
            ) from None


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
    return short(repr(value), 60)


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


def compile_check(spec: VerifierSpec, output_cut_at: int | None) -> Check:
    """The check ``spec`` names; ``output_cut_at`` is where outputs may have been cut upstream."""
    if spec.output_empty:
        return _output_empty
    if spec.final_answer_empty:
        return _final_answer_empty
    if spec.output_regex is not None:
        return _OnContent(_OutputRegex(spec.output_regex, output_cut_at))
    if spec.output_json:
        return _OnContent(_OutputJson(None, output_cut_at))
    if spec.output_json_schema is not None:
        return _OnContent(_OutputJson(OutputSchema(spec.output_json_schema), output_cut_at))
    if spec.attribute_range is not None:
        return _AttributeRange(spec.attribute_range)
    raise ValueError(f"verifier {spec.name!r} has no check")  # pragma: no cover - one is required
