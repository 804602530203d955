"""OTLP trace payloads in and out: decode, validate, and encode the answers.

Nothing here trusts its input. Every way a payload can be wrong ends in an
:class:`~supervisor.errors.IngestError` whose message says what was wrong and
where (a JSON path, a protobuf field path, a byte offset), because the person
reading it is debugging an exporter they did not write. Decompression is
bounded so a zip bomb costs at most ``max_bytes`` of memory.

Decisions worth knowing:

* An empty protobuf body is the canonical encoding of an empty request and is
  accepted (zero spans); an empty JSON body is not JSON and is an error (send
  ``{}`` for an empty request).
* OTLP/JSON ids are hex. An id that is not hex does not fail the request: the
  span carrying it is rejected by :func:`validate_spans`, so the rest of the
  batch still gets through (OTLP partial success).
* Spans whose links carry ids of the wrong length are rejected too: such a
  link cannot be resolved by any trace backend.

The messages are written by :mod:`.messages`; the spans' ids are checked by
:mod:`.validation`, whose names this module re-exports.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
import zlib
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from supervisor.errors import IngestError, PayloadTooLarge
from supervisor.ingest.messages import (
    MAX_MESSAGE,
    clip,
    explain_json_failure,
    explain_protobuf_failure,
    json_kind,
)
from supervisor.ingest.slices import SLICE_BYTES, Unsliceable, merge_in_slices
from supervisor.ingest.validation import INVALID_HEX, Validation, validate_spans
from supervisor.normalize.wire import LiteRequest

__all__ = [
    "JSON",
    "PROTOBUF",
    "UnsupportedContentType",
    "Validation",
    "content_coding",
    "decode_payload",
    "decode_request",
    "decode_spans",
    "decompress",
    "encode_response",
    "encode_status",
    "media_type",
    "retry_info",
    "validate_spans",
]

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"
_MEDIA_TYPES: Final[tuple[str, ...]] = (PROTOBUF, JSON)

_HEX: Final = re.compile(r"(?:[0-9a-fA-F]{2})*")


class UnsupportedContentType(IngestError):
    """A Content-Type or Content-Encoding we do not speak (HTTP answers 415)."""


# --------------------------------------------------------------------------- decode


def media_type(content_type: str) -> str:
    """Return the accepted media type named by a Content-Type header.

    Parameters (``; charset=utf-8``) and case are ignored.
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in _MEDIA_TYPES:
        shown = clip(media, 80) or "(none)"
        raise UnsupportedContentType(
            f"unsupported Content-Type {shown!r}; OTLP/HTTP accepts {PROTOBUF!r} or {JSON!r}"
        )
    return media


def content_coding(content_encoding: str) -> str:
    """Normalise a Content-Encoding header to ``identity``, ``gzip`` or ``deflate``.

    ``deflate`` is the zlib format, as HTTP defines it and as the OTel Python
    exporter sends it.
    """
    coding = content_encoding.strip().lower()
    if coding in ("", "identity"):
        return "identity"
    if coding in ("gzip", "x-gzip"):
        return "gzip"
    if coding == "deflate":
        return coding
    raise UnsupportedContentType(
        f"unsupported Content-Encoding {clip(coding, 80)!r}; accepted: gzip, deflate, identity"
    )


def decompress(body: bytes, *, content_encoding: str, max_bytes: int) -> bytes:
    """Undo ``Content-Encoding`` without ever producing more than ``max_bytes``.

    The size limit applies to the decompressed payload: that is what costs
    memory and what the OTLP size limits are about.
    """
    coding = content_coding(content_encoding)
    if coding == "identity":
        payload = body
    elif coding == "gzip":
        payload = _inflate(body, 16 + zlib.MAX_WBITS, "gzip", max_bytes)
    else:
        payload = _inflate(body, zlib.MAX_WBITS, "deflate", max_bytes)
    if len(payload) > max_bytes:
        raise PayloadTooLarge(f"payload is {len(payload)} bytes, over the {max_bytes}-byte limit")
    return payload


#: Most gzip members one body may hold. Real exporters send one; each member
#: costs a fresh inflater, so a body of many empty members (which inflates to
#: nothing) is refused past this instead of being ground through.
MAX_GZIP_MEMBERS: Final = 1024

