"""The wire reader (:mod:`supervisor.normalize.walk`) gives the spans the protobuf runtime gives.

Every request is read both ways, :func:`walked_spans` and :func:`lite_spans`,
and compared field by field, attribute map included, and as records. Where
the reader declines a layout, it must say so with one of the exceptions
:func:`wire_spans` falls back on, never answer differently.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span, Status

from supervisor.normalize import (
    SpanReader,
    lite_spans,
    normalize_wire,
    walk,
    walked_spans,
    wire_spans,
)
from supervisor.normalize.walk import Unsupported, has_exception_event

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.spans import make_requests

#: What :func:`wire_spans` falls back on.
DECLINED = (Unsupported, IndexError, UnicodeDecodeError)
_FIELDS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "kind",
    "start_time_unix_nano",
    "end_time_unix_nano",
)


def same_spans(payload: bytes) -> int:
    """Assert both readers agree on ``payload``; returns the spans compared."""
    walked, lite = walked_spans(payload), lite_spans(payload)
    alike(walked, lite)
    for chunk in (1, 2, 100):
        alike(read_in_chunks(payload, chunk), lite)
    # Whichever reader wire_spans takes (the walker compiled), it gives these spans.
    assert [item[0].span_id for item in wire_spans(payload)] == [item[0].span_id for item in lite]
    return len(walked)


def read_in_chunks(payload: bytes, chunk: int) -> list[Any]:
    """What the pipeline reads: the walker's :class:`SpanReader`, ``chunk`` spans at a time."""
    reader = SpanReader(payload, walk=True)
    out: list[Any] = []
    while spans := reader.read(chunk):
        assert len(spans) <= chunk
        out.extend(spans)
    assert len(out) == len(reader)
    assert reader.read(chunk) == []
    return out


def alike(walked: list[Any], lite: list[Any]) -> None:
    assert len(walked) == len(lite)
    for got, want in zip(walked, lite, strict=True):
        for name in _FIELDS:
            assert getattr(got[0], name) == getattr(want[0], name), name
        assert got[0].status.code == want[0].status.code
        assert got[0].status.message == want[0].status.message
        assert has_exception_event(got[0]) == has_exception_event(want[0])
        assert list(got[0].events) == list(want[0].events)
        assert got[1] == want[1] and got[2] == want[2]  # resource, service
        assert got[3] == want[3]  # watched keys present
        assert dict(got[4]) == dict(want[4])  # key -> encoded value
        assert normalize_wire(got) == normalize_wire(want)


def test_the_benchmark_load_reads_alike() -> None:
    spans = sum(same_spans(p) for p in make_requests(6, 200, failure_rate=0.3, seed=5))
    assert spans == 1200


ids = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))
texts = st.text(max_size=30)
values = st.one_of(
    texts.map(lambda t: AnyValue(string_value=t)),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.just(AnyValue()),
)
attributes = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "a",
                "gen_ai.system",
                "error.type",
                "",
                "é",
                "exception.type",
                "exception.message",
                "exception.stacktrace",
            ]
        )
        | texts,
        values,
    ),
    max_size=6,
).map(lambda pairs: [KeyValue(key=k, value=v) for k, v in pairs])
events = st.lists(
    st.builds(
        Span.Event,
        name=st.sampled_from(["exception", "log", ""]),
        time_unix_nano=st.integers(min_value=0, max_value=2**64 - 1),
        attributes=attributes,
    ),
    max_size=2,
)
statuses = st.one_of(
    st.none(),
    st.builds(
        Status,
        code=st.sampled_from([0, 1, 2, 7]),
        message=texts,
    ),
)
spans = st.builds(
    Span,
    trace_id=ids,
    span_id=ids,
    parent_span_id=ids,
    trace_state=texts,
    name=texts,
    kind=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    start_time_unix_nano=st.integers(min_value=0, max_value=2**64 - 1),
    end_time_unix_nano=st.integers(min_value=0, max_value=2**64 - 1),
    attributes=attributes,
    dropped_attributes_count=st.integers(min_value=0, max_value=2**32 - 1),
    events=events,
    links=st.lists(st.builds(Span.Link, trace_id=ids, span_id=ids), max_size=1),
    status=statuses,
    flags=st.integers(min_value=0, max_value=2**32 - 1),
)
requests = st.lists(
    st.tuples(attributes, st.lists(st.lists(spans, max_size=3), max_size=2)), max_size=3
).map(
    lambda groups: ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=resource),
                scope_spans=[{"spans": s} for s in scopes],
            )
            for resource, scopes in groups
        ]
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_any_request_an_encoder_writes_reads_alike(request: ExportTraceServiceRequest) -> None:
    same_spans(request.SerializeToString())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, st.data())
