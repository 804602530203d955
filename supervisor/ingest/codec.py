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
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from supervisor.errors import IngestError, PayloadTooLarge
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

#: Longest message we put in an error or a partial-success answer.
_MAX_MESSAGE: Final = 512

#: Stand-in for an OTLP/JSON id that is not hex. Its length (13) is neither 8
#: nor 16, so validation always rejects it, and it lets validation say *why*.
_INVALID_HEX: Final = b"\xffinvalid-hex\xff"
_ZERO_TRACE: Final = bytes(16)
_ZERO_SPAN: Final = bytes(8)
_HEX: Final = re.compile(r"(?:[0-9a-fA-F]{2})*")


class UnsupportedContentType(IngestError):
    """A Content-Type or Content-Encoding we do not speak (HTTP answers 415)."""


@dataclass(frozen=True, slots=True)
class Validation:
    """What :func:`validate_spans` kept and dropped, for OTLP partial success."""

    accepted: int
    rejected: int
    #: Why spans were rejected, bounded in length; "" when none were.
    message: str


# --------------------------------------------------------------------------- decode


def media_type(content_type: str) -> str:
    """Return the accepted media type named by a Content-Type header.

    Parameters (``; charset=utf-8``) and case are ignored.
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in _MEDIA_TYPES:
        shown = _clip(media, 80) or "(none)"
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
        f"unsupported Content-Encoding {_clip(coding, 80)!r}; accepted: gzip, deflate, identity"
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


def _inflate(body: bytes, wbits: int, name: str, max_bytes: int) -> bytes:
    """Inflate one or more concatenated streams, stopping at ``max_bytes + 1``."""
    out = bytearray()
    data = body
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, max_bytes + 1 - len(out))
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
            raise IngestError(
                f"{name} stream is truncated: it ends after {len(body)} compressed bytes "
                f"({len(out)} decompressed) without its trailer"
            )
        data = inflater.unused_data
        if not data:
            return bytes(out)
        if name != "gzip":
            raise IngestError(f"{len(data)} bytes of trailing data after the {name} stream")
        # gzip allows several members back to back; anything else is garbage,
        # which the next round reports as corrupt.


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
        return LiteRequest.FromString(payload)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise IngestError(_clip(_explain_protobuf_failure(payload), _MAX_MESSAGE)) from exc


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
        raise IngestError(_clip(_explain_protobuf_failure(payload), _MAX_MESSAGE)) from exc
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
        document = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        raise IngestError(
            f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except RecursionError as exc:
        raise IngestError("JSON body is nested too deeply") from exc
    if not isinstance(document, dict):
        raise IngestError(
            f"JSON body must be an object with 'resourceSpans', not {_json_kind(document)}"
        )
    _hex_ids_to_base64(document)
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise IngestError(_clip(_explain_json_failure(document, exc), _MAX_MESSAGE)) from exc
    return request


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
    return _INVALID_HEX


# ------------------------------------------------------------------- validation


def validate_spans(request: Any) -> Validation:
    """Remove, in place, the spans no trace backend could store.

    A span is rejected when its trace_id is not 16 bytes or is all zero, its
    span_id is not 8 bytes or is all zero, its parent_span_id is set but not 8
    bytes, or one of its links has ids of the wrong length. Containers left
    empty by the removal are pruned too.
    """
    accepted = 0
    reasons: Counter[str] = Counter()
    first_at: dict[str, str] = {}
    for r, resource_spans in enumerate(request.resource_spans):
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            bad: list[int] = []
            for i, span in enumerate(scope_spans.spans):
                # Fast path for the well-formed span, which is nearly every span:
                # one comparison per id instead of the checks that name a problem.
                trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
                if (
                    len(trace_id) == 16
                    and len(span_id) == 8
                    and trace_id != _ZERO_TRACE
                    and span_id != _ZERO_SPAN
                    and (not parent or len(parent) == 8)
                    and not span.links
                ):
                    accepted += 1
                    continue
                reason = _span_problem(span)
                if reason is None:
                    accepted += 1
                    continue
                bad.append(i)
                reasons[reason] += 1
                first_at.setdefault(reason, f"resource_spans[{r}].scope_spans[{s}].spans[{i}]")
            for i in reversed(bad):
                del scope_spans.spans[i]
    rejected = sum(reasons.values())
    if rejected:
        _prune_emptied(request)
    return Validation(accepted, rejected, _summarise(accepted, rejected, reasons, first_at))


def _span_problem(span: Any) -> str | None:
    problem = _id_problem("trace_id", span.trace_id, 16) or _id_problem("span_id", span.span_id, 8)
    if problem is None and span.parent_span_id:
        # An all-zero parent is how some exporters spell "root": allowed.
        problem = _id_problem("parent_span_id", span.parent_span_id, 8, allow_zero=True)
    for link in span.links:
        if problem is not None:
            break
        problem = _id_problem("link trace_id", link.trace_id, 16, allow_zero=True) or _id_problem(
            "link span_id", link.span_id, 8, allow_zero=True
        )
    return problem


def _id_problem(name: str, value: bytes, size: int, *, allow_zero: bool = False) -> str | None:
    if value == _INVALID_HEX:
        return f"{name} is not hex (OTLP/JSON ids are hex strings, not base64)"
    if not value:
        return f"{name} is missing"
    if len(value) != size:
        return f"{name} is {len(value)} bytes, want {size}"
    if not allow_zero and not any(value):
        return f"{name} is all zeros"
    return None


def _prune_emptied(request: Any) -> None:
    for resource_spans in request.resource_spans:
        for s in reversed(range(len(resource_spans.scope_spans))):
            if not resource_spans.scope_spans[s].spans:
                del resource_spans.scope_spans[s]
    for r in reversed(range(len(request.resource_spans))):
        if not request.resource_spans[r].scope_spans:
            del request.resource_spans[r]


def _summarise(
    accepted: int, rejected: int, reasons: Counter[str], first_at: dict[str, str]
) -> str:
    if not rejected:
        return ""
    parts = [f"{n} x {why} (first at {first_at[why]})" for why, n in reasons.most_common(3)]
    if len(reasons) > 3:
        parts.append(f"{len(reasons) - 3} other reasons")
    text = f"rejected {rejected} of {accepted + rejected} spans: " + "; ".join(parts)
    return _clip(text, _MAX_MESSAGE)


# ------------------------------------------------------------------------ encode


def encode_response(rejected: int, message: str, *, json: bool) -> bytes:
    """An ExportTraceServiceResponse; ``partial_success`` only when it says something."""
    response = ExportTraceServiceResponse()
    if rejected > 0 or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = _clip(message, _MAX_MESSAGE)
    return _encode(response, as_json=json)


def encode_status(
    code: int, message: str, *, json: bool, retry_after_s: float | None = None
) -> bytes:
    """A ``google.rpc.Status``, the body OTLP/HTTP failures carry.

    ``code`` is a ``google.rpc.Code``; with ``retry_after_s`` the status
    carries a ``google.rpc.RetryInfo`` detail.
    """
    status = status_pb2.Status(code=code, message=_clip(message, _MAX_MESSAGE))
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


# -------------------------------------------------------------- error messages


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_kind(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


_PARSE_STEP: Final = re.compile(r"Failed to parse (\w+) field: ")


def _explain_json_failure(document: dict[str, Any], exc: BaseException) -> str:
    """Name the JSON path of the first value protobuf's JSON parser refused."""
    if isinstance(exc, RecursionError):
        return "JSON body is nested too deeply"
    path = "$" + _locate_json(document)
    detail = str(exc)
    fields = _PARSE_STEP.findall(detail)
    detail = _PARSE_STEP.sub("", detail).strip().rstrip(".")
    last = f".{fields[-1]}" if fields and not path.endswith(fields[-1]) else ""
    if not detail:
        detail = type(exc).__name__
    return f"invalid OTLP/JSON at {path}{last}: {detail}"


