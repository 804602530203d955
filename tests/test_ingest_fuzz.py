"""Whatever arrives, ``decode_request`` either decodes it or raises ``IngestError``.

Random bytes, random JSON-ish documents, mutations of valid payloads and
gzip of all of these. Any other exception would escape a receiver as a 500.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from supervisor.errors import IngestError
from supervisor.ingest import codec

PB = "application/x-protobuf"
JS = "application/json"
LIMIT = 1 << 20
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_request() -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "agent"
    scope = rs.scope_spans.add()
    scope.scope.name = "lib"
    for n in range(1, 4):
        span = scope.spans.add(
            trace_id=bytes(range(1, 17)),
            span_id=n.to_bytes(8, "big"),
            parent_span_id=b"" if n == 1 else (1).to_bytes(8, "big"),
            name=f"span {n}",
            kind=n,
            start_time_unix_nano=1_700_000_000_000_000_000 + n,
            end_time_unix_nano=1_700_000_000_000_000_100 + n,
        )
        attr = span.attributes.add(key="k")
        attr.value.array_value.values.add().kvlist_value.values.add(key="x").value.int_value = n
        span.events.add(name="exception").attributes.add(
            key="exception.message"
        ).value.string_value = "boom"
        span.links.add(trace_id=bytes(range(2, 18)), span_id=b"\7" * 8)
        span.status.code = Status.STATUS_CODE_ERROR
    return request


VALID_PB = valid_request().SerializeToString()
VALID_JSON = json.dumps(
    {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "a"}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "lib"},
                        "spans": [
                            {
                                "traceId": "0102030405060708090a0b0c0d0e0f10",
                                "spanId": "0102030405060708",
                                "name": "s",
                                "kind": 2,
                                "startTimeUnixNano": "1",
                                "attributes": [{"key": "n", "value": {"intValue": "5"}}],
                                "links": [
                                    {
                                        "traceId": "0102030405060708090a0b0c0d0e0f10",
                                        "spanId": "0102030405060708",
                                    }
                                ],
                                "status": {"code": 1},
                            }
                        ],
                    }
                ],
            }
        ]
    }
).encode()


def decodes_or_ingest_error(body: bytes, content_type: str, encoding: str = "") -> None:
    try:
        request = codec.decode_request(
            body, content_type=content_type, content_encoding=encoding, max_bytes=LIMIT
        )
    except IngestError as exc:
        assert str(exc)
        assert len(str(exc)) <= 600
        return
    validation = codec.validate_spans(request)
    assert validation.accepted >= 0
    assert validation.rejected >= 0


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 flips a byte, 1 inserts, 2 deletes."""
    buf = bytearray(data)
    for kind, position, value in edits:
        if not buf:
            buf.append(value)
            continue
        at = position % len(buf)
        if kind == 0:
            buf[at] ^= value or 1
        elif kind == 1:
            buf.insert(at, value)
        else:
            del buf[at]
    return bytes(buf)


edits = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)


@FUZZ
@given(st.binary(max_size=512))
@example(b"\x0a\xff\xff\xff\xff\x0f")
@example(b"\x0b" * 64)  # start-group tags
@example(b"\x12" + b"\x80" * 20)  # over-long varint
def test_random_bytes_as_protobuf(body: bytes) -> None:
    decodes_or_ingest_error(body, PB)


@FUZZ
@given(st.binary(max_size=512))
@example(b"\xef\xbb\xbf")
@example(b"\xff\xfe{\x00}\x00")
def test_random_bytes_as_json(body: bytes) -> None:
    decodes_or_ingest_error(body, JS)


@FUZZ
@given(edits)
def test_mutated_valid_protobuf(changes: list[tuple[int, int, int]]) -> None:
    decodes_or_ingest_error(mutate(VALID_PB, changes), PB)


@FUZZ
@given(edits)
def test_mutated_valid_json(changes: list[tuple[int, int, int]]) -> None:
    decodes_or_ingest_error(mutate(VALID_JSON, changes), JS)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(
        ["0102030405060708", "0102030405060708090a0b0c0d0e0f10", "", "zz", "NaN", "1e400"]
    ),
)
otlp_keys = st.sampled_from(
    [
        "resourceSpans",
        "resource_spans",
        "scopeSpans",
        "scope_spans",
        "spans",
        "traceId",
        "trace_id",
        "spanId",
        "parentSpanId",
        "links",
        "name",
        "kind",
        "status",
        "code",
        "attributes",
        "key",
        "value",
        "stringValue",
        "intValue",
        "doubleValue",
        "boolValue",
        "bytesValue",
        "arrayValue",
        "kvlistValue",
        "values",
        "events",
        "startTimeUnixNano",
        "resource",
        "scope",
        "droppedAttributesCount",
        "flags",
        "unknownThing",
    ]
)
json_docs = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(otlp_keys, st.text(max_size=8)), children, max_size=5),
    ),
    max_leaves=40,
)


@FUZZ
@given(st.dictionaries(otlp_keys, json_docs, max_size=4))
def test_random_json_structures(document: dict[str, Any]) -> None:
    decodes_or_ingest_error(json.dumps(document).encode(), JS)


def otlp_shaped(span: dict[str, Any]) -> dict[str, Any]:
    return {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}


@FUZZ
@given(st.dictionaries(otlp_keys, json_docs, max_size=8))
def test_random_spans_inside_a_valid_envelope(span: dict[str, Any]) -> None:
    decodes_or_ingest_error(json.dumps(otlp_shaped(span)).encode(), JS)


@FUZZ
@given(
    st.one_of(st.binary(max_size=256), edits.map(lambda e: mutate(VALID_PB, e))), st.integers(0, 40)
)
def test_gzip_of_random_data_and_its_truncations(payload: bytes, cut: int) -> None:
    compressed = gzip.compress(payload)
    decodes_or_ingest_error(compressed, PB, "gzip")
    decodes_or_ingest_error(compressed[: max(len(compressed) - cut, 0)], PB, "gzip")
    decodes_or_ingest_error(zlib.compress(payload), PB, "deflate")


@FUZZ
@given(st.binary(max_size=256), st.sampled_from(["gzip", "deflate"]))
def test_random_bytes_claiming_compression(body: bytes, encoding: str) -> None:
    decodes_or_ingest_error(body, PB, encoding)
    decodes_or_ingest_error(body, JS, encoding)


@FUZZ
@given(edits)
def test_mutated_gzip_stream(changes: list[tuple[int, int, int]]) -> None:
    decodes_or_ingest_error(mutate(gzip.compress(VALID_PB), changes), PB, "gzip")
