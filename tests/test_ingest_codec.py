"""The OTLP codec: decoding every accepted form, refusing the rest with a useful message."""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from typing import Any

import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from supervisor.errors import IngestError, PayloadTooLarge
from supervisor.ingest import codec
from supervisor.ingest.codec import UnsupportedContentType, Validation

PB = "application/x-protobuf"
JS = "application/json"
TRACE = bytes.fromhex("0102030405060708090a0b0c0d0e0f10")
SPAN = bytes.fromhex("1112131415161718")
PARENT = bytes.fromhex("2122232425262728")
BIG = 10_000_000


def make_request(*spans: dict[str, Any]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for fields in spans:
        scope.spans.add(**fields)
    return request


def good_span(n: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "trace_id": TRACE,
        "span_id": n.to_bytes(8, "big"),
        "name": f"span-{n}",
        **extra,
    }


def decode(
    body: bytes, ct: str = PB, ce: str = "", max_bytes: int = BIG
) -> ExportTraceServiceRequest:
    return codec.decode_request(body, content_type=ct, content_encoding=ce, max_bytes=max_bytes)


def names(request: ExportTraceServiceRequest) -> list[str]:
    return [
        span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans
    ]


# ----------------------------------------------------------------- content types


@pytest.mark.parametrize(
    "content_type",
    [
        PB,
        "application/x-protobuf; charset=utf-8",
        "APPLICATION/X-PROTOBUF",
        " application/x-protobuf ",
    ],
)
def test_protobuf_content_type_variants_decode(content_type: str) -> None:
    request = make_request(good_span(1))
    assert request == decode(request.SerializeToString(), ct=content_type)


@pytest.mark.parametrize(
    "content_type", [JS, "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_content_type_variants_decode(content_type: str) -> None:
    assert names(
        decode(b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"a"}]}]}]}', ct=content_type)
    ) == ["a"]


@pytest.mark.parametrize(
    "content_type", ["", "text/plain", "application/grpc", "application/protobuf2", "json"]
)
def test_unsupported_content_type_names_the_accepted_ones(content_type: str) -> None:
    with pytest.raises(UnsupportedContentType) as info:
        decode(b"", ct=content_type)
    assert "application/x-protobuf" in str(info.value)
    assert "application/json" in str(info.value)


def test_unsupported_content_encoding_is_refused() -> None:
    with pytest.raises(UnsupportedContentType) as info:
        decode(b"x", ce="br")
    assert str(info.value) == "unsupported Content-Encoding 'br'; accepted: gzip, deflate, identity"


# ----------------------------------------------------------------- compression


@pytest.mark.parametrize("encoding", ["gzip", "GZIP", "x-gzip"])
def test_gzip_body_decodes(encoding: str) -> None:
    request = make_request(good_span(1), good_span(2))
    assert request == decode(gzip.compress(request.SerializeToString()), ce=encoding)


def test_deflate_body_decodes_as_zlib_like_the_python_exporter_sends() -> None:
    request = make_request(good_span(1))
    assert request == decode(zlib.compress(request.SerializeToString()), ce="deflate")


@pytest.mark.parametrize("encoding", ["", "identity", " Identity "])
def test_identity_encodings_pass_through(encoding: str) -> None:
    request = make_request(good_span(3))
    assert request == decode(request.SerializeToString(), ce=encoding)


def test_multi_member_gzip_is_concatenated() -> None:
    raw = make_request(good_span(1)).SerializeToString()
    body = gzip.compress(raw[:10]) + gzip.compress(raw[10:])
    assert make_request(good_span(1)) == decode(body, ce="gzip")


def test_truncated_gzip_says_truncated() -> None:
    body = gzip.compress(make_request(good_span(1)).SerializeToString())[:-6]
    with pytest.raises(IngestError) as info:
        decode(body, ce="gzip")
    assert "gzip stream is truncated" in str(info.value)
    assert not isinstance(info.value, PayloadTooLarge)


