"""Write OTLP requests in the formats `spanvisor replay` reads (test helper)."""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _hex_ids(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


def to_otlp_json(request: ExportTraceServiceRequest) -> str:
    """One line of the Collector file exporter's OTLP/JSON (hex ids, integer enums)."""
    as_dict = MessageToDict(request, use_integers_for_enums=True)
    return json.dumps(_hex_ids(as_dict), separators=(",", ":"))


def length_prefixed(requests: list[ExportTraceServiceRequest]) -> bytes:
    """The Collector file exporter's ``format: proto``: 4-byte big-endian lengths."""
    out = bytearray()
    for request in requests:
        body = request.SerializeToString()
        out += len(body).to_bytes(4, "big") + body
    return bytes(out)
