"""Field types shared by every policy-file model: names, globs, regexes, codes, a strict base.

Each type checks its value where pydantic can report the field path (a bad
glob fails as ``rules[2].match.service.0``), so the models in
:mod:`policies._schema`, :mod:`policies._schema_budgets` and
:mod:`policies._schema_verifiers` declare fields and nothing else. Like them,
this module validates and never runs anything on spans.
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

from policies._glob import check_glob
from policies._regex import check_regex
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

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_STATUS_CLASS = re.compile(r"([1-5])xx")
_STATUS_RANGE = re.compile(r"(\d{3})\s*-\s*(\d{3})")


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
    """A dependency key, optionally with ``{field}`` placeholders from TEMPLATE_FIELDS."""
    if not value or len(value) > 256:
        raise ValueError("dependency must be 1-256 characters")
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise ValueError(f"bad dependency template {value!r}: {exc}") from None
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in TEMPLATE_FIELDS or spec or conversion:
            allowed = ", ".join("{" + f + "}" for f in sorted(TEMPLATE_FIELDS))
            raise ValueError(
                f"bad dependency template {value!r}: placeholder {{{field}}}"
                f" is not one of {allowed}"
            )
    return value


def _check_dependency_key(value: str) -> str:
    if not value or len(value) > 256 or value.strip() != value:
        raise ValueError(f"bad dependency {value!r}: 1-256 characters, no surrounding spaces")
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
        elif text.isdigit() and len(text) == 3:
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
    if isinstance(value, str) and value.upper() in GRPC_CODES:
        return GRPC_CODES[value.upper()]
    raise ValueError(
        f"bad gRPC code {value!r}: use 0..16 or a name such as UNAVAILABLE or DEADLINE_EXCEEDED"
    )


class RegexCondition(BaseModel):
    """Only documents ``{regex: ...}`` in the JSON Schema; parsing is ``_attribute_condition``."""

    model_config = ConfigDict(extra="forbid")
    regex: str


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


def _list_of(item_input: Any) -> BeforeValidator:
    return BeforeValidator(_as_list, json_schema_input_type=item_input | list[item_input])


Name = Annotated[
    str,
    AfterValidator(_check_name),
    WithJsonSchema({"type": "string", "pattern": f"^{_NAME.pattern}$"}),
]
Kind = Annotated[
    str,
    AfterValidator(_check_kind),
    WithJsonSchema({"type": "string", "pattern": f"^{_KIND.pattern}$"}),
]
Glob = Annotated[str, AfterValidator(check_glob)]
Regex = Annotated[str, AfterValidator(check_regex)]
DependencyKey = Annotated[str, AfterValidator(_check_dependency_key)]
Template = Annotated[str, AfterValidator(_check_template)]
HttpStatus = Annotated[
    tuple[int, int], PlainValidator(_http_status, json_schema_input_type=int | str | list[int])
]
GrpcCode = Annotated[int, PlainValidator(_grpc_code, json_schema_input_type=int | str)]
AttrCondition = Annotated[
    tuple[str, AttrScalar],
    PlainValidator(_attribute_condition, json_schema_input_type=AttrScalar | RegexCondition),
]
Description = Annotated[str, Field(max_length=2000)]

Globs = Annotated[list[Glob], _list_of(str), Field(min_length=1, max_length=MAX_ITEMS)]
Regexes = Annotated[list[Regex], _list_of(str), Field(min_length=1, max_length=MAX_ITEMS)]
Words = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=128)]],
    _list_of(str),
    Field(min_length=1, max_length=MAX_ITEMS),
]
Kinds = Annotated[list[Kind], _list_of(str), Field(min_length=1, max_length=MAX_ITEMS)]
Classes = Annotated[list[ClassName], _list_of(str), Field(min_length=1, max_length=4)]
Roles = Annotated[list[RoleName], _list_of(str), Field(min_length=1, max_length=6)]
HttpStatuses = Annotated[
    list[HttpStatus], _list_of(int | str), Field(min_length=1, max_length=MAX_ITEMS)
]
GrpcCodes = Annotated[list[GrpcCode], _list_of(int | str), Field(min_length=1, max_length=17)]


class _Strict(BaseModel):
    """The base of every policy-file model: no unknown keys, no coercion, no NaN, frozen."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, populate_by_name=False
    )