def _locate_json(document: dict[str, Any]) -> str:
    """The deepest resource/scope/span whose own parse fails, as a JSON path."""
    levels: tuple[tuple[str, str, Any], ...] = (
        ("resourceSpans", "resource_spans", ResourceSpans),
        ("scopeSpans", "scope_spans", ScopeSpans),
        ("spans", "spans", Span),
    )
    path = ""
    node: object = document
    for camel, snake, message_type in levels:
        if not isinstance(node, dict):
            return path
        key = camel if camel in node else snake
        items = node.get(key)
        if not isinstance(items, list):
            return f"{path}.{key}"
        for i, item in enumerate(items):
            try:
                json_format.ParseDict(item, message_type(), ignore_unknown_fields=True)
            except Exception:  # any failure marks the culprit
                path, node = f"{path}.{key}[{i}]", item
                break
        else:
            return path
    return path


def _explain_protobuf_failure(payload: bytes) -> str:
    """Say where a protobuf payload stops making sense, and guess why."""
    hint = ""
    if payload[:1] in (b"{", b"["):
        hint = " (the body looks like JSON: send Content-Type: application/json)"
    elif payload[:2] == b"\x1f\x8b":
        hint = " (the body looks gzip-compressed: send Content-Encoding: gzip)"
    where = _locate_protobuf(
        payload, 0, len(payload), desc=ExportTraceServiceRequest.DESCRIPTOR, path="", depth=0
    )
    return f"protobuf parse failed ({len(payload)} bytes): {where or 'invalid message'}{hint}"


