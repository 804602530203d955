"""A reader of OTLP's wire format that builds only what the span path reads.

Why: :data:`~supervisor.normalize.wire.LiteRequest` parses a request in C,
but every field read afterwards goes through the protobuf runtime's Python
objects: a lookup in a native map per attribute, a new ``str`` per key to
intersect the keys with those the screens watch. Compiled (``setup.py``),
this module walks the bytes once and hands out plain objects instead: a
``dict`` from key to encoded ``AnyValue`` per span (keys interned, so their
hashes are computed once), ids as ``bytes``, status as two fields. Events are
kept encoded: a failing span's are searched for an ``exception`` event here
(:func:`event_name`, :func:`event_attributes`), and parsed by the real
runtime only when read otherwise.

It reads what encoders write. Anything else (a message field written twice,
which protobuf merges; a wire type that does not match the field; groups; a
truncated or over-long length; invalid UTF-8) raises :class:`Unsupported`,
and the caller parses the request with the real runtime instead, so the
answer never depends on which reader ran: ``tests/test_normalize_walk.py``
holds the two to the same spans. Interpreted, this module is slower than the
runtime; :data:`COMPILED` tells the caller which to use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Final

from google.protobuf.message import DecodeError
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = [
    "COMPILED",
    "Unsupported",
    "WalkedSpan",
    "WalkedStatus",
    "ended_at",
    "error_status_or_events",
    "event_attributes",
    "event_name",
    "has_exception_event",
    "identity_of",
    "kind_and_name",
    "locate_spans",
    "read_varint",
    "string_value",
    "walk_request",
    "walk_span",
    "well_formed_spans",
]

#: True when this module runs as a compiled extension (see ``setup.py``).
COMPILED: Final = not __file__.endswith(".py")

_LEN: Final = 2


class _Key:
    """An attribute key read before: its text, and the key that followed it last time.

    Why: an instrumentation writes a kind of span's attributes in the same
    order every time, so the key after this one is most often the one that
    followed it last time. Checking that guess is a comparison of a few
    bytes; looking the key up by its encoding hashes them first, which was a
    third of reading an attribute. A wrong guess only costs the lookup.
    """

    __slots__ = ("following", "membership", "raw", "text")

    def __init__(self, raw: bytes, text: str) -> None:
        self.raw = raw
        self.text = text
        self.following: _Key | None = None
        #: The set of watched keys last asked about, and whether ``text`` is in it
        #: (one tuple, replaced whole: a reader never sees half of an update).
        self.membership: tuple[frozenset[str], bool] | None = None


#: Interned attribute keys by their encoding; bounded (keys come from spans).
_KEYS: Final[dict[bytes, _Key]] = {}
_MAX_KEYS: Final = 4096
#: What comes before a span's first attribute, and an event's.
_SPAN_START: Final = _Key(b"", "")
_EVENT_START: Final = _Key(b"", "")
#: The watched keys of a span, as a frozenset, by the order they were read in.
_PRESENT: Final[dict[tuple[str, ...], frozenset[str]]] = {}
_NO_EVENTS: Final[tuple[Any, ...]] = ()
_NONE_PRESENT: Final[frozenset[str]] = frozenset()


class Unsupported(ValueError):
    """A layout this reader leaves to the protobuf runtime."""


class WalkedStatus:
    """A span's ``Status``: the two fields the span path reads."""

    __slots__ = ("code", "message")

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message


_OK_STATUS: Final = WalkedStatus(0, "")


class WalkedSpan:
    """A span as the span path reads it; attribute names are OTLP's ``Span`` fields'."""

    __slots__ = (
        "_events",
        "_raw_events",
        "attributes",
        "end_time_unix_nano",
        "kind",
        "name",
        "parent_span_id",
        "present",
        "span_id",
        "start_time_unix_nano",
        "status",
        "trace_id",
    )

    def __init__(self, attributes: dict[str, bytes]) -> None:
        self.trace_id = b""
        self.span_id = b""
        self.parent_span_id = b""
        self.name = ""
        self.kind = 0
        self.start_time_unix_nano = 0
        self.end_time_unix_nano = 0
        self.status = _OK_STATUS
        #: Key to encoded ``AnyValue``, as the lite schema's attribute map holds them.
        self.attributes = attributes
        #: The attribute keys the caller watches for (see :func:`walk_request`).
        self.present: frozenset[str] = _NONE_PRESENT
        self._raw_events: list[bytes] | None = None
        self._events: list[Any] | None = None

    @property
    def events(self) -> Sequence[Any]:
        """The span's ``Span.Event`` messages, parsed on first read."""
        raw_events = self._raw_events
        if raw_events is None:
            return _NO_EVENTS
        parsed = self._events
        if parsed is None:
            parsed = self._events = []
            for raw in raw_events:
                # Ingest parsed the whole request before: an event that does not
                # parse here cannot come from it, and is left out, not raised.
                with contextlib.suppress(DecodeError):
                    parsed.append(Span.Event.FromString(raw))
        return parsed