def test_corrupt_gzip_is_an_ingest_error() -> None:
    body = bytearray(gzip.compress(b"hello world" * 100))
    body[12:20] = b"\xff" * 8
    with pytest.raises(IngestError) as info:
        decode(bytes(body), ce="gzip")
    assert "gzip data is corrupt" in str(info.value)


def test_not_gzip_at_all_is_an_ingest_error() -> None:
    with pytest.raises(IngestError) as info:
        decode(b"plain text, not gzip", ce="gzip")
    assert "gzip data is corrupt after 0 decompressed bytes" in str(info.value)


def test_garbage_after_gzip_stream_is_refused() -> None:
    with pytest.raises(IngestError):
        decode(gzip.compress(b"") + b"garbage!", ce="gzip")


def test_gzip_bomb_stops_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * 50_000_000)  # ~50 KB on the wire
    with pytest.raises(PayloadTooLarge) as info:
        decode(bomb, ce="gzip", max_bytes=1_000_000)
    assert "more than the 1000000-byte limit" in str(info.value)


def test_limit_applies_after_decompression_exactly() -> None:
    raw = make_request(good_span(1)).SerializeToString()
    assert make_request(good_span(1)) == decode(gzip.compress(raw), ce="gzip", max_bytes=len(raw))
    with pytest.raises(PayloadTooLarge):
        decode(gzip.compress(raw), ce="gzip", max_bytes=len(raw) - 1)


def test_uncompressed_over_limit_is_payload_too_large() -> None:
    raw = make_request(good_span(1)).SerializeToString()
    assert make_request(good_span(1)) == decode(raw, max_bytes=len(raw))
    with pytest.raises(PayloadTooLarge) as info:
        decode(raw, max_bytes=len(raw) - 1)
    assert f"payload is {len(raw)} bytes, over the {len(raw) - 1}-byte limit" == str(info.value)


# ----------------------------------------------------------------- protobuf


def test_empty_protobuf_body_is_an_empty_request() -> None:
    assert ExportTraceServiceRequest() == decode(b"")


def test_truncated_protobuf_names_the_field_and_offset() -> None:
    raw = make_request(good_span(1)).SerializeToString()
    with pytest.raises(IngestError) as info:
        decode(raw[:-4])
    message = str(info.value)
    assert message.startswith(
        f"protobuf parse failed ({len(raw) - 4} bytes): resource_spans[0] at byte 0"
    )
    assert "truncated body?" in message


def test_invalid_utf8_in_protobuf_string_names_the_field() -> None:
    raw = bytearray(make_request(good_span(1, name="caf\u00e9")).SerializeToString())
    at = raw.index("caf\u00e9".encode())
    raw[at + 3] = 0xFF
    with pytest.raises(IngestError) as info:
        decode(bytes(raw))
    assert "invalid UTF-8 in string resource_spans[0].scope_spans[0].spans[0].name" in str(
        info.value
    )


def test_json_sent_as_protobuf_gets_a_hint() -> None:
    with pytest.raises(IngestError) as info:
        decode(b'{"resourceSpans": []}')
    assert "send Content-Type: application/json" in str(info.value)


def test_gzip_sent_without_content_encoding_gets_a_hint() -> None:
    with pytest.raises(IngestError) as info:
        decode(gzip.compress(make_request(good_span(1)).SerializeToString()))
    assert "send Content-Encoding: gzip" in str(info.value)


def test_huge_declared_length_is_reported_not_allocated() -> None:
    body = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length 2**32-1
    with pytest.raises(IngestError) as info:
        decode(body)
    assert "declares 4294967295 bytes but only 0 remain" in str(info.value)


def test_unknown_protobuf_fields_are_kept_for_forwarding() -> None:
    raw = make_request(good_span(1)).SerializeToString() + b"\xf8\x01\x05"  # field 31 varint
    request = decode(raw)
    assert raw == request.SerializeToString()


# ----------------------------------------------------------------- OTLP/JSON