#: Compressed input is fed to zlib this much at a time: what zlib copies at
#: the end of a member (``unused_data``) is then at most this, not the rest
#: of the body.
_INFLATE_CHUNK: Final = 64 * 1024


def _inflate(body: bytes, wbits: int, name: str, max_bytes: int) -> bytes:
    """Inflate one or more concatenated streams, stopping at ``max_bytes + 1``.

    Linear in the body and bounded in CPU as well as memory: the body is read
    through a ``memoryview`` in :data:`_INFLATE_CHUNK` slices (never copying
    what is left), the output stops past ``max_bytes`` (a bomb), and at most
    :data:`MAX_GZIP_MEMBERS` members are read (a pile of empty ones).
    """
    view = memoryview(body)
    out = bytearray()
    pos = 0
    members = 1
    inflater = zlib.decompressobj(wbits)
    while True:
        chunk = view[pos : pos + _INFLATE_CHUNK]
        if not chunk:
            raise IngestError(
                f"{name} stream is truncated: it ends after {len(body)} compressed bytes "
                f"({len(out)} decompressed) without its trailer"
            )
        try:
            out += inflater.decompress(chunk, max_bytes + 1 - len(out))
        except zlib.error as exc:
            raise IngestError(
                f"{name} data is corrupt after {len(out)} decompressed bytes: {exc}"
            ) from exc
        if len(out) > max_bytes or inflater.unconsumed_tail:
            raise PayloadTooLarge(
                f"payload inflates to more than the {max_bytes}-byte limit "
                f"({len(body)} bytes compressed)"
            )
        if not inflater.eof:
            pos += len(chunk)
            continue
        pos += len(chunk) - len(inflater.unused_data)
        if pos >= len(body):
            return bytes(out)
        if name != "gzip":
            raise IngestError(f"{len(body) - pos} bytes of trailing data after the {name} stream")
        # gzip allows several members back to back; anything else is garbage,
        # which the next round reports as corrupt.
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise IngestError(
                f"gzip body has more than {MAX_GZIP_MEMBERS} members; send one gzip stream"
            )
        inflater = zlib.decompressobj(wbits)


def decode_payload(payload: bytes, *, media: str) -> ExportTraceServiceRequest:
    """Parse an already-decompressed payload of the given media type."""
    if media == JSON:
        return _decode_json(payload)
    return _decode_protobuf(payload)


def decode_spans(payload: bytes) -> Any:
    """The one decoding of a protobuf request that everything after ingest reads.

    An ``ExportTraceServiceRequest`` in the lite schema
    (:data:`supervisor.normalize.wire.LiteRequest`): the same messages, with
    each span's attributes left encoded until a stage reads them. The
    request's structure, strings and ids are checked here; an attribute
    value that does not decode reads as absent where it is read. (OTLP/JSON
    is parsed by :func:`decode_payload`, then read as its protobuf encoding.)
    """
    try:
        if len(payload) > SLICE_BYTES:
            # Big: in slices, so a worker thread decoding it lets the loop run.
            with contextlib.suppress(Unsliceable):
                request = LiteRequest()
                merge_in_slices(request, payload)
                return request
        return LiteRequest.FromString(payload)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise IngestError(clip(explain_protobuf_failure(payload), MAX_MESSAGE)) from exc


def decode_request(
    body: bytes, *, content_type: str, content_encoding: str, max_bytes: int
) -> ExportTraceServiceRequest:
    """Decode an OTLP trace export body as it arrived over HTTP.

    Raises :class:`UnsupportedContentType` for a type or encoding we do not
    speak, :class:`PayloadTooLarge` when the decompressed payload exceeds
    ``max_bytes``, and :class:`IngestError` for anything undecodable.
    """
    media = media_type(content_type)
    payload = decompress(body, content_encoding=content_encoding, max_bytes=max_bytes)
    return decode_payload(payload, media=media)


