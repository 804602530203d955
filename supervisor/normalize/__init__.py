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

from collections.abc import Iterator, Mapping
from itertools import islice
from types import MappingProxyType
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from supervisor.normalize.attributes import as_str, convert_attributes
from supervisor.normalize.record import count_failure, failures, minimal_record
from supervisor.normalize.screen import WATCHED_KEYS, may_fail_quietly, shows_failure_signal
from supervisor.normalize.span import Span
from supervisor.normalize.wire import LiteRequest, LiteSpan
from supervisor.records import AttrValue, SpanRecord

__all__ = [
    "UNKNOWN_SERVICE",
    "Span",
    "SpanReader",
    "failures",
    "may_fail_quietly",
    "normalize_payload",
    "normalize_request",
    "normalize_span",
    "read_spans",
    "shows_failure_signal",
]

UNKNOWN_SERVICE: Final = "unknown_service"


class SpanReader:
    """The spans of one request, as :class:`Span` views, read a chunk at a time.

    The request is decoded once, with attributes left encoded
    (:data:`.wire.LiteRequest`); each resource's attributes are converted
    once. Reading a chunk at a time keeps a chunk's objects in the caches
    while the screens and the run tracker go over them.
    """

    __slots__ = ("_count", "_spans")

    def __init__(self, request: bytes | Any) -> None:
        """``request``: the encoded ``ExportTraceServiceRequest``, or its lite decoding."""
        request = _lite(request)
        self._count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        # Views are made as chunks are read, so no single read costs the whole request.
        self._spans = _views(request)

    def __len__(self) -> int:
        return self._count

    def read(self, count: int) -> list[Span]:
        """The next ``count`` spans, fewer at the end; [] once all were read."""
        return list(islice(self._spans, count))


def read_spans(request: bytes | Any) -> list[Span]:
    """Every span of a request (encoded, or decoded with the lite schema), in order."""
    return list(_views(_lite(request)))


def _lite(request: bytes | Any) -> Any:
    if isinstance(request, (bytes, bytearray, memoryview)):
        return LiteRequest.FromString(bytes(request))
    return request


def _views(request: Any) -> Iterator[Span]:
    watched = WATCHED_KEYS.intersection
    for resource_spans in request.resource_spans:
        resource, service = _resource(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            for message in scope_spans.spans:
                encoded = message.attributes
                yield Span(message, resource, service, watched(encoded), encoded)


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
        count_failure()
        return minimal_record(span, resource, service)
    return Span(message, resource, service, WATCHED_KEYS.intersection(message.attributes)).record()


def _resource(resource: Any) -> tuple[Mapping[str, AttrValue], str]:
    """A ``Resource`` message's attributes, and the service they name."""
    try:
        converted = convert_attributes(resource.attributes).values
    except Exception:  # boundary: odd resources still yield records
        count_failure()
        converted = {}
    resource = MappingProxyType(converted)
    return resource, as_str(resource.get("service.name")) or UNKNOWN_SERVICE