HAND_JSON = {
    "resourceSpans": [
        {
            "resource": {
                "attributes": [{"key": "service.name", "value": {"stringValue": "agent"}}]
            },
            "scopeSpans": [
                {
                    "scope": {"name": "lib", "version": "1.0"},
                    "spans": [
                        {
                            "traceId": TRACE.hex(),
                            "spanId": SPAN.hex(),
                            "parentSpanId": PARENT.hex(),
                            "name": "chat gpt-4o",
                            "kind": 3,
                            "startTimeUnixNano": "1700000000000000000",
                            "endTimeUnixNano": 1700000000500000000,
                            "attributes": [
                                {"key": "gen_ai.request.model", "value": {"stringValue": "gpt-4o"}},
                                {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "42"}},
                            ],
                            "status": {"code": 2, "message": "rate limited"},
                            "links": [{"traceId": TRACE.hex().upper(), "spanId": PARENT.hex()}],
                            "events": [
                                {"name": "exception", "timeUnixNano": "1700000000100000000"}
                            ],
                            "someFutureField": {"nested": [1, 2, 3]},
                        }
                    ],
                }
            ],
        }
    ]
}


def hand_protobuf() -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    attr = rs.resource.attributes.add(key="service.name")
    attr.value.string_value = "agent"
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "lib", "1.0"
    span = ss.spans.add(
        trace_id=TRACE,
        span_id=SPAN,
        parent_span_id=PARENT,
        name="chat gpt-4o",
        kind=Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=1700000000000000000,
        end_time_unix_nano=1700000000500000000,
    )
    span.attributes.add(key="gen_ai.request.model").value.string_value = "gpt-4o"
    span.attributes.add(key="gen_ai.usage.input_tokens").value.int_value = 42
    span.status.code = Status.STATUS_CODE_ERROR
    span.status.message = "rate limited"
    span.links.add(trace_id=TRACE, span_id=PARENT)
    span.events.add(name="exception", time_unix_nano=1700000000100000000)
    return request


def test_hand_written_otlp_json_equals_the_protobuf() -> None:
    body = json.dumps(HAND_JSON).encode()
    assert hand_protobuf() == decode(body, ct=JS)


def test_snake_case_keys_and_enum_names_are_accepted() -> None:
    body = {
        "resource_spans": [
            {
                "scope_spans": [
                    {
                        "spans": [
                            {
                                "trace_id": TRACE.hex(),
                                "span_id": SPAN.hex(),
                                "parent_span_id": PARENT.hex(),
                                "name": "chat gpt-4o",
                                "kind": "SPAN_KIND_CLIENT",
                                "status": {"code": "STATUS_CODE_ERROR"},
                            }
                        ]
                    }
                ]
            }
        ]
    }
    expected = make_request(
        {
            "trace_id": TRACE,
            "span_id": SPAN,
            "parent_span_id": PARENT,
            "name": "chat gpt-4o",
            "kind": Span.SPAN_KIND_CLIENT,
            "status": {"code": 2},
        }
    )
    assert expected == decode(json.dumps(body).encode(), ct=JS)


def test_json_byte_order_mark_is_tolerated() -> None:
    assert names(
        decode(b'\xef\xbb\xbf{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"a"}]}]}]}', ct=JS)
    ) == ["a"]


def test_empty_json_object_is_an_empty_request() -> None:
    assert ExportTraceServiceRequest() == decode(b"{}", ct=JS)


@pytest.mark.parametrize("body", [b"", b"   \n"])
def test_empty_json_body_is_an_error(body: bytes) -> None:
    with pytest.raises(IngestError) as info:
        decode(body, ct=JS)
    assert str(info.value) == "empty JSON body; send {} for an export request with no spans"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"resourceSpans": [', "malformed JSON at line 1 column 20: Expecting value"),
        (b"[]", "JSON body must be an object with 'resourceSpans', not an array"),
        (b'"x"', "JSON body must be an object with 'resourceSpans', not a string"),
        (b"null", "JSON body must be an object with 'resourceSpans', not null"),
        (b"12", "JSON body must be an object with 'resourceSpans', not a number"),
    ],
)
def test_malformed_json_says_where(body: bytes, expected: str) -> None:
    with pytest.raises(IngestError) as info:
        decode(body, ct=JS)
    assert expected == str(info.value)