def _decode_protobuf(payload: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(payload)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise IngestError(clip(explain_protobuf_failure(payload), MAX_MESSAGE)) from exc
    return request


def _decode_json(payload: bytes) -> ExportTraceServiceRequest:
    if not payload.strip():
        raise IngestError("empty JSON body; send {} for an export request with no spans")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IngestError(
            f"JSON body is not valid UTF-8: byte {exc.start} ({payload[exc.start]:#04x}) "
            f"cannot start or continue a character"
        ) from exc
    try:
        # The hook returns each object as it is; being Python, it lets the
        # interpreter hand the GIL over while a big body is parsed in a worker
        # thread (the C parser alone keeps it for the whole document).
        document = json.loads(text.removeprefix("\ufeff"), object_hook=_as_is)
    except json.JSONDecodeError as exc:
        raise IngestError(
            f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except RecursionError as exc:
        raise IngestError("JSON body is nested too deeply") from exc
    if not isinstance(document, dict):
        raise IngestError(
            f"JSON body must be an object with 'resourceSpans', not {json_kind(document)}"
        )
    _hex_ids_to_base64(document)
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise IngestError(clip(explain_json_failure(document, exc), MAX_MESSAGE)) from exc
    return request


def _as_is(value: dict[str, Any]) -> dict[str, Any]:
    return value


# ------------------------------------------------------------------ OTLP/JSON ids

_ID_KEYS: Final[tuple[tuple[str, str], ...]] = (
    ("traceId", "trace_id"),
    ("spanId", "span_id"),
    ("parentSpanId", "parent_span_id"),
)


def _hex_ids_to_base64(document: dict[str, Any]) -> None:
    """Rewrite OTLP/JSON hex ids into the base64 that protobuf's JSON parser wants.

    Walks only the shape OTLP defines; anything of the wrong type is left for
    ``ParseDict`` to report with its path.
    """
    for resource_spans in _items(document, "resourceSpans", "resource_spans"):
        for scope_spans in _items(resource_spans, "scopeSpans", "scope_spans"):
            for span in _items(scope_spans, "spans", "spans"):
                _convert_ids(span)
                for link in _items(span, "links", "links"):
                    _convert_ids(link)


def _items(parent: object, camel: str, snake: str) -> list[Any]:
    if not isinstance(parent, dict):
        return []
    value = parent.get(camel, parent.get(snake))
    return value if isinstance(value, list) else []


def _convert_ids(holder: object) -> None:
    if not isinstance(holder, dict):
        return
    for camel, snake in _ID_KEYS:
        for key in (camel, snake):
            if key in holder and holder[key] is not None:
                holder[key] = base64.b64encode(_hex_id(holder[key])).decode("ascii")


def _hex_id(value: object) -> bytes:
    if isinstance(value, str) and _HEX.fullmatch(value):
        return binascii.unhexlify(value)
    return INVALID_HEX


# ------------------------------------------------------------------------ encode


def encode_response(rejected: int, message: str, *, json: bool) -> bytes:
    """An ExportTraceServiceResponse; ``partial_success`` only when it says something."""
    response = ExportTraceServiceResponse()
    if rejected > 0 or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = clip(message, MAX_MESSAGE)
    return _encode(response, as_json=json)


def encode_status(
    code: int, message: str, *, json: bool, retry_after_s: float | None = None
) -> bytes:
    """A ``google.rpc.Status``, the body OTLP/HTTP failures carry.

    ``code`` is a ``google.rpc.Code``; with ``retry_after_s`` the status
    carries a ``google.rpc.RetryInfo`` detail.
    """
    status = status_pb2.Status(code=code, message=clip(message, MAX_MESSAGE))
    if retry_after_s is not None:
        status.details.add().Pack(retry_info(retry_after_s))
    return _encode(status, as_json=json)


def retry_info(retry_after_s: float) -> error_details_pb2.RetryInfo:
    """A ``google.rpc.RetryInfo`` asking the client to wait ``retry_after_s``."""
    delay = max(retry_after_s, 0.0)
    info = error_details_pb2.RetryInfo()
    info.retry_delay.seconds = int(delay)
    info.retry_delay.nanos = round((delay - int(delay)) * 1e9) % 1_000_000_000
    return info


def _encode(message: Any, *, as_json: bool) -> bytes:
    if as_json:
        return json_format.MessageToJson(message, indent=None).encode("utf-8")
    data: bytes = message.SerializeToString()
    return data


#: google.rpc codes the receivers answer with, re-exported for them.
INVALID_ARGUMENT: Final = code_pb2.INVALID_ARGUMENT
RESOURCE_EXHAUSTED: Final = code_pb2.RESOURCE_EXHAUSTED
UNAVAILABLE: Final = code_pb2.UNAVAILABLE
INTERNAL: Final = code_pb2.INTERNAL
