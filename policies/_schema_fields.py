"""Field types shared by every policy-file model: names, globs, regexes, codes, a strict base.

Each type checks its value where pydantic can report the field path (a bad
glob fails as ``rules[2].match.service.0``), so the models in
:mod:`policies._schema`, :mod:`policies._schema_budgets` and
:mod:`policies._schema_verifiers` declare fields and nothing else. Like them,
this module validates and never runs anything on spans.

Each type also says what it accepts in the policy file's JSON Schema (``spanvisor
schema``, for editors): the input a validator takes (``role: tool`` for
``[tool]``, ``"5xx"`` for a status range), not the value it produces, with the
same patterns the checks use where a regex can say it.
"""

from __future__ import annotations

import math
import re
import string
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
)
from pydantic.json_schema import WithJsonSchema

from policies._glob import GLOB_PATTERN, MAX_GLOB_LEN, check_glob
from policies._regex import MAX_REGEX_LEN, check_regex
from supervisor.records import GRPC_CODES

ClassName = Literal["transient", "model", "permanent", "semantic"]
RoleName = Literal["llm", "tool", "agent", "chain", "http", "other"]
SimpleActionName = Literal["fail_fast", "none"]
JitterName = Literal["none", "full", "equal"]


#: Fields a rule's ``dependency`` template may use, e.g. ``"{provider}"``.
TEMPLATE_FIELDS = frozenset({"dependency", "service", "provider", "model", "tool"})

MAX_ITEMS = 256
MAX_SECONDS = 3600.0
MAX_RETRY_AFTER_S = 86400.0
MAX_ATTEMPTS = 100
MAX_DEPENDENCY_LEN = 256
#: Names of rules, decision entries and verifiers starting with this are the built-in
#: policy's: a policy file may not use them (the loader says so, the JSON Schema too).
BUILTIN_PREFIX = "builtin."

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_STATUS_CLASS = re.compile(r"([1-5])xx")
_STATUS_RANGE = re.compile(r"([0-9]{3})\s*-\s*([0-9]{3})")
_STATUS_CODE = re.compile(r"[0-9]{3}")
#: What the HTTP status forms above accept, codes limited to 100..599 (as the check
#: does after parsing; only "low <= high" of a range is left to the check).
_STATUS_PATTERN = r"^\s*(?:[1-5][xX][xX]|[1-5][0-9]{2}\s*-\s*[1-5][0-9]{2}|[1-5][0-9]{2})\s*$"
#: A dependency key: no surrounding whitespace (what ``str.strip`` would remove).
_DEPENDENCY_KEY = re.compile(r"\S(?:[\s\S]*\S)?")
#: A dependency template: text, ``{{``/``}}`` escapes, and ``{field}`` of TEMPLATE_FIELDS.
_TEMPLATE = re.compile(r"(?:[^{}]|\{\{|\}\}|\{(?:" + "|".join(sorted(TEMPLATE_FIELDS)) + r")\})+")


def _as_list(value: object) -> object:
    """Let a single value stand for a one-item list (``role: tool``)."""
    if isinstance(value, (str, int, float, bool)):
        return [value]
    return value


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"bad name {value!r}: use 1-128 letters, digits and '_.:/-', starting with"
            " a letter or digit"
        )
    return value


def _check_kind(value: str) -> str:
    if not _KIND.fullmatch(value):
        raise ValueError(f"bad kind {value!r}: use lowercase letters, digits and '_'")
    return value


def _check_ident(value: str) -> str:
    if not _IDENT.fullmatch(value):
        raise ValueError(f"bad identifier {value!r}: use letters, digits and '_.-'")
    return value