def test_json_type_error_names_the_json_path() -> None:
    body = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"ok"},{"name":7}]}]}]}'
    with pytest.raises(IngestError) as info:
        decode(body, ct=JS)
    assert str(info.value).startswith(
        "invalid OTLP/JSON at $.resourceSpans[0].scopeSpans[0].spans[1].name:"
    )


def test_invalid_utf8_in_json_names_the_byte() -> None:
    with pytest.raises(IngestError) as info:
        decode(b'{"resourceSpans": "\xc3\x28"}', ct=JS)
    assert (
        str(info.value)
        == "JSON body is not valid UTF-8: byte 19 (0xc3) cannot start or continue a character"
    )


def test_lone_surrogate_in_json_is_an_ingest_error() -> None:
    body = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"a\\udc00"}]}]}]}'
    with pytest.raises(IngestError) as info:
        decode(body, ct=JS)
    assert "spans[0].name" in str(info.value)


def test_deeply_nested_json_is_an_ingest_error() -> None:
    body = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with pytest.raises(IngestError) as info:
        decode(body, ct=JS)
    assert str(info.value) == "JSON body is nested too deeply"


def test_error_messages_are_bounded() -> None:
    body = json.dumps(
        {
            "resourceSpans": [
                {"scopeSpans": [{"spans": [{"name": "x", "startTimeUnixNano": "K" * 100_000}]}]}
            ]
        }
    )
    with pytest.raises(IngestError) as info:
        decode(body.encode(), ct=JS)
    assert len(str(info.value)) <= 512


def test_base64_ids_in_json_reject_only_that_span_with_a_hint() -> None:
    spans = [
        {"traceId": base64.b64encode(TRACE).decode(), "spanId": SPAN.hex(), "name": "b64"},
        {"traceId": TRACE.hex(), "spanId": SPAN.hex(), "name": "hex"},
    ]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()
    request = decode(body, ct=JS)
    validation = codec.validate_spans(request)
    assert (
        Validation(
            accepted=1,
            rejected=1,
            message="rejected 1 of 2 spans: 1 x trace_id is not hex (OTLP/JSON ids are hex "
            "strings, not base64) (first at resource_spans[0].scope_spans[0].spans[0])",
        )
        == validation
    )
    assert names(request) == ["hex"]


@pytest.mark.parametrize(
    "bad", ["0x0102030405060708", "01 02 03 04 05 06 07 08", "0102030405060", 12345, True]
)
def test_non_hex_parent_id_rejects_the_span_not_the_request(bad: object) -> None:
    spans = [{"traceId": TRACE.hex(), "spanId": SPAN.hex(), "parentSpanId": bad, "name": "x"}]
    request = decode(
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode(), ct=JS
    )
    validation = codec.validate_spans(request)
    assert (validation.accepted, validation.rejected) == (0, 1)
    assert "parent_span_id" in validation.message


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"trace_id": b""}, "trace_id is missing"),
        ({"trace_id": b"\0" * 16}, "trace_id is all zeros"),
        ({"trace_id": TRACE[:8]}, "trace_id is 8 bytes, want 16"),
        ({"span_id": b""}, "span_id is missing"),
        ({"span_id": b"\0" * 8}, "span_id is all zeros"),
        ({"span_id": TRACE}, "span_id is 16 bytes, want 8"),
        ({"parent_span_id": b"\1\2\3"}, "parent_span_id is 3 bytes, want 8"),
        ({"links": [{"trace_id": TRACE, "span_id": b"\1"}]}, "link span_id is 1 bytes, want 8"),
        ({"links": [{"trace_id": b"", "span_id": SPAN}]}, "link trace_id is missing"),
    ],
)
def test_validate_rejects_each_bad_id(fields: dict[str, Any], reason: str) -> None:
    request = make_request(good_span(1), good_span(2, **{**good_span(2), **fields}), good_span(3))
    validation = codec.validate_spans(request)
    expected = (
        f"rejected 1 of 3 spans: 1 x {reason} (first at resource_spans[0].scope_spans[0].spans[1])"
    )
    assert Validation(accepted=2, rejected=1, message=expected) == validation
    assert names(request) == ["span-1", "span-3"]