# Fields of a span that is walked or, where the walker declined it, parsed by the
# protobuf runtime (hence ``Any``). Compiled, a walked span's fields are read in
# place; read by name, as ``Any`` makes them, they cost a type lookup each, which
# was a tenth of the run tracker's time. The tuples are C structs, not objects.


def identity_of(span: Any) -> tuple[bytes, bytes, bool, str]:
    """(trace id, span id, whether it has a parent, name)."""
    if isinstance(span, WalkedSpan):
        return span.trace_id, span.span_id, len(span.parent_span_id) > 0, span.name
    return bytes(span.trace_id), bytes(span.span_id), bool(span.parent_span_id), str(span.name)


def kind_and_name(span: Any) -> tuple[int, str]:
    if isinstance(span, WalkedSpan):
        return span.kind, span.name
    return int(span.kind), str(span.name)


def error_status_or_events(span: Any, error_code: int) -> bool:
    """Whether the status code is ``error_code`` or the span has events (not parsed here)."""
    if isinstance(span, WalkedSpan):
        raw_events = span._raw_events
        return span.status.code == error_code or (raw_events is not None and len(raw_events) > 0)
    return bool(span.status.code == error_code or len(span.events))


def has_exception_event(span: Any) -> bool:
    """Whether any of the span's events is named ``exception`` (events not parsed when walked)."""
    if isinstance(span, WalkedSpan):
        raw_events = span._raw_events
        if raw_events is None:
            return False
        try:
            return any(event_name(raw) == "exception" for raw in raw_events)
        except (Unsupported, IndexError, UnicodeDecodeError):
            pass  # the runtime reads them
    return any(event.name == "exception" for event in span.events)


def event_name(raw: bytes) -> str:
    """The name of an encoded ``Span.Event``; raises as :func:`walk_span` does."""
    name = ""
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = read_varint(raw, pos)
        if tag == 0x12:  # name; written twice, the last wins
            size, pos = read_varint(raw, pos)
            stop = _within(pos, size, end)
            name = raw[pos:stop].decode("utf-8")
            pos = stop
        elif tag >> 3 == 2:
            raise Unsupported("an event name with another wire type")
        else:
            pos = _skip(raw, pos, tag, end)
    return name


def event_attributes(raw: bytes) -> dict[str, bytes]:
    """An encoded ``Span.Event``'s attributes, key to encoded ``AnyValue`` (the last of a
    repeated key); raises as :func:`walk_span` does."""
    attributes: dict[str, bytes] = {}
    present: list[str] = []
    after = _EVENT_START
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = read_varint(raw, pos)
        if tag == 0x1A:
            size, pos = read_varint(raw, pos)
            stop = _within(pos, size, end)
            after = _attribute(
                raw, pos, stop, attributes, present=present, watched=_NONE_PRESENT, after=after
            )
            pos = stop
        elif tag >> 3 == 3:
            raise Unsupported("event attributes with another wire type")
        else:
            pos = _skip(raw, pos, tag, end)
    return attributes


def string_value(encoded: bytes) -> str:
    """``AnyValue.string_value`` of an encoded ``AnyValue`` holding a string or nothing.

    Only the layout encoders write is read; anything else raises :class:`Unsupported`.
    """
    end = len(encoded)
    if end == 0:
        return ""
    if encoded[0] != 0x0A:
        raise Unsupported("a value that is not a string")  # rare: the runtime reads it
    size, pos = read_varint(encoded, 1)
    if pos + size != end:
        raise Unsupported("a string value followed by more fields")
    return encoded[pos:end].decode("utf-8")