_MAX_LOCATE_DEPTH: Final = 12


def _locate_protobuf(
    buf: bytes, start: int, end: int, *, desc: Descriptor, path: str, depth: int
) -> str | None:
    """Walk the wire format with the schema and describe the first problem.

    Only runs after the real parser has failed, so it favours a precise
    message over speed; returns None when it finds nothing wrong.
    """
    seen: Counter[int] = Counter()
    pos = start
    while pos < end:
        tag_at = pos
        key, pos = _varint(buf, pos, end)
        if key is None:
            return f"truncated field tag at byte {tag_at}{_in(path)}"
        number, wire = key >> 3, key & 7
        field = desc.fields_by_number.get(number)
        where = _field_path(path, field, number, seen)
        if number == 0:
            return f"invalid field number 0 at byte {tag_at}{_in(path)}"
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            if value is None:
                return f"truncated varint at byte {tag_at} in {where}"
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if size is None:
                return f"truncated length at byte {tag_at} in {where}"
            if pos + size > end:
                return (
                    f"{where} at byte {tag_at} declares {size} bytes but only "
                    f"{end - pos} remain (truncated body?)"
                )
            problem = _check_field(buf, pos, pos + size, field=field, where=where, depth=depth)
            if problem:
                return problem
            pos += size
        else:
            return f"unsupported wire type {wire} at byte {tag_at} in {where}"
        if pos > end:
            return f"{where} at byte {tag_at} runs past the end of its message"
    return None


def _check_field(
    buf: bytes, start: int, end: int, *, field: FieldDescriptor | None, where: str, depth: int
) -> str | None:
    if field is None:
        return None
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            buf[start:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"invalid UTF-8 in string {where} at byte {start + exc.start}"
    elif field.message_type is not None and depth < _MAX_LOCATE_DEPTH:
        return _locate_protobuf(
            buf, start, end, desc=field.message_type, path=where, depth=depth + 1
        )
    return None


def _field_path(path: str, field: FieldDescriptor | None, number: int, seen: Counter[int]) -> str:
    name = field.name if field is not None else f"<field {number}>"
    full = f"{path}.{name}" if path else name
    if field is not None and _is_repeated(field):
        full += f"[{seen[number]}]"
        seen[number] += 1
    return full


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    # protobuf < 6 has no is_repeated; its label says the same.
    return bool(getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED)


def _in(path: str) -> str:
    return f" in {path}" if path else ""


def _varint(buf: bytes, pos: int, end: int) -> tuple[int | None, int]:
    result = 0
    for shift in range(0, 70, 7):
        if pos >= end:
            return None, pos
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
    return None, pos
