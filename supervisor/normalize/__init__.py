"""Normalization: one immutable ``SpanRecord`` per span, whatever the convention.

Each convention has its own adapter module (:mod:`.openinference`,
:mod:`.genai`, :mod:`.openllmetry`, :mod:`.http_rpc`); they fill a shared
:class:`~.attributes.Draft` in that order, each only where the field is still
empty, so the most specific convention wins. :mod:`.evidence` turns signs of
failure into :class:`~supervisor.records.ErrorEvidence`, and runs only when a
span shows one, so the ~95% of spans that succeed pay nothing for it.

Two paths give the same records: :func:`normalize_request` for a decoded
request, and the hot path :func:`wire_spans` → :func:`normalize_wire`, which
reads attributes from the wire only when asked (:mod:`.wire`). On the hot
path the pipeline normalizes only the spans :mod:`.screen` passes.
Normalizing never raises: at worst it returns a record with fewer fields,
and counts the failure (:func:`failures`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from supervisor.normalize import genai, http_rpc, openinference, openllmetry
from supervisor.normalize.attributes import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    AttributeSource,
    Draft,
    args_digest,
    as_str,
    bounded,
    convert_attributes,
)
from supervisor.normalize.evidence import (
    SCAN_CHARS,
    Swallowed,
    build_evidence,
    check_tool_calls,
    detect_swallowed,
    failing_finish,
)
from supervisor.normalize.screen import (
    WATCHED_KEYS,
    WireSpan,
    may_fail_quietly,
    shows_failure_signal,
)
from supervisor.normalize.walk import COMPILED as WALK_COMPILED
from supervisor.normalize.walk import (
    Unsupported,
    WalkedSpan,
    event_attributes,
    event_name,
    kind_and_name,
    locate_spans,
    string_value,
    walk_request,
    walk_span,
)
from supervisor.normalize.wire import (
    LazyConverted,
    LiteRequest,
    LiteSpan,
    RawAttributes,
    raw_value,
)
from supervisor.records import AttrValue, ErrorEvidence, Role, SpanRecord

__all__ = [
    "UNKNOWN_SERVICE",
    "SpanReader",
    "WireSpan",
    "dependency_of",
    "failures",
    "lite_spans",
    "may_fail_quietly",
    "normalize_payload",
    "normalize_request",
    "normalize_span",
    "normalize_wire",
    "shows_failure_signal",
    "walked_spans",
    "wire_spans",
]

UNKNOWN_SERVICE: Final = "unknown_service"
_T = TypeVar("_T")

_STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
_SPAN_KIND_SERVER: Final = 2
#: Events scanned for an ``exception`` event: all of a short list, else the
#: first and last ``_EVENT_SCAN`` (streaming spans may carry one per chunk).
_EVENT_SCAN: Final = 16
_MAX_SPAN_NAME: Final = 1024

_logger = logging.getLogger(__name__)
_failures_lock = threading.Lock()
_failures = 0


def failures() -> int:
    """How many spans could not be fully normalized since start (each got a minimal record)."""
    return _failures


def _count_failure() -> None:
    global _failures  # noqa: PLW0603 - a process-wide counter, like the SDK's drop counts
    with _failures_lock:
        _failures += 1
        first = _failures == 1
    if first:
        _logger.exception("span normalization failed; emitting a minimal record (logged once)")


def normalize_request(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Every span of an OTLP export request, normalized, in order."""
    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        resource, service = _resource(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(normalize_span(span, resource, service))
    return out


def normalize_payload(payload: bytes) -> list[SpanRecord]:
    """Every span of an encoded OTLP export request, normalized, in order.

    The hot path: the same records as :func:`normalize_request` gives for the
    decoded request, but span attributes are decoded only when read (see
    :mod:`.wire`). ``payload`` must already have passed ingest's decoding.
    """
    return [normalize_wire(span) for span in wire_spans(payload)]


def wire_spans(payload: bytes) -> list[WireSpan]:
    """The spans of an encoded request, in order, with their resource and service."""
    reader = SpanReader(payload)
    return reader.read(len(reader))


class SpanReader:
    """The spans of one encoded request, read a few at a time.

    Why: a request of 500 spans holds about 700 KB of attributes, more than
    a core's cache. Read whole, each pass over its spans found them evicted,
    and the memory their objects were freed to was cold when the next
    request reused it (allocating the attribute values was an eighth of the
    pipeline's time). Read in chunks, a chunk's objects are still cached
    while the screens and the success bookkeeping run over them, and the
    next chunk reuses the memory they are freed to.

    Compiled, :mod:`.walk` finds the spans and reads each one when asked. A
    span it declines (a layout no encoder writes) is read alone by the
    protobuf runtime with :data:`.wire.LiteSpan`, which parses it as it
    would within the request; a request it cannot even find the spans of
    is read whole by the runtime (:func:`lite_spans`). The spans are the
    same whichever reader ran (``tests/test_normalize_walk.py``).
    """

    __slots__ = ("_done", "_lite", "_payload", "_positions", "_resources")

    def __init__(self, payload: bytes, *, walk: bool = WALK_COMPILED) -> None:
        """``walk`` false: read by the runtime (interpreted, the walker is the slower)."""
        self._payload = payload
        self._done = 0
        self._lite: list[WireSpan] | None = None
        self._resources: list[tuple[Mapping[str, AttrValue], str]] = []
        self._positions: list[int] = []
        if walk:
            try:
                messages, self._positions = locate_spans(payload)
            except (Unsupported, IndexError, UnicodeDecodeError):
                pass
            else:
                self._resources = [_resource(message) for message in messages]
                return
        self._lite = lite_spans(payload)

    def __len__(self) -> int:
        lite = self._lite
        return len(lite) if lite is not None else len(self._positions) // 3

    def read(self, count: int) -> list[WireSpan]:
        """The next ``count`` spans, fewer at the end; [] once all were read."""
        start = self._done
        stop = min(start + count, len(self))
        self._done = max(start, stop)
        lite = self._lite
        if lite is not None:
            return lite[start:stop]
        payload, positions, resources = self._payload, self._positions, self._resources
        out: list[WireSpan] = []
        for i in range(start * 3, stop * 3, 3):
            resource, service = resources[positions[i]]
            begin, end = positions[i + 1], positions[i + 2]
            try:
                span = walk_span(payload, begin, end, WATCHED_KEYS)
            except (Unsupported, IndexError, UnicodeDecodeError):
                alone = LiteSpan.FromString(payload[begin:end])
                encoded = alone.attributes
                out.append((alone, resource, service, WATCHED_KEYS.intersection(encoded), encoded))
                continue
            out.append((span, resource, service, span.present, span.attributes))
        return out


def walked_spans(payload: bytes) -> list[WireSpan]:
    """:func:`wire_spans` by :mod:`.walk`; raises what :func:`.walk.walk_request` raises."""
    out: list[WireSpan] = []
    for resource_message, spans in walk_request(payload, WATCHED_KEYS):
        if not spans:
            continue
        resource, service = _resource(resource_message)
        for span in spans:
            out.append((span, resource, service, span.present, span.attributes))
    return out


def lite_spans(payload: bytes) -> list[WireSpan]:
    """:func:`wire_spans` by the protobuf runtime, with the lite schema."""
    watched = WATCHED_KEYS.intersection
    request = LiteRequest.FromString(payload)
    out: list[WireSpan] = []
    for resource_spans in request.resource_spans:
        resource, service = _resource(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                encoded = span.attributes
                out.append((span, resource, service, watched(encoded), encoded))
    return out


def normalize_wire(item: WireSpan) -> SpanRecord:
    """One span of :func:`wire_spans` as a record; never raises."""
    span, resource, service, _, encoded = item
    try:
        attributes = LazyConverted(RawAttributes(encoded))
        return _normalize(span, resource, service, attributes)
    except Exception:  # boundary: a record with fewer fields beats a lost span
        _count_failure()
        return _minimal(span, resource, service)


def _resource(resource: Any) -> tuple[Mapping[str, AttrValue], str]:
    """A ``Resource`` message's attributes, and the service they name."""
    try:
        converted = convert_attributes(resource.attributes).values
    except Exception:  # boundary: odd resources still yield records
        _count_failure()
        converted = {}
    resource = MappingProxyType(converted)
    return resource, as_str(resource.get("service.name")) or UNKNOWN_SERVICE


def normalize_span(span: Any, resource_attrs: Mapping[str, AttrValue], service: str) -> SpanRecord:
    """One OTLP ``Span`` as a :class:`SpanRecord`; never raises."""
    resource = (
        resource_attrs
        if isinstance(resource_attrs, MappingProxyType)
        else MappingProxyType(dict(resource_attrs))
    )
    try:
        return _normalize(span, resource, service)
    except Exception:  # boundary: a record with fewer fields beats a lost span
        _count_failure()
        return _minimal(span, resource, service)


def _normalize(
    span: Any,
    resource: Mapping[str, AttrValue],
    service: str,
    converted: AttributeSource | None = None,
) -> SpanRecord:
    if converted is None:
        converted = convert_attributes(span.attributes)
    attrs = converted.values
    draft = Draft(converted)
    keys = set(attrs)  # one pass over the keys; the conventions test against it
    kind = span.kind
    _identify(draft, keys, kind)
    if openinference.MARKER in keys:
        openinference.extract(draft)
    if genai.applies(keys):
        genai.extract(draft)
    if openllmetry.applies(keys):
        openllmetry.extract(draft)
    http_rpc.extract(draft)
    role = draft.role or Role.OTHER

    status = span.status
    status_error = status.code == _STATUS_ERROR
    invalid = check_tool_calls(draft.tool_calls, draft.offered_tools) if draft.tool_calls else ()
    http_status = draft.http_status
    error_type = attrs.get("error.type")
    failing = (
        status_error
        or bool(invalid)
        or error_type is not None
        or (http_status is not None and http_status >= (500 if kind == _SPAN_KIND_SERVER else 400))
        or (draft.grpc_code is not None and draft.grpc_code != 0)
        or (bool(draft.finish_reasons) and failing_finish(draft.finish_reasons))
    )
    exception = _exception_of(span)
    swallowed: Swallowed | None = None
    if not failing and exception is None and role is Role.TOOL and draft.output_text:
        swallowed = detect_swallowed(draft.output_text)
    error = None
    if failing or exception is not None or swallowed is not None:
        error = build_evidence(
            status_error=status_error,
            status_message=status.message[:SCAN_CHARS] if status_error else "",
            exception=exception,
            error_type=as_str(error_type),
            http_status=http_status,
            grpc_code=draft.grpc_code,
            finish_reasons=draft.finish_reasons,
            invalid_tool_calls=invalid,
            swallowed=swallowed,
            attrs=attrs,
            now_ns=span.end_time_unix_nano,
        )

    model = draft.response_model or draft.request_model
    provider = draft.provider
    name = span.name
    if len(name) > _MAX_SPAN_NAME:
        name = name[:_MAX_SPAN_NAME]
    tool_name, dependency = _dependency(draft, role, name)
    return SpanRecord(
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        name,
        service if len(service) <= MAX_NAME_CHARS else service[:MAX_NAME_CHARS],
        kind,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        role,
        tuple(draft.conventions),
        dependency,
        provider,
        model,
        tool_name,
        args_digest(draft.tool_args) if draft.tool_args is not None else "",
        draft.input_tokens,
        draft.output_tokens,
        draft.output_text,
        draft.session_id,
        error,
        attrs if isinstance(attrs, RawAttributes) else MappingProxyType(attrs),
        resource,
    )


def _identify(draft: Draft, keys: Collection[str], span_kind: int) -> None:
    """Every convention's idea of the span's role, provider, model, tool and host."""
    if openinference.MARKER in keys:
        openinference.identify(draft)
    if genai.applies(keys):
        genai.identify(draft)
    if openllmetry.applies(keys):
        openllmetry.identify(draft)
    http_rpc.identify(draft, span_kind)


_NO_DEPENDENCY: Final[tuple[Role, ...]] = (Role.AGENT, Role.CHAIN, Role.OTHER)


def _may_have_dependency(attrs: Mapping[str, AttrValue], present: Collection[str]) -> bool:
    """False when the first convention that names the span's role names one without one.

    The conventions are tried in :func:`_identify`'s order, and the first that
    gives a role decides it; only the role is read here.
    """
    if openinference.MARKER in present:
        return openinference.kind_role(attrs.get(openinference.MARKER)) not in _NO_DEPENDENCY
    if genai.applies(present):
        role = genai.role_of(attrs)
        if role is not None:
            return role not in _NO_DEPENDENCY
    if openllmetry.applies(present):
        role = openllmetry.role_of(attrs)
        if role is not None:
            return role not in _NO_DEPENDENCY
    return True  # HTTP/RPC or nothing: identify decides


def _dependency(draft: Draft, role: Role, name: str) -> tuple[str, str]:
    """The tool name and the ``dependency`` key of an identified span."""
    tool_name = draft.tool_name
    if not tool_name and role is Role.TOOL:
        tool_name = name[:MAX_NAME_CHARS]  # a tool span without a tool name is named after it
    if role is Role.LLM:
        provider = draft.provider
        model = draft.response_model or draft.request_model
        dependency = f"{provider or 'unknown'}:{model or 'unknown'}" if provider or model else ""
    elif role is Role.TOOL:
        dependency = f"tool:{tool_name}" if tool_name else ""
    elif role is Role.HTTP:
        dependency = f"http:{draft.host}" if draft.host else ""
    else:
        dependency = ""
    return tool_name, dependency


def _raw_values(encoded: Any, keys: tuple[str, ...]) -> tuple[bytes | None, ...]:
    return tuple([raw_value(encoded, key) for key in keys])


def dependency_of(item: WireSpan) -> str:
    """A span's ``dependency`` without normalizing it: what breakers count successes by.

    Reads only the attributes that name the dependency, through the same
    adapter functions as :func:`normalize_wire`, so both give the same key.
    Never raises (``""`` for a span that cannot be read).
    """
    span, _, _, present, encoded = item
    try:
        kind, name = kind_and_name(span)
        server = kind == _SPAN_KIND_SERVER
        reads = _READS.get(present)
        if reads is not None:
            keys, uses_name = reads
            memo_key = (
                present,
                server,
                keys,
                _raw_values(encoded, keys),
                uses_name and name,
            )
            found = _IDENTITIES.get(memo_key)
            if found is not None:
                return found
        recorder = _Recorder(RawAttributes(encoded))
        dependency, uses_name = _identified(recorder, present, kind, name)
        keys = tuple(dict.fromkeys(recorder.read))
        if len(_READS) >= _MEMO_ENTRIES or len(_IDENTITIES) >= _MEMO_ENTRIES:
            _READS.clear()  # bounded; rebuilt from the next spans
            _IDENTITIES.clear()
        _READS[present] = (keys, uses_name)
        values = _raw_values(encoded, keys)
        _IDENTITIES[(present, server, keys, values, uses_name and name)] = dependency
        return dependency
    except Exception:  # boundary: an unreadable span counts for no dependency
        return ""


#: dependency_of's memo. What the adapters read to name a span's dependency is
#: a pure function of the attribute values they read (and the span's kind and,
#: for an unnamed tool, its name), so a span that gives the same encoded values
#: to the same keys has the same dependency. Agents make the same calls over and
#: over; a lookup of those values costs a third of reading them.
#: present keys -> (keys read last time, whether the span name was used)
_READS: Final[dict[frozenset[str], tuple[tuple[str, ...], bool]]] = {}
_IDENTITIES: Final[dict[tuple[object, ...], str]] = {}
_MEMO_ENTRIES: Final = 4096


class _Recorder(Mapping[str, AttrValue]):
    """The attributes as the adapters read them, remembering every key they look at."""

    __slots__ = ("_raw", "read")

    def __init__(self, raw: RawAttributes) -> None:
        self._raw = raw
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return self._raw.get(key, default)

    def full(self, key: str) -> AttrValue:
        self.read.append(key)
        return self._raw.full(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.append(key)
        return key in self._raw

    def __getitem__(self, key: str) -> AttrValue:
        self.read.append(key)
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        raise TypeError("identify must look attributes up by key (dependency_of memoizes them)")

    def __len__(self) -> int:
        return len(self._raw)


class _RecordingSource:
    """:class:`LazyConverted`'s interface over a :class:`_Recorder`."""

    __slots__ = ("full", "values")

    def __init__(self, recorder: _Recorder) -> None:
        self.values = recorder
        self.full = recorder.full

    def read(self, key: str, parse: Callable[[AttrValue], _T]) -> _T:
        return parse(self.full(key))


def _identified(
    attrs: _Recorder, present: Collection[str], span_kind: int, name: str
) -> tuple[str, bool]:
    """The dependency, and whether the span's name went into it."""
    if not _may_have_dependency(attrs, present):
        return "", False  # an agent, chain or unlabelled span: most of a trace, read cheaply
    draft = Draft(_RecordingSource(attrs))
    _identify(draft, present, span_kind)
    role = draft.role
    if role is None or role is Role.AGENT or role is Role.CHAIN or role is Role.OTHER:
        return "", False
    uses_name = role is Role.TOOL and not draft.tool_name
    return _dependency(draft, role, name[:_MAX_SPAN_NAME])[1], uses_name


def _exception_of(span: Any) -> tuple[str, str] | None:
    """Type and message of the span's first ``exception`` event, if any.

    A walked span's events are read from their encoding: parsing them with the
    runtime was a fifth of normalizing a failing span. Any layout the walker
    declines is read by the runtime, which gives the same answer.
    """
    raw_events = span._raw_events if isinstance(span, WalkedSpan) else None
    if raw_events is not None:
        try:
            return _walked_exception_event(raw_events)
        except (Unsupported, IndexError, UnicodeDecodeError):
            pass
    return _exception_event(span.events) if len(span.events) else None


def _scanned(count: int) -> Any:
    """The indices of events looked at: all, or the first and last ``_EVENT_SCAN``."""
    if count <= 2 * _EVENT_SCAN:
        return range(count)
    return (*range(_EVENT_SCAN), *range(count - _EVENT_SCAN, count))


def _walked_exception_event(raw_events: list[bytes]) -> tuple[str, str] | None:
    """:func:`_exception_event` of encoded events; raises as the walker does."""
    for i in _scanned(len(raw_events)):
        raw = raw_events[i]
        if event_name(raw) != "exception":
            continue
        attributes = event_attributes(raw)
        exc_type = _string_of(attributes, "exception.type")
        message = _string_of(attributes, "exception.message")
        if not exc_type:
            exc_type = _last_traceback_type(_string_of(attributes, "exception.stacktrace"))
        return bounded(exc_type, MAX_NAME_CHARS), message[:SCAN_CHARS]
    return None


def _string_of(attributes: dict[str, bytes], key: str) -> str:
    encoded = attributes.get(key)
    return string_value(encoded) if encoded is not None else ""


def _exception_event(events: Any) -> tuple[str, str] | None:
    """Type and message of the first ``exception`` event, if any."""
    for i in _scanned(len(events)):
        event = events[i]
        if event.name != "exception":
            continue
        exc_type = message = ""
        traceback: Any = None  # read only without a type: a stack trace can be long
        for kv in event.attributes:
            key = kv.key
            if key == "exception.type":
                exc_type = kv.value.string_value
            elif key == "exception.message":
                message = kv.value.string_value
            elif key == "exception.stacktrace":
                traceback = kv
        if not exc_type and traceback is not None:
            exc_type = _last_traceback_type(traceback.value.string_value)
        return bounded(exc_type, MAX_NAME_CHARS), message[:SCAN_CHARS]
    return None


def _last_traceback_type(stacktrace: str) -> str:
    found = detect_swallowed(stacktrace[-SCAN_CHARS:]) if "Traceback" in stacktrace else None
    return found.exception_type if found is not None else ""


def _minimal(span: Any, resource: Mapping[str, AttrValue], service: str) -> SpanRecord:
    """The fields that can still be read, for a span whose attributes could not be."""
    return SpanRecord(
        trace_id=_read(span, "trace_id", bytes.hex, ""),
        span_id=_read(span, "span_id", bytes.hex, ""),
        parent_span_id=_read(span, "parent_span_id", bytes.hex, ""),
        name=_read(span, "name", lambda n: bounded(str(n), _MAX_SPAN_NAME), ""),
        service=bounded(str(service), MAX_NAME_CHARS),
        kind=_read(span, "kind", int, 0),
        start_ns=_read(span, "start_time_unix_nano", int, 0),
        end_ns=_read(span, "end_time_unix_nano", int, 0),
        role=Role.OTHER,
        resource_attributes=resource,
        error=_read(span, "status", _status_only, None),
    )


def _read(span: Any, name: str, convert: Any, default: Any) -> Any:
    """One field of a span, converted; ``default`` if it cannot be read."""
    try:
        return convert(getattr(span, name))
    except Exception:  # each field on its own: keep what can be read
        return default


def _status_only(status: Any) -> ErrorEvidence | None:
    if status.code != _STATUS_ERROR:
        return None
    return ErrorEvidence(
        status_error=True, status_message=bounded(status.message, MAX_MESSAGE_CHARS)
    )