def test_damaged_bytes_are_declined_or_read_alike(
    request: ExportTraceServiceRequest, data: st.DataObject
) -> None:
    payload = bytearray(request.SerializeToString())
    if payload:
        for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
            at = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
            payload[at] = data.draw(st.integers(min_value=0, max_value=255))
        payload = payload[: data.draw(st.integers(min_value=0, max_value=len(payload)))]
    damaged = bytes(payload)
    try:
        ExportTraceServiceRequest.FromString(damaged)  # what ingest checks first
    except DecodeError:
        accepted = False
    else:
        accepted = True
    try:
        walked_spans(damaged)
    except DECLINED:
        return
    if accepted:
        same_spans(damaged)


def _span_bytes(span: Span) -> bytes:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    return request.SerializeToString()


def _ids() -> dict[str, Any]:
    return {"trace_id": bytes(range(1, 17)), "span_id": bytes(range(1, 9))}


def test_requests_without_spans_read_as_none() -> None:
    for request in (
        ExportTraceServiceRequest(),
        ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[{}])]),
    ):
        payload = request.SerializeToString()
        assert walked_spans(payload) == [] == lite_spans(payload)


def _with_span_suffix(extra: bytes) -> bytes:
    """One span whose encoding ends with ``extra``, lengths fixed up."""
    return _request(_suffixed(extra))


def _suffixed(extra: bytes) -> bytes:
    return Span(**_ids(), name="s").SerializeToString() + extra


def _request(*spans: bytes) -> bytes:
    """A request of one resource and one scope with these encoded spans."""
    scope = b"".join(b"\x12" + _len(span) + span for span in spans)
    resource_spans = b"\x12" + _len(scope) + scope
    return b"\x0a" + _len(resource_spans) + resource_spans


def _len(data: bytes) -> bytes:
    size, out = len(data), bytearray()
    while size >= 0x80:
        out.append(size & 0x7F | 0x80)
        size >>= 7
    out.append(size)
    return bytes(out)


@pytest.mark.parametrize(
    "extra",
    [
        Span(status=Status(code=2)).SerializeToString() * 2,  # status twice: merged
        b"\x08\x01",  # trace_id as a varint
        b"\x02\x00",  # field number 0
        b"\x0b\x0c",  # a group
        b"\x2a\x05ab",  # a name longer than what follows
        b"\x2a\x02\xff\xfe",  # a name that is not UTF-8
        b"\x4a\x04\x1a\x02ab",  # an attribute with a field other than key and value
    ],
)
def test_layouts_left_to_the_runtime_are_declined_and_read_by_it(extra: bytes) -> None:
    payload = _with_span_suffix(extra)
    with pytest.raises(DECLINED):
        walked_spans(payload)
    try:
        expected = lite_spans(payload)
    except DecodeError:
        return  # ingest refuses these before the span path sees them
    got = wire_spans(payload)
    assert [item[0].name for item in got] == [item[0].name for item in expected]
    assert [dict(item[4]) for item in got] == [dict(item[4]) for item in expected]
    # Among spans the walker reads, the reader leaves only this one to the runtime.
    plain = Span(**_ids(), name="plain").SerializeToString()
    mixed = _request(plain, _suffixed(extra), plain)
    read = read_in_chunks(mixed, 2)
    assert [type(item[0]) is walk.WalkedSpan for item in read] == [True, False, True]
    alike(read, lite_spans(mixed))


def test_resource_written_twice_is_declined() -> None:
    resource = Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="a"))])
    body = resource.SerializeToString()
    span = Span(**_ids()).SerializeToString()
    scope = b"\x12" + _len(span) + span
    resource_spans = (b"\x0a" + _len(body) + body) * 2 + b"\x12" + _len(scope) + scope
    payload = b"\x0a" + _len(resource_spans) + resource_spans
    with pytest.raises(Unsupported):
        walked_spans(payload)
    assert [item[2] for item in wire_spans(payload)] == ["a"]
    # The spans cannot be found without the resource: the runtime reads the request.
    (item,) = read_in_chunks(payload, 1)
    assert type(item[0]) is not walk.WalkedSpan


