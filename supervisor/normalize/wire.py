"""The hot path's view of OTLP: spans whose attributes stay undecoded until read.

Why: reading a repeated ``KeyValue`` field through the protobuf runtime makes
two Python objects per attribute (a wrapper for the pair, another for the
value), which made attribute conversion the largest cost of the sidecar.
Here a second, wire-compatible schema declares a span's attributes as
``repeated bytes``: the runtime hands back each encoded ``KeyValue`` as one
``bytes`` object, its key is sliced out, and its value is decoded only when
an adapter asks for it. Most attributes of most spans are never read.

The schema is built at import from descriptors (no generated code): every
other field keeps its real OTLP type, so events, links and status read as
usual. Anything the fast decoder does not recognise (a key over 127 bytes, a
field order no encoder writes, arrays and maps) falls back to the real
``KeyValue`` parser, so the answer never depends on which path was taken;
``tests/test_normalize_wire.py`` checks that.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.common.v1 import common_pb2  # registers the imported files
from opentelemetry.proto.resource.v1 import resource_pb2  # noqa: F401 - same
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: F401 - same

from supervisor.normalize.attributes import (
    MAX_ARRAY_ITEMS,
    MAX_VALUE_CHARS,
    convert_value,
)
from supervisor.records import AttrValue

__all__ = ["LazyConverted", "LiteRequest", "LiteSpan", "RawAttributes"]

_F: Final = descriptor_pb2.FieldDescriptorProto
_OPTIONAL, _REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_TRACE: Final = ".opentelemetry.proto.trace.v1."


def _build_lite_request() -> Any:
    fd = descriptor_pb2.FileDescriptorProto(
        name="spanvisor/otlp_lite.proto",
        package="spanvisor.lite",
        syntax="proto3",
        dependency=[
            "opentelemetry/proto/trace/v1/trace.proto",
            "opentelemetry/proto/resource/v1/resource.proto",
        ],
    )

    def message(name: str, fields: Iterable[tuple[str, int, int, int, str]]) -> Any:
        msg = fd.message_type.add(name=name)
        for field_name, number, ftype, label, type_name in fields:
            field = msg.field.add(name=field_name, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name
        return msg

    # Field numbers are OTLP's (opentelemetry/proto/trace/v1/trace.proto).
    span = message(
        "Span",
        [
            ("trace_id", 1, _F.TYPE_BYTES, _OPTIONAL, ""),
            ("span_id", 2, _F.TYPE_BYTES, _OPTIONAL, ""),
            ("parent_span_id", 4, _F.TYPE_BYTES, _OPTIONAL, ""),
            ("name", 5, _F.TYPE_STRING, _OPTIONAL, ""),
            ("kind", 6, _F.TYPE_INT32, _OPTIONAL, ""),
            ("start_time_unix_nano", 7, _F.TYPE_FIXED64, _OPTIONAL, ""),
            ("end_time_unix_nano", 8, _F.TYPE_FIXED64, _OPTIONAL, ""),
            ("attributes", 9, _F.TYPE_MESSAGE, _REPEATED, ".spanvisor.lite.Span.AttributesEntry"),
            ("events", 11, _F.TYPE_MESSAGE, _REPEATED, _TRACE + "Span.Event"),
            ("links", 13, _F.TYPE_MESSAGE, _REPEATED, _TRACE + "Span.Link"),
            ("status", 15, _F.TYPE_MESSAGE, _OPTIONAL, _TRACE + "Status"),
        ],
    )
    # A KeyValue is encoded exactly as a map entry (key = 1, value = 2), so the
    # attributes parse as a map from key to the encoded AnyValue.
    entry = span.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_OPTIONAL)
    entry.field.add(name="value", number=2, type=_F.TYPE_BYTES, label=_OPTIONAL)
    message("ScopeSpans", [("spans", 2, _F.TYPE_MESSAGE, _REPEATED, ".spanvisor.lite.Span")])
    message(
        "ResourceSpans",
        [
            (
                "resource",
                1,
                _F.TYPE_MESSAGE,
                _OPTIONAL,
                ".opentelemetry.proto.resource.v1.Resource",
            ),
            ("scope_spans", 2, _F.TYPE_MESSAGE, _REPEATED, ".spanvisor.lite.ScopeSpans"),
        ],
    )
    message(
        "Request",
        [("resource_spans", 1, _F.TYPE_MESSAGE, _REPEATED, ".spanvisor.lite.ResourceSpans")],
    )
    pool = descriptor_pool.Default()
    # TypeError: already added (module reloaded); the same definition is in the pool.
    with contextlib.suppress(TypeError):
        pool.AddSerializedFile(fd.SerializeToString())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("spanvisor.lite.Request"))


#: ``ExportTraceServiceRequest``'s wire format, read with lazy span attributes.
LiteRequest: Any = _build_lite_request()
#: One ``Span`` of it, for a span read alone.
LiteSpan: Any = message_factory.GetMessageClass(
    descriptor_pool.Default().FindMessageTypeByName("spanvisor.lite.Span")
)

_MISSING: Final = object()
_T = TypeVar("_T")
_DOUBLE: Final = struct.Struct("<d")


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at ``pos``: (value, position after it); ValueError past ten bytes."""
    byte = data[pos]
    if byte < 0x80:
        return byte, pos + 1
    result = byte & 0x7F
    shift = 7
    while True:
        pos += 1
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos + 1
        shift += 7
        if shift > 63:
            raise ValueError("a varint over ten bytes")


