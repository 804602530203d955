"""OTLP attribute values as plain Python, and the draft the adapters fill.

Why one pass: reading a protobuf repeated field from Python makes a wrapper
object per element, so the attributes of a span are converted exactly once,
into a dict the adapters then read with plain lookups.

Everything copied is bounded (see the ``MAX_*`` constants): a span may carry
megabytes of prompt text, and the record must not. A string longer than
``MAX_VALUE_CHARS`` is truncated in the converted mapping; its full text is
kept aside (``Converted.long``) for the few attributes an adapter must parse
as a whole (message JSON), and is dropped with the draft.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Protocol, TypeVar

import orjson

from supervisor.records import AttrValue, Role

_T = TypeVar("_T")

__all__ = [
    "MAX_ARRAY_ITEMS",
    "MAX_ATTRIBUTES",
    "MAX_DEPTH",
    "MAX_KEY_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_OUTPUT_CHARS",
    "MAX_PARSE_CHARS",
    "MAX_VALUE_CHARS",
    "AttributeSource",
    "Draft",
    "args_digest",
    "as_int",
    "as_str",
    "bounded",
    "convert_attributes",
    "convert_value",
    "parse_json",
]

#: Attributes kept per span (OTel SDK's default limit is 128).
MAX_ATTRIBUTES: Final = 256
#: Characters kept of a key inside a kvlist value.
MAX_KEY_CHARS: Final = 256
#: Characters kept of a string attribute value in the record's mapping.
MAX_VALUE_CHARS: Final = 8 * 1024
#: Items kept of an array attribute.
MAX_ARRAY_ITEMS: Final = 128
#: Nesting kept of array/kvlist values (deeper values become ``None``).
MAX_DEPTH: Final = 4
#: Characters kept of a record's ``output_text``.
MAX_OUTPUT_CHARS: Final = 4 * 1024
#: Characters kept of status and exception messages.
MAX_MESSAGE_CHARS: Final = 2 * 1024
#: Characters kept of names: model, provider, tool, session, host, service.
MAX_NAME_CHARS: Final = 256
#: Longest text parsed as JSON (message lists, tool arguments); longer text is not parsed.
MAX_PARSE_CHARS: Final = 256 * 1024


def bounded(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters."""
    return text if len(text) <= limit else text[:limit]


def as_str(value: object, limit: int = MAX_NAME_CHARS) -> str:
    """A string attribute as a bounded ``str``; ``""`` for anything else.

    Numbers are accepted too (some instrumentations write ids as ints).
    """
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return ""


def as_int(value: object) -> int | None:
    """An integer attribute (or an integral float / decimal string); else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and 0 < len(value) <= 20:
        text = value.strip()
        if text.lstrip("-").isdigit():
            return int(text)
    return None


def text_value(value: object) -> str:
    """An output attribute as text: strings verbatim, a JSON-encoded string decoded."""
    if isinstance(value, str):
        if value[:1] == '"':
            decoded = parse_json(value)
            if isinstance(decoded, str):
                return bounded(decoded, MAX_OUTPUT_CHARS)
        return bounded(value, MAX_OUTPUT_CHARS)
    if value is None or isinstance(value, bytes):
        return ""
    return bounded(str(value), MAX_OUTPUT_CHARS)


def parse_json(text: str) -> Any:
    """Parse JSON text, never raising; ``None`` for invalid or oversized text.

    orjson, not ``json``: message lists, tool arguments and outputs are parsed
    on every LLM and tool span, and it is several times faster. It is also
    stricter (no NaN, integers within 64 bits), which only turns odd text into
    ``None`` here.
    """
    if not text or len(text) > MAX_PARSE_CHARS:
        return None
    try:
        return orjson.loads(text)
    except (ValueError, RecursionError):  # orjson.JSONDecodeError is a ValueError
        return None


#: Canonical JSON for digests: sorted keys, compact.
_CANONICAL: Final = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def args_digest(arguments: object) -> str:
    """Short stable digest of tool-call arguments (16 hex characters).

    Arguments that parse as JSON are hashed in canonical form, so the same
    call digests alike whatever the key order or spacing; other text is
    hashed verbatim.
    """
    if arguments is None or arguments == "":
        return ""
    # Parsed text holds plain JSON types already; structured attributes need converting.
    parsed = parse_json(arguments) if isinstance(arguments, str) else _jsonable(arguments)
    canonical: bytes
    if parsed is None:
        text = arguments if isinstance(arguments, str) else repr(arguments)
        canonical = text.encode("utf-8", "surrogatepass")
    else:
        try:
            canonical = orjson.dumps(parsed, default=str, option=_CANONICAL)
        except (TypeError, ValueError, RecursionError):  # orjson.JSONEncodeError is a TypeError
            canonical = repr(parsed).encode("utf-8", "surrogatepass")
    return hashlib.sha256(canonical).hexdigest()[:16]


def _jsonable(value: object) -> object:
    """Mapping proxies and tuples (converted attributes) as JSON-friendly types."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