def test_events_are_parsed_only_when_read() -> None:
    span = Span(**_ids(), events=[Span.Event(name="exception")])
    (item,) = walked_spans(_span_bytes(span))
    assert item[0]._events is None
    assert [event.name for event in item[0].events] == ["exception"]
    assert item[0].events is item[0].events  # parsed once
    (plain,) = walked_spans(_span_bytes(Span(**_ids())))
    assert len(plain[0].events) == 0


def _exception(**attributes: AnyValue) -> Span.Event:
    return Span.Event(
        name="exception", attributes=[KeyValue(key=k, value=v) for k, v in attributes.items()]
    )


@pytest.mark.parametrize(
    ("events", "want"),
    [
        ([], None),
        ([Span.Event(name="log")], None),
        (
            [
                Span.Event(name="log"),
                _exception(
                    **{
                        "exception.type": AnyValue(string_value="openai.RateLimitError"),
                        "exception.message": AnyValue(string_value="Error code: 429"),
                    }
                ),
                _exception(**{"exception.type": AnyValue(string_value="ValueError")}),
            ],
            ("openai.RateLimitError", "Error code: 429"),
        ),
        (
            [
                _exception(
                    **{
                        "exception.stacktrace": AnyValue(
                            string_value='Traceback (most recent call last):\n  File "a.py"'
                            ", line 1\nhttpx.ConnectTimeout: timed out"
                        )
                    }
                )
            ],
            ("httpx.ConnectTimeout", ""),
        ),
        # Not a string: the runtime reads it ("" for a string field it does not hold).
        ([_exception(**{"exception.type": AnyValue(int_value=7)})], ("", "")),
    ],
)
def test_exception_events_are_read_without_the_runtime(
    events: list[Span.Event], want: tuple[str, str] | None
) -> None:
    payload = _span_bytes(
        Span(**_ids(), status=Status(code=Status.StatusCode.STATUS_CODE_ERROR), events=events)
    )
    (walked,) = walked_spans(payload)
    (lite,) = lite_spans(payload)

    got = normalize_wire(walked).error
    assert got is not None
    assert (got.exception_type, got.exception_message) == (want or ("", ""))
    assert normalize_wire(lite) == normalize_wire(walked)
    assert has_exception_event(walked[0]) is has_exception_event(lite[0]) is (want is not None)
    plain_strings = all(
        kv.value.WhichOneof("value") in (None, "string_value")
        for event in events
        for kv in event.attributes
    )
    assert (walked[0]._events is None) is plain_strings  # parsed only to fall back


def test_interned_keys_stay_bounded() -> None:
    span = Span(
        **_ids(),
        attributes=[
            KeyValue(key=f"k{i}", value=AnyValue(int_value=i)) for i in range(walk._MAX_KEYS + 10)
        ],
    )
    (item,) = walked_spans(_span_bytes(span))
    assert len(item[4]) == walk._MAX_KEYS + 10
    assert len(walk._KEYS) <= walk._MAX_KEYS


@pytest.mark.parametrize("repeat", [1, 2])
def test_keys_read_alike_whatever_key_came_before(repeat: int) -> None:
    """The walker first tries the key that followed the previous one last time
    (``walk._Key``). Right guesses, wrong ones, orders that change from span to
    span, keys of one length that differ in one byte, a key written twice, and
    a key a span watches that an exception event also carries: all read as the
    runtime reads them."""
    orders = [
        ["gen_ai.operation.name", "session.id", "llm.tools.0.tool.name", "llm.tools.1.tool.name"],
        ["gen_ai.operation.name", "llm.tools.1.tool.name", "session.id", "llm.tools.0.tool.name"],
        ["gen_ai.operation.name", "llm.tools.2.tool.name", "llm.tools.0.tool.name"],
        ["session.id", "gen_ai.operation.name", "error.type"],
        ["llm.tools.1.tool.name", "llm.tools.1.tool.name", "session.id"],
        [],
    ]
    for _ in range(repeat):
        for keys in orders:
            event = Span.Event(
                name="exception",
                attributes=[
                    KeyValue(key="exception.type", value=AnyValue(string_value="TimeoutError")),
                    KeyValue(key="session.id", value=AnyValue(string_value="from the event")),
                ],
            )
            span = Span(
                **_ids(),
                attributes=[
                    KeyValue(key=key, value=AnyValue(string_value=f"{key}={i}"))
                    for i, key in enumerate(keys)
                ],
                events=[event],
                status=Status(code=Status.STATUS_CODE_ERROR),
            )
            assert same_spans(_span_bytes(span)) == 1