def _any_value(data: bytes, pos: int, end: int) -> object:
    """The ``AnyValue`` encoded in ``data[pos:end]``, or ``_MISSING``.

    Scalars and arrays of scalars, the values instrumentations write, are
    decoded here; maps, bytes, nested arrays and any layout that is not the
    plain one encoders write give ``_MISSING`` and the real parser's answer.
    """
    if pos == end:
        return None  # an empty AnyValue
    tag = data[pos]
    if tag == 0x0A or tag == 0x2A:  # noqa: PLR1714 - string_value, array_value (both LEN)
        size = data[pos + 1]
        if size < 0x80:
            at = pos + 2
        else:
            size, at = read_varint(data, pos + 1)
        if at + size != end:
            return _MISSING
        if tag == 0x0A:
            return data[at:end].decode("utf-8", "replace")
        return _array(data, at, end)
    if tag == 0x18:  # int_value: int64 as a two's complement varint
        value, after = read_varint(data, pos + 1)
        if after != end:
            return _MISSING
        return value - (1 << 64) if value >= 1 << 63 else value
    if tag == 0x10:  # bool_value
        value, after = read_varint(data, pos + 1)
        return bool(value) if after == end else _MISSING
    if tag == 0x21 and pos + 9 == end:  # double_value (fixed64)
        return _DOUBLE.unpack_from(data, pos + 1)[0]
    return _MISSING


def _array(data: bytes, at: int, end: int) -> object:
    """An ``ArrayValue`` of scalars as a tuple (strings bounded, as the real path does)."""
    items: list[object] = []
    while at < end:
        if data[at] != 0x0A:  # field 1, values
            return _MISSING
        size = data[at + 1]
        if size < 0x80:
            start = at + 2
        else:
            size, start = read_varint(data, at + 1)
        stop = start + size
        if stop > end:
            return _MISSING
        item = _any_value(data, start, stop)
        if item is _MISSING or isinstance(item, tuple):
            return _MISSING  # nested arrays keep the real parser's depth limits
        if isinstance(item, str) and len(item) > MAX_VALUE_CHARS:
            item = item[:MAX_VALUE_CHARS]
        items.append(item)
        at = stop
    return tuple(items[:MAX_ARRAY_ITEMS])


def _decode(encoded: bytes) -> AttrValue:
    """An encoded ``AnyValue``; top-level strings full length."""
    try:
        value = _any_value(encoded, 0, len(encoded))
        if value is not _MISSING:
            return value  # type: ignore[return-value]  # a scalar or a tuple of them
    except (IndexError, ValueError):
        pass
    parsed = common_pb2.AnyValue.FromString(encoded)
    if parsed.WhichOneof("value") == "string_value":
        return parsed.string_value  # unbounded here; RawAttributes.get bounds it
    return convert_value(parsed)


#: Decoded short values by their encoding. Most attribute values repeat from
#: span to span (provider, model, span kind, operation, tool names, finish
#: reasons), and a hash lookup is cheaper than decoding them again. Values are
#: immutable (str, int, float, bool, None, tuples of those), so sharing is safe.
_SHORT_VALUES: Final[dict[bytes, object]] = {}
_SHORT_BYTES: Final = 64
_SHORT_ENTRIES: Final = 4096


