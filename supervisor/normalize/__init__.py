"""Normalization: one view of each span, and one immutable record of it, whatever the convention.

A request is read once (:class:`SpanReader`) into :class:`~.span.Span`
views; every later stage reads those. Each convention has its own adapter
module (:mod:`.openinference`, :mod:`.genai`, :mod:`.openllmetry`,
:mod:`.http_rpc`), the only code that knows attribute names; they fill a
shared :class:`~.attributes.Draft` in that order, each only where the field
is still empty, so the most specific convention wins. :mod:`.evidence`
turns signs of failure into :class:`~supervisor.records.ErrorEvidence`, and
runs only when a span shows one. :mod:`.screen` says which spans may be
failures, so that only those (and the ones a verifier reads) are made into
full records. Normalizing never raises: at worst it returns a record with
fewer fields, and counts the failure (:func:`failures`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

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
from supervisor.normalize.screen import WATCHED_KEYS, may_fail_quietly, shows_failure_signal
from supervisor.normalize.span import (
    MAX_SPAN_NAME,
    Span,
    dependency_and_tool,
    identify,
)
from supervisor.normalize.wire import LazyConverted, LiteRequest, LiteSpan
from supervisor.records import AttrValue, ErrorEvidence, Role, SpanRecord

__all__ = [
    "UNKNOWN_SERVICE",
    "Span",
    "SpanReader",
    "failures",
    "may_fail_quietly",
    "normalize_payload",
    "normalize_request",
    "normalize_span",
    "normalize_view",
    "read_spans",
    "shows_failure_signal",
]

UNKNOWN_SERVICE: Final = "unknown_service"

_STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
#: Events scanned for an ``exception`` event: all of a short list, else the
#: first and last ``_EVENT_SCAN`` (streaming spans may carry one per chunk).
_EVENT_SCAN: Final = 16

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


class SpanReader:
    """The spans of one request, as :class:`Span` views, read a chunk at a time.

    The request is decoded once, with attributes left encoded
    (:data:`.wire.LiteRequest`); each resource's attributes are converted
    once. Reading a chunk at a time keeps a chunk's objects in the caches
    while the screens and the run tracker go over them.
    """

    __slots__ = ("_done", "_spans")

    def __init__(self, request: bytes | Any) -> None:
        """``request``: the encoded ``ExportTraceServiceRequest``, or its lite decoding."""
        self._done = 0
        self._spans = read_spans(request)

    def __len__(self) -> int:
        return len(self._spans)

    def read(self, count: int) -> list[Span]:
        """The next ``count`` spans, fewer at the end; [] once all were read."""
        start = self._done
        self._done = stop = min(start + count, len(self._spans))
        return self._spans[start:stop]


def read_spans(request: bytes | Any) -> list[Span]:
    """Every span of a request (encoded, or decoded with the lite schema), in order."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        request = LiteRequest.FromString(bytes(request))
    watched = WATCHED_KEYS.intersection
    out: list[Span] = []
    for resource_spans in request.resource_spans:
        resource, service = _resource(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            for message in scope_spans.spans:
                out.append(Span(message, resource, service, watched(message.attributes)))
    return out


def normalize_payload(payload: bytes) -> list[SpanRecord]:
    """Every span of an encoded OTLP export request, normalized, in order."""
    return [span.record() for span in read_spans(payload)]


def normalize_request(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Every span of a decoded OTLP export request, normalized, in order."""
    return normalize_payload(request.SerializeToString())


def normalize_span(span: Any, resource_attrs: Mapping[str, AttrValue], service: str) -> SpanRecord:
    """One decoded OTLP ``Span`` as a :class:`SpanRecord`; never raises.

    Read through the same view as a request's spans (its encoding, read again).
    """
    resource = (
        resource_attrs
        if isinstance(resource_attrs, MappingProxyType)
        else MappingProxyType(dict(resource_attrs))
    )
    try:
        message = LiteSpan.FromString(span.SerializeToString())
    except Exception:  # boundary: a record with fewer fields beats a lost span
        _count_failure()
        return _minimal(span, resource, service)
    return Span(message, resource, service, WATCHED_KEYS.intersection(message.attributes)).record()


def normalize_view(span: Span) -> SpanRecord:
    """The record of one span view; never raises (see :meth:`Span.record`)."""
    try:
        return _normalize(span)
    except Exception:  # boundary: a record with fewer fields beats a lost span
        _count_failure()
        return _minimal(span.message, span.resource, span.service)


def _resource(resource: Any) -> tuple[Mapping[str, AttrValue], str]:
    """A ``Resource`` message's attributes, and the service they name."""
    try:
        converted = convert_attributes(resource.attributes).values
    except Exception:  # boundary: odd resources still yield records
        _count_failure()
        converted = {}
    resource = MappingProxyType(converted)
    return resource, as_str(resource.get("service.name")) or UNKNOWN_SERVICE


def _normalize(span: Span) -> SpanRecord:
    message = span.message
    attributes: AttributeSource = LazyConverted(span.attributes)
    attrs = attributes.values
    draft = Draft(attributes)
    keys = span.present
    kind = span.kind
    identify(draft, keys, kind)
    if openinference.MARKER in keys:
        openinference.extract(draft)
    if genai.applies(keys):
        genai.extract(draft)
    if openllmetry.applies(keys):
        openllmetry.extract(draft)
    http_rpc.extract(draft)
    draft.session_id = span.session_id
    role = draft.role or Role.OTHER

    status = message.status
    status_error = status.code == _STATUS_ERROR
    invalid = check_tool_calls(draft.tool_calls, draft.offered_tools) if draft.tool_calls else ()
    http_status = draft.http_status
    error_type = attrs.get(http_rpc.ERROR_TYPE)
    server = kind == http_rpc.SPAN_KIND_SERVER
    failing = (
        status_error
        or bool(invalid)
        or error_type is not None
        or (http_status is not None and http_status >= (500 if server else 400))
        or (draft.grpc_code is not None and draft.grpc_code != 0)
        or (bool(draft.finish_reasons) and failing_finish(draft.finish_reasons))
    )
    exception = _exception_event(message.events) if span.has_events else None
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
            now_ns=span.end_ns,
        )

    name = span.name
    tool_name = dependency_and_tool(draft, role, name)[0]
    service = span.service
    return SpanRecord(
        trace_id=span.trace_hex,
        span_id=message.span_id.hex(),
        parent_span_id=message.parent_span_id.hex(),
        name=name,
        service=service if len(service) <= MAX_NAME_CHARS else service[:MAX_NAME_CHARS],
        kind=kind,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        role=role,
        conventions=tuple(draft.conventions),
        dependency=span.dependency,  # the view's: worked out once, for every stage
        provider=draft.provider,
        model=draft.response_model or draft.request_model,
        tool_name=tool_name,
        tool_args_digest=args_digest(draft.tool_args) if draft.tool_args is not None else "",
        input_tokens=draft.input_tokens,
        output_tokens=draft.output_tokens,
        output_text=draft.output_text,
        session_id=draft.session_id,
        error=error,
        attributes=span.attributes,
        resource_attributes=span.resource,
    )


def _scanned(count: int) -> Any:
    """The indices of events looked at: all, or the first and last ``_EVENT_SCAN``."""
    if count <= 2 * _EVENT_SCAN:
        return range(count)
    return (*range(_EVENT_SCAN), *range(count - _EVENT_SCAN, count))


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
        name=_read(span, "name", lambda n: bounded(str(n), MAX_SPAN_NAME), ""),
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