def ended_at(span: Any) -> int:
    """``end_time_unix_nano``."""
    if isinstance(span, WalkedSpan):
        return span.end_time_unix_nano
    return int(span.end_time_unix_nano)


def walk_request(data: bytes, watched: frozenset[str]) -> list[tuple[Any, list[WalkedSpan]]]:
    """An ``ExportTraceServiceRequest``'s spans by resource: (``Resource``, spans).

    Each span's ``present`` holds those of its attribute keys that are in ``watched``.

    Raises :class:`Unsupported` (or ``IndexError``/``UnicodeDecodeError`` on
    bytes that end early or are not UTF-8) where the runtime must decide.
    """
    resources, where = locate_spans(data)
    out: list[tuple[Any, list[WalkedSpan]]] = [(resource, []) for resource in resources]
    for i in range(0, len(where), 3):
        out[where[i]][1].append(walk_span(data, where[i + 1], where[i + 2], watched))
    return out


def locate_spans(data: bytes) -> tuple[list[Any], list[int]]:
    """Where a request's spans are, without reading them: (resources, positions).

    ``resources`` holds each ``ResourceSpans``' ``Resource`` in order;
    ``positions`` three numbers per span, in order: the index of its
    resource, and the start and stop of its bytes, for :func:`walk_span`.
    A span's bytes parse alone as they parse in the request (each element
    of a repeated field is a message of its own). Raises as
    :func:`walk_request` does on the layout around the spans.
    """
    resources: list[Any] = []
    positions: list[int] = []
    start, stop = _next(data, 0, len(data), 0x0A)  # resource_spans
    while start >= 0:
        resources.append(_locate(data, start, stop, len(resources), positions))
        start, stop = _next(data, stop, len(data), 0x0A)
    return resources, positions


def _locate(data: bytes, pos: int, end: int, index: int, positions: list[int]) -> Any:
    """One ``ResourceSpans``: its spans' positions appended, its ``Resource`` returned."""
    resource: Any = None
    while pos < end:
        tag, pos = read_varint(data, pos)
        if tag == 0x0A or tag == 0x12:  # noqa: PLR1714 - resource, scope_spans
            size, pos = read_varint(data, pos)
            stop = _within(pos, size, end)
            if tag == 0x12:
                start, span_stop = _next(data, pos, stop, 0x12)  # spans
                while start >= 0:
                    positions.append(index)
                    positions.append(start)
                    positions.append(span_stop)
                    start, span_stop = _next(data, span_stop, stop, 0x12)
            elif resource is None:
                try:
                    resource = Resource.FromString(data[pos:stop])
                except DecodeError as exc:
                    raise Unsupported(f"a resource that does not parse: {exc}") from exc
            else:
                raise Unsupported("resource written twice")
            pos = stop
        else:
            pos = _skip(data, pos, tag, end)
    return resource if resource is not None else Resource()


def _next(data: bytes, pos: int, end: int, tag: int) -> tuple[int, int]:
    """(start, stop) of the next length-delimited field with this one-byte ``tag``
    from ``pos``, other fields skipped; (-1, end) when there is none."""
    while pos < end:
        found_tag, pos = read_varint(data, pos)
        if found_tag == tag:
            size, pos = read_varint(data, pos)
            return pos, _within(pos, size, end)
        pos = _skip(data, pos, found_tag, end)
    return -1, end


def well_formed_spans(data: bytes) -> int:
    """How many spans the request holds when every one has well-formed ids, else -1.

    Well-formed as ingest's fast check has it: a 16-byte trace id and an 8-byte
    span id, neither all zero, a parent id empty or of 8 bytes, and no links.
    -1 sends the caller to the check that names each problem (it also decides
    the spans with links). Reads the ids only, where the protobuf runtime would
    make an object per span and per id; raises as :func:`walk_request` does.
    """
    count = 0
    start, stop = _next(data, 0, len(data), 0x0A)  # resource_spans
    while start >= 0:
        scope, scope_stop = _next(data, start, stop, 0x12)  # scope_spans
        while scope >= 0:
            span, span_stop = _next(data, scope, scope_stop, 0x12)  # spans
            while span >= 0:
                if not _ids_well_formed(data, span, span_stop):
                    return -1
                count += 1
                span, span_stop = _next(data, span_stop, scope_stop, 0x12)
            scope, scope_stop = _next(data, scope_stop, stop, 0x12)
        start, stop = _next(data, stop, len(data), 0x0A)
    return count


