"""Attributes left encoded until read decode exactly as the protobuf runtime's messages convert."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from supervisor.normalize import normalize_payload
from supervisor.normalize.attributes import convert_attributes
from supervisor.normalize.wire import LiteRequest, RawAttributes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.spans import make_requests


def same_records(request: ExportTraceServiceRequest) -> None:
    """Each record's attributes are the runtime's conversion of the decoded span's."""
    records = normalize_payload(request.SerializeToString())
    spans = [
        span
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    assert len(records) == len(spans)
    for record, span in zip(records, spans, strict=True):
        assert (record.trace_id, record.span_id) == (span.trace_id.hex(), span.span_id.hex())
        assert dict(record.attributes) == dict(convert_attributes(span.attributes).values)


def test_generated_realistic_requests_normalize_alike() -> None:
    for payload in make_requests(6, 200, failure_rate=0.2, seed=9):
        same_records(ExportTraceServiceRequest.FromString(payload))


scalars = st.one_of(
    st.text(max_size=40),
    st.text(min_size=1, max_size=5).map(lambda t: t * 3000),  # over MAX_VALUE_CHARS
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=20),
    st.none(),
)


def any_value(value: object) -> AnyValue:
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    assert isinstance(value, dict)
    return AnyValue(
        kvlist_value=KeyValueList(
            values=[KeyValue(key=k, value=any_value(v)) for k, v in value.items()]
        )
    )


values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=8), scalars, max_size=3),
)
keys = st.one_of(
    st.sampled_from(
        [
            "gen_ai.system",
            "gen_ai.request.model",
            "openinference.span.kind",
            "tool.name",
            "http.response.status_code",
            "error.type",
            "output.value",
            "llm.model_name",
            "gen_ai.response.finish_reasons",
            "session.id",
        ]
    ),
    st.text(max_size=20),
    st.text(min_size=128, max_size=300),  # keys whose length needs a 2-byte varint
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(keys, values), max_size=12), st.booleans())
@example(  # a repeated key: the short last value wins over a long first one on both paths
    [("openinference.span.kind", None), ("output.value", "000" * 3000), ("output.value", "")],
    False,
)
def test_random_attributes_normalize_alike(pairs: list[tuple[str, object]], error: bool) -> None:
    span = Span(
        trace_id=bytes(range(1, 17)),
        span_id=bytes(range(1, 9)),
        name="s",
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in pairs],
        status=Status(code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_UNSET),
    )
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    same_records(request)


def test_raw_attributes_read_like_a_mapping() -> None:
    span = Span(
        trace_id=bytes(range(1, 17)),
        span_id=bytes(range(1, 9)),
        attributes=[
            KeyValue(key="a", value=AnyValue(string_value="x" * 10_000)),
            KeyValue(key="n", value=AnyValue(int_value=-5)),
            KeyValue(key="a", value=AnyValue(string_value="last wins")),
            KeyValue(key="k" * 300, value=AnyValue(double_value=1.5)),
            KeyValue(key="empty"),
        ],
    )
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    lite = LiteRequest.FromString(request.SerializeToString())

    attrs = RawAttributes(lite.resource_spans[0].scope_spans[0].spans[0].attributes)

    assert dict(attrs) == {"a": "last wins", "n": -5, "k" * 300: 1.5, "empty": None}
    assert attrs.get("missing", "d") == "d"
    assert attrs.full("a") == "last wins"
    assert "n" in attrs and "k" * 300 in attrs and 3 not in attrs
    assert len(attrs) == 4