def _check_template(value: str) -> str:
    """A dependency key, optionally with ``{field}`` placeholders from TEMPLATE_FIELDS.

    ``_TEMPLATE`` decides (the JSON Schema carries it); ``string.Formatter`` says why not.
    """
    if not value or len(value) > MAX_DEPENDENCY_LEN:
        raise ValueError(f"dependency must be 1-{MAX_DEPENDENCY_LEN} characters")
    if _TEMPLATE.fullmatch(value):
        return value
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise ValueError(f"bad dependency template {value!r}: {exc}") from None
    for _, field, spec, conversion in parts:
        if field is not None and (field not in TEMPLATE_FIELDS or spec or conversion):
            break
    else:
        field = "?"
    allowed = ", ".join("{" + f + "}" for f in sorted(TEMPLATE_FIELDS))
    raise ValueError(
        f"bad dependency template {value!r}: placeholder {{{field}}} is not one of {allowed}"
    )


def _check_dependency_key(value: str) -> str:
    if len(value) > MAX_DEPENDENCY_LEN or not _DEPENDENCY_KEY.fullmatch(value):
        raise ValueError(
            f"bad dependency {value!r}: 1-{MAX_DEPENDENCY_LEN} characters, no surrounding spaces"
        )
    return value


def _http_status(value: object) -> tuple[int, int]:
    """``429`` | ``"429"`` | ``"5xx"`` | ``"500-599"`` | ``[500, 599]`` -> inclusive range."""
    hint = "use a code (429), a class ('5xx') or a range ('500-599' or [500, 599])"
    lo: int
    hi: int
    if isinstance(value, int) and not isinstance(value, bool):
        lo = hi = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if klass := _STATUS_CLASS.fullmatch(text):
            lo = int(klass.group(1)) * 100
            hi = lo + 99
        elif span := _STATUS_RANGE.fullmatch(text):
            lo, hi = int(span.group(1)), int(span.group(2))
        elif _STATUS_CODE.fullmatch(text):
            lo = hi = int(text)
        else:
            raise ValueError(f"bad HTTP status {value!r}: {hint}")
    elif (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        lo, hi = value
    else:
        raise ValueError(f"bad HTTP status {value!r}: {hint}")
    if not 100 <= lo <= hi <= 599:
        raise ValueError(f"bad HTTP status {value!r}: codes are 100..599, low <= high")
    return lo, hi


def _grpc_code(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 16:
        return value
    # ASCII only: the dotless i upper-cases to "I", which no editor's case-folding does.
    if isinstance(value, str) and value.isascii() and value.upper() in GRPC_CODES:
        return GRPC_CODES[value.upper()]
    raise ValueError(
        f"bad gRPC code {value!r}: use 0..16 or a name such as UNAVAILABLE or DEADLINE_EXCEEDED"
    )


AttrScalar = str | int | float | bool


def _attribute_condition(value: object) -> tuple[str, AttrScalar]:
    """An attribute test: an exact scalar, or ``{regex: ...}`` searched in a string value."""
    if isinstance(value, dict):
        if set(value) != {"regex"} or not isinstance(value["regex"], str):
            raise ValueError("an attribute condition is a scalar or {regex: <pattern>}")
        return ("regex", check_regex(value["regex"]))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("an attribute value must be a finite number")
    if isinstance(value, (str, int, float, bool)):
        return ("eq", value)
    raise ValueError("an attribute condition is a scalar or {regex: <pattern>}")


def _list_of(item: Any) -> BeforeValidator:
    """One ``item`` or a list of them; the JSON Schema keeps the item's own constraints."""
    return BeforeValidator(_as_list, json_schema_input_type=item | list[item])


def _any_case(word: str) -> str:
    """A regex matching ``word`` in any ASCII case (JSON Schema patterns have no flags)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in word)


Name = Annotated[
    str,
    AfterValidator(_check_name),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": f"^{_NAME.pattern}$",
            "not": {"pattern": "^" + re.escape(BUILTIN_PREFIX)},
        }
    ),
]
Kind = Annotated[
    str,
    AfterValidator(_check_kind),
    WithJsonSchema({"type": "string", "pattern": f"^{_KIND.pattern}$"}),
]
Ident = Annotated[
    str,
    AfterValidator(_check_ident),
    WithJsonSchema({"type": "string", "pattern": f"^{_IDENT.pattern}$"}),
]
Glob = Annotated[
    str,
    AfterValidator(check_glob),
    WithJsonSchema(
        {"type": "string", "minLength": 1, "maxLength": MAX_GLOB_LEN, "pattern": GLOB_PATTERN}
    ),
]
Regex = Annotated[
    str,
    AfterValidator(check_regex),
    WithJsonSchema({"type": "string", "maxLength": MAX_REGEX_LEN}),
]
DependencyKey = Annotated[
    str,
    AfterValidator(_check_dependency_key),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": MAX_DEPENDENCY_LEN,
            "pattern": f"^{_DEPENDENCY_KEY.pattern}$",
        }
    ),
]
Template = Annotated[
    str,
    AfterValidator(_check_template),
    WithJsonSchema(
        {"type": "string", "maxLength": MAX_DEPENDENCY_LEN, "pattern": f"^{_TEMPLATE.pattern}$"}
    ),
]


class RegexCondition(BaseModel):
    """Only documents ``{regex: ...}`` in the JSON Schema; parsing is ``_attribute_condition``."""

    model_config = ConfigDict(extra="forbid")
    regex: Regex


_STATUS_INT = {"type": "integer", "minimum": 100, "maximum": 599}
HttpStatus = Annotated[
    tuple[int, int],
    PlainValidator(_http_status),
    WithJsonSchema(
        {
            "anyOf": [
                _STATUS_INT,
                {"type": "string", "pattern": _STATUS_PATTERN},
                {"type": "array", "items": _STATUS_INT, "minItems": 2, "maxItems": 2},
            ]
        }
    ),
]
GrpcCode = Annotated[
    int,
    PlainValidator(_grpc_code),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 16},
                {"enum": list(GRPC_CODES)},
                {
                    "type": "string",
                    "pattern": "^(?:" + "|".join(_any_case(n) for n in GRPC_CODES) + ")$",
                },
            ]
        }
    ),
]
AttrCondition = Annotated[
    tuple[str, AttrScalar],
    PlainValidator(_attribute_condition, json_schema_input_type=AttrScalar | RegexCondition),
]
Description = Annotated[str, Field(max_length=2000)]
Word = Annotated[str, Field(min_length=1, max_length=128)]

Globs = Annotated[list[Glob], _list_of(Glob), Field(min_length=1, max_length=MAX_ITEMS)]
Regexes = Annotated[list[Regex], _list_of(Regex), Field(min_length=1, max_length=MAX_ITEMS)]
Words = Annotated[list[Word], _list_of(Word), Field(min_length=1, max_length=MAX_ITEMS)]
Kinds = Annotated[list[Kind], _list_of(Kind), Field(min_length=1, max_length=MAX_ITEMS)]
Classes = Annotated[list[ClassName], _list_of(ClassName), Field(min_length=1, max_length=4)]
Roles = Annotated[list[RoleName], _list_of(RoleName), Field(min_length=1, max_length=6)]
HttpStatuses = Annotated[
    list[HttpStatus], _list_of(HttpStatus), Field(min_length=1, max_length=MAX_ITEMS)
]
GrpcCodes = Annotated[list[GrpcCode], _list_of(GrpcCode), Field(min_length=1, max_length=17)]


def _set(key: str) -> dict[str, Any]:
    """JSON Schema: ``key`` is present and not null (how the models tell a field is set)."""
    return {"required": [key], "properties": {key: {"not": {"type": "null"}}}}


def _not_bool(value: object) -> object:
    """``True == 1`` in Python, so a ``Literal[1]`` takes ``true``: the file means a number."""
    if isinstance(value, bool):
        raise ValueError(f"unknown value {value!r}; expected 1")
    return value


#: A file format's ``version: 1``.
Version = Annotated[Literal[1], BeforeValidator(_not_bool)]


class _Strict(BaseModel):
    """The base of every policy-file model: no unknown keys, no coercion, no NaN, frozen."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, populate_by_name=False
    )