# -- conversion --------------------------------------------------------------


def convert_value(value: Any, depth: int = 0) -> AttrValue:
    """One OTLP ``AnyValue`` as plain Python (bounded, never raises on odd input)."""
    which = value.WhichOneof("value")
    if which == "string_value":
        return bounded(value.string_value, MAX_VALUE_CHARS)
    if which is None:
        return None
    if which == "array_value":
        if depth >= MAX_DEPTH:
            return None
        items = value.array_value.values
        return tuple(convert_value(v, depth + 1) for v in items[:MAX_ARRAY_ITEMS])
    if which == "kvlist_value":
        if depth >= MAX_DEPTH:
            return None
        out: dict[str, AttrValue] = {}
        for kv in value.kvlist_value.values[:MAX_ARRAY_ITEMS]:
            out[bounded(kv.key, MAX_KEY_CHARS)] = convert_value(kv.value, depth + 1)
        return MappingProxyType(out)
    if which == "bytes_value":
        return bytes(value.bytes_value[:MAX_VALUE_CHARS])
    result: AttrValue = getattr(value, which)  # bool_value, int_value, double_value
    return result


class Converted:
    """A span's attributes, converted once.

    ``values`` is what the record exposes (bounded); ``long`` holds the full
    text of the string values that were truncated, for :meth:`full`.
    """

    __slots__ = ("long", "values")

    def __init__(self, values: dict[str, AttrValue], long: dict[str, str] | None) -> None:
        self.values = values
        self.long = long

    def full(self, key: str) -> AttrValue:
        """The value of ``key``, with its full text if it was truncated."""
        if self.long is not None and key in self.long:
            return self.long[key]
        return self.values.get(key)

    def read(self, key: str, parse: Callable[[AttrValue], _T]) -> _T:
        """``parse(full(key))``."""
        return parse(self.full(key))


def convert_attributes(kvs: Sequence[Any]) -> Converted:
    """Convert repeated OTLP ``KeyValue``s (a resource's attributes) into a dict.

    The count is bounded by slicing first. Keys are kept whole, as the wire
    path (:mod:`.wire`) keeps them: they live only as long as the batch.
    """
    if len(kvs) > MAX_ATTRIBUTES:
        kvs = kvs[:MAX_ATTRIBUTES]
    out: dict[str, AttrValue] = {}
    long: dict[str, str] | None = None
    for kv in kvs:
        value = kv.value
        text = value.string_value
        if long is not None:
            long.pop(kv.key, None)  # a repeated key: the last value wins, as on the wire
        if text:
            if len(text) > MAX_VALUE_CHARS:
                if long is None:
                    long = {}
                long[kv.key] = text
                text = text[:MAX_VALUE_CHARS]
            out[kv.key] = text
            continue
        which = value.WhichOneof("value")
        if which in {"int_value", "double_value", "bool_value"}:
            out[kv.key] = getattr(value, which)
        elif which == "string_value":
            out[kv.key] = ""
        else:
            out[kv.key] = None if which is None else convert_value(value)
    return Converted(out, long)


# -- the draft the adapters fill ---------------------------------------------


class AttributeSource(Protocol):
    """What the adapters read: bounded values, and the full text on request."""

    @property
    def values(self) -> Mapping[str, AttrValue]: ...

    def full(self, key: str) -> AttrValue: ...

    def read(self, key: str, parse: Callable[[AttrValue], _T]) -> _T:
        """``parse(full(key))``, which a source may memoize by the value: ``parse`` is pure."""
        ...


class Draft:
    """What the adapters learn about one span, before it is frozen into a record.

    Adapters run in a fixed order and fill a field only while it is still
    empty, so the most specific convention wins.
    """

    __slots__ = (
        "attrs",
        "conventions",
        "finish_reasons",
        "grpc_code",
        "host",
        "http_status",
        "input_tokens",
        "invalid_tool_calls",
        "offered_tools",
        "output_text",
        "output_tokens",
        "provider",
        "request_model",
        "response_model",
        "role",
        "session_id",
        "tool_args",
        "tool_calls",
        "tool_name",
    )

    def __init__(self, attrs: AttributeSource) -> None:
        self.attrs = attrs
        self.conventions: list[str] = []
        self.role: Role | None = None
        self.provider = ""
        self.request_model = ""
        self.response_model = ""
        self.tool_name = ""
        #: The tool span's own call arguments (text or parsed JSON).
        self.tool_args: object = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.output_text = ""
        self.session_id = ""
        self.finish_reasons: tuple[str, ...] = ()
        #: Tool calls an LLM response requested: ``(name, arguments)``.
        self.tool_calls: list[tuple[str, object]] = []
        #: Names of the tools the LLM was offered; ``None`` when not known.
        self.offered_tools: frozenset[str] | None = None
        self.invalid_tool_calls: list[str] = []
        self.http_status: int | None = None
        self.grpc_code: int | None = None
        self.host = ""