def _ids_well_formed(data: bytes, pos: int, end: int) -> bool:
    """The span at ``data[pos:end]``: see :func:`well_formed_spans`. A field written
    twice is read as protobuf reads it (the last wins)."""
    trace_at = trace_stop = span_at = span_stop = parent_size = 0
    while pos < end:
        # Most of a span is attributes (field 9): one-byte tags and lengths, read inline.
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = read_varint(data, pos)
        if tag >> 3 == 13:  # links: their ids are for the caller's slow path
            return False
        if tag & 7 == _LEN:
            size = data[pos]
            if size < 0x80:
                pos += 1
            else:
                size, pos = read_varint(data, pos)
            stop = _within(pos, size, end)
            if tag == 0x0A:  # trace_id
                trace_at, trace_stop = pos, stop
            elif tag == 0x12:  # span_id
                span_at, span_stop = pos, stop
            elif tag == 0x22:  # parent_span_id
                parent_size = size
            pos = stop
        else:
            pos = _skip(data, pos, tag, end)
    return (
        trace_stop - trace_at == 16
        and span_stop - span_at == 8
        and (parent_size == 0 or parent_size == 8)  # noqa: PLR1714
        and _not_zero(data, trace_at, trace_stop)
        and _not_zero(data, span_at, span_stop)
    )


def _not_zero(data: bytes, pos: int, end: int) -> bool:
    while pos < end:
        if data[pos]:
            return True
        pos += 1
    return False


def walk_span(data: bytes, pos: int, end: int, watched: frozenset[str]) -> WalkedSpan:  # noqa: PLR0915 - one loop, calls inlined
    """The span whose bytes are ``data[pos:end]`` (see :func:`locate_spans`); raises as
    :func:`walk_request` does."""
    attributes: dict[str, bytes] = {}
    span = WalkedSpan(attributes)
    present: list[str] = []
    events: list[bytes] = []
    status_seen = False
    after = _SPAN_START
    while pos < end:
        # read_varint's and _within's work inline: calls were a tenth of this loop.
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = read_varint(data, pos)
        field = tag >> 3
        if tag & 7 == _LEN and (1 <= field <= 5 or field == 9 or field == 11 or field == 15):  # noqa: PLR1714
            size = data[pos]
            if size < 0x80:
                pos += 1
            else:
                size, pos = read_varint(data, pos)
            stop = pos + size
            if stop > end:
                raise Unsupported("a length past the end of its message")
            if field == 9:
                after = _attribute(
                    data, pos, stop, attributes, present=present, watched=watched, after=after
                )
            elif field == 11:
                events.append(data[pos:stop])
            elif field == 1:
                span.trace_id = data[pos:stop]
            elif field == 2:
                span.span_id = data[pos:stop]
            elif field == 4:
                span.parent_span_id = data[pos:stop]
            elif field == 5:
                span.name = data[pos:stop].decode("utf-8")
            elif field == 15:
                if status_seen:
                    raise Unsupported("status written twice")
                status_seen = True
                span.status = _status(data, pos, stop)
            pos = stop  # field 3, trace_state, is not read
        elif tag == 0x30:  # kind
            value, pos = read_varint(data, pos)
            span.kind = _int32(value)
        elif tag == 0x39 or tag == 0x41:  # noqa: PLR1714 - start, end (fixed64)
            stop = _within(pos, 8, end)
            value = _fixed64(data, pos)
            if tag == 0x39:
                span.start_time_unix_nano = value
            else:
                span.end_time_unix_nano = value
            pos = stop
        elif field in _READ_FIELDS:
            raise Unsupported(f"field {field} with wire type {tag & 7}")
        else:
            pos = _skip(data, pos, tag, end)
    if present:
        span.present = _interned(present)
    if events:
        span._raw_events = events
    return span


#: Span fields read above: any other wire type for them is the runtime's to handle.
_READ_FIELDS: Final = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15})


def _interned(present: list[str]) -> frozenset[str]:
    """One frozenset per distinct list of watched keys: spans of one kind share theirs,
    and its hash, which the screens' memos compute, is computed once."""
    key = tuple(present)
    found = _PRESENT.get(key)
    if found is None:
        found = frozenset(present)
        if len(_PRESENT) >= _MAX_KEYS:
            _PRESENT.clear()  # bounded; rebuilt from the next spans
        _PRESENT[key] = found
    return found