def raw_value(encoded: Any, key: str) -> bytes | None:
    """The encoded value of ``key`` in a span's attribute map, None when absent.

    ``encoded`` is the lite span's attribute map, or a dict of kept values.
    On a protobuf map a membership test then a subscript is twice as fast as
    its ``get``, which parses its arguments as keywords (and subscripting a
    missing key would insert it).
    """
    if isinstance(encoded, dict):
        kept: dict[str, bytes] = encoded
        return kept.get(key)
    if key in encoded:
        found: bytes = encoded[key]
        return found
    return None


def value_of(encoded: bytes) -> Any:
    """One encoded ``AnyValue`` decoded (strings bounded), as :meth:`RawAttributes.get` reads.

    Short encodings are memoized; a value that does not parse reads as None.
    """
    value = _SHORT_VALUES.get(encoded, _MISSING)
    if value is not _MISSING:
        return value
    try:
        value = _decode(encoded)
    except Exception:  # a value that does not parse reads as absent
        return None
    if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
        return value[:MAX_VALUE_CHARS]
    if len(encoded) <= _SHORT_BYTES:
        if len(_SHORT_VALUES) >= _SHORT_ENTRIES:
            _SHORT_VALUES.clear()  # bounded; rebuilt from the next spans
        _SHORT_VALUES[encoded] = value
    return value


#: Parsed values by (parser, encoding), for :meth:`RawAttributes.read`: an
#: agent offers the same tool definitions on every call, and parsing their
#: JSON dominated reading LLM spans. Bounded like the short values.
_PARSED: Final[dict[tuple[object, bytes], object]] = {}
_PARSED_ENTRIES: Final = 1024


class RawAttributes(Mapping[str, AttrValue]):
    """A span's attributes as the parser left them: values decoded on read.

    It wraps the lite span's attribute map (key to encoded ``AnyValue``), so
    building it costs nothing and a lookup is the runtime's own. It is the
    read-only mapping the record exposes; :class:`LazyConverted` hands it to
    the adapters. String values read through the mapping are bounded to
    ``MAX_VALUE_CHARS``; :meth:`full` gives the whole text.

    It shares the parsed request's memory: keep ``dict(attributes)``, not the
    mapping, beyond the batch. Unlike the plain path it keeps every attribute
    (the request's size limit bounds them), not the first ``MAX_ATTRIBUTES``.
    """

    __slots__ = ("_map",)

    def __init__(self, encoded: Any) -> None:
        self._map = encoded

    @property
    def encoded(self) -> Any:
        """The attribute map as the parser left it (key to encoded ``AnyValue``)."""
        return self._map

    def full(self, key: str) -> AttrValue:
        encoded = raw_value(self._map, key)
        if encoded is None:
            return None
        try:
            return _decode(encoded)
        except Exception:  # a value that does not parse reads as absent
            return None

    def read(self, key: str, parse: Callable[[AttrValue], _T]) -> _T:
        """``parse(full(key))``, memoized by the encoded value (``parse`` must be pure)."""
        encoded = raw_value(self._map, key)
        if encoded is None:
            return parse(None)
        memo = (parse, encoded)
        found = _PARSED.get(memo, _MISSING)
        if found is _MISSING:
            found = parse(self.full(key))
            if len(_PARSED) >= _PARSED_ENTRIES:
                _PARSED.clear()
            _PARSED[memo] = found
        return found  # type: ignore[return-value]  # what parse returned for this value

    def get(self, key: str, default: Any = None) -> Any:
        encoded = self._map
        if key not in encoded:  # then a subscript: a map's get would parse keywords
            return default
        return value_of(encoded[key])

    def __getitem__(self, key: str) -> AttrValue:
        if key not in self._map:
            raise KeyError(key)
        return self.get(key)  # type: ignore[no-any-return]

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._map
        except TypeError:  # not a str
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def keys(self) -> Any:
        """The runtime's own key view: a fast ``isdisjoint`` for the adapters."""
        return self._map.keys()

    def __repr__(self) -> str:
        return f"RawAttributes({dict(self.items())!r})"


class LazyConverted:
    """:class:`RawAttributes` behind the interface the adapters read
    (:class:`~supervisor.normalize.attributes.Converted`'s ``values`` and ``full``)."""

    __slots__ = ("full", "read", "values")

    def __init__(self, raw: RawAttributes) -> None:
        self.values = raw
        self.full = raw.full
        self.read = raw.read