def test_validate_allows_all_zero_parent_and_zero_link_ids() -> None:
    request = make_request(
        good_span(
            1, parent_span_id=b"\0" * 8, links=[{"trace_id": b"\0" * 16, "span_id": b"\0" * 8}]
        )
    )
    assert Validation(1, 0, "") == codec.validate_spans(request)


def test_validate_prunes_containers_it_emptied_and_keeps_the_rest_in_order() -> None:
    request = ExportTraceServiceRequest()
    for r in range(3):
        rs = request.resource_spans.add()
        for s in range(2):
            ss = rs.scope_spans.add()
            for i in range(3):
                bad = r == 1 or (s == 0 and i != 1)
                ss.spans.add(**good_span(r * 100 + s * 10 + i, trace_id=b"" if bad else TRACE))
    validation = codec.validate_spans(request)
    assert (validation.accepted, validation.rejected) == (8, 10)
    expected = [
        "span-1",
        "span-10",
        "span-11",
        "span-12",
        "span-201",
        "span-210",
        "span-211",
        "span-212",
    ]
    assert expected == names(request)
    assert [len(rs.scope_spans) for rs in request.resource_spans] == [2, 2]


def test_validate_summarises_many_reasons_in_bounded_text() -> None:
    spans = [good_span(i, trace_id=bytes([i]) * (i % 15 + 1)) for i in range(1, 200)]
    validation = codec.validate_spans(make_request(*spans))
    assert validation.rejected == 199
    assert validation.message.startswith("rejected 199 of 199 spans: ")
    assert "other reasons" in validation.message
    assert len(validation.message) <= 512


def test_validate_on_good_request_changes_nothing() -> None:
    request = make_request(good_span(1), good_span(2, parent_span_id=PARENT))
    before = request.SerializeToString()
    assert Validation(2, 0, "") == codec.validate_spans(request)
    assert before == request.SerializeToString()


# ----------------------------------------------------------------- encoders


def test_encode_response_without_rejections_is_empty() -> None:
    assert codec.encode_response(0, "", json=False) == b""
    assert codec.encode_response(0, "", json=True) == b"{}"


def test_encode_response_carries_partial_success() -> None:
    response = ExportTraceServiceResponse.FromString(
        codec.encode_response(3, "bad ids", json=False)
    )
    assert (response.partial_success.rejected_spans, response.partial_success.error_message) == (
        3,
        "bad ids",
    )
    as_json = json.loads(codec.encode_response(3, "bad ids", json=True))
    assert as_json == {"partialSuccess": {"rejectedSpans": "3", "errorMessage": "bad ids"}}


def test_encode_status_with_retry_info_round_trips() -> None:
    status = status_pb2.Status.FromString(
        codec.encode_status(14, "full", json=False, retry_after_s=1.25)
    )
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert (status.code, status.message, info.retry_delay.seconds, info.retry_delay.nanos) == (
        14,
        "full",
        1,
        250_000_000,
    )
    as_json = json.loads(codec.encode_status(14, "full", json=True, retry_after_s=1.25))
    assert as_json == {
        "code": 14,
        "message": "full",
        "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1.250s"}],
    }


def test_encode_status_without_retry_has_no_details() -> None:
    status = json_format.Parse(codec.encode_status(3, "bad", json=True), status_pb2.Status())
    assert status_pb2.Status(code=3, message="bad") == status