def _attribute(
    data: bytes,
    pos: int,
    end: int,
    attributes: dict[str, bytes],
    *,
    present: list[str],
    watched: frozenset[str],
    after: _Key,
) -> _Key:
    """A ``KeyValue`` read as a map entry: a missing key is "", a missing value b"".

    ``after`` is the key read before this one (see :class:`_Key`); returns this one's.
    """
    key = ""
    entry: _Key | None = None
    value = b""
    seen = 0
    while pos < end:
        tag = data[pos]
        if tag != 0x0A and tag != 0x12:  # noqa: PLR1714 - only key and value
            raise Unsupported("an attribute with other fields")
        size = data[pos + 1]
        if size < 0x80:
            pos += 2
        else:
            size, pos = read_varint(data, pos + 1)
        stop = pos + size  # _within, inline
        if stop > end:
            raise Unsupported("a length past the end of its message")
        if tag == 0x0A:
            if seen & 1:
                raise Unsupported("an attribute key written twice")
            seen |= 1
            raw = data[pos:stop]
            entry = after.following
            if entry is None or entry.raw != raw:
                entry = _KEYS.get(raw)
                if entry is None:
                    entry = _Key(raw, raw.decode("utf-8"))
                    if len(_KEYS) >= _MAX_KEYS:
                        _KEYS.clear()  # bounded; rebuilt from the next spans
                        _SPAN_START.following = _EVENT_START.following = None
                    _KEYS[raw] = entry
                after.following = entry
            key = entry.text
        else:
            if seen & 2:
                raise Unsupported("an attribute value written twice")
            seen |= 2
            value = data[pos:stop]
        pos = stop
    attributes[key] = value  # a repeated key: the last wins, as in a map
    if entry is None:  # no key: read as ""
        if key in watched:
            present.append(key)
        return after
    membership = entry.membership
    if membership is None or membership[0] is not watched:
        membership = entry.membership = (watched, key in watched)
    if membership[1]:
        present.append(key)
    return entry


def _status(data: bytes, pos: int, end: int) -> WalkedStatus:
    code = 0
    message = ""
    while pos < end:
        tag, pos = read_varint(data, pos)
        if tag == 0x12:  # message
            size, pos = read_varint(data, pos)
            stop = _within(pos, size, end)
            message = data[pos:stop].decode("utf-8")
            pos = stop
        elif tag == 0x18:  # code
            value, pos = read_varint(data, pos)
            code = _int32(value)
        elif (tag >> 3) in (2, 3):
            raise Unsupported("a status field with another wire type")
        else:
            pos = _skip(data, pos, tag, end)
    if code == 0 and not message:
        return _OK_STATUS
    return WalkedStatus(code, message)


def _fixed64(data: bytes, pos: int) -> int:
    """Eight little-endian bytes; in native arithmetic (``int.from_bytes`` parses keywords)."""
    low = data[pos] | data[pos + 1] << 8 | data[pos + 2] << 16 | data[pos + 3] << 24
    high = data[pos + 4] | data[pos + 5] << 8 | data[pos + 6] << 16 | data[pos + 7] << 24
    return high << 32 | low


def _int32(value: int) -> int:
    """An int32 field's varint as protobuf reads it (truncated, two's complement)."""
    value &= 0xFFFFFFFF
    return value - 0x100000000 if value >= 0x80000000 else value


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at ``pos``: (value, position after it)."""
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
            raise Unsupported("a varint over ten bytes")


def _within(pos: int, size: int, end: int) -> int:
    stop = pos + size
    if stop > end:
        raise Unsupported("a length past the end of its message")
    return stop


def _skip(data: bytes, pos: int, tag: int, end: int) -> int:
    """The position after a field this reader does not use."""
    wire_type = tag & 7
    if tag >> 3 == 0:
        raise Unsupported("field number 0")
    if wire_type == 0:
        return read_varint(data, pos)[1]
    if wire_type == 1:
        return _within(pos, 8, end)
    if wire_type == _LEN:
        size, pos = read_varint(data, pos)
        return _within(pos, size, end)
    if wire_type == 5:
        return _within(pos, 4, end)
    raise Unsupported(f"wire type {wire_type}")
