"""What ingest says when a payload is wrong: where it stops making sense, in few words.

The person reading the message is debugging an exporter they did not write,
so it names the place (a JSON path, a protobuf field path, a byte offset) and
guesses why (a JSON body sent as protobuf, a gzipped body sent as plain).
These run only after a parser has failed: they favour precision over speed.
Every message is bounded in length (:data:`MAX_MESSAGE`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

#: Longest message we put in an error or a partial-success answer.
MAX_MESSAGE: Final = 512


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


_PARSE_STEP: Final = re.compile(r"Failed to parse (\w+) field: ")


def explain_json_failure(document: dict[str, Any], exc: BaseException) -> str:
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


def explain_protobuf_failure(payload: bytes) -> str:
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
