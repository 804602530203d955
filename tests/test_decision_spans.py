"""``spanvisor.decide`` spans: children of the failing span, exported by the real SDK exporters."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from supervisor.forward.downstream import Downstream
from supervisor.forward.telemetry import DecisionTracer, TracerStats, flatten_params
from supervisor.records import (
    Action,
    AttrValue,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
)
from supervisor.testing.otlp_recorder import OtlpRecorder

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
# The OTLP span flags for "the parent context was remote" (has-is-remote | is-remote).
REMOTE_PARENT_FLAGS = 0x100 | 0x200
MakeTracer = Callable[..., DecisionTracer]

FAILURE = Failure(
    trace_id=TRACE_ID,
    span_id=SPAN_ID,
    parent_span_id="a2fb4a1d1a96d312",
    service="travel-agent",
    span_name="chat gpt-4o",
    run_id="conv-42",
    role=Role.LLM,
    failure_class=FailureClass.TRANSIENT,
    kind="rate_limit",
    dependency="openai:gpt-4o",
    rule="builtin.http_429",
    message="Error code: 429 - rate limit exceeded",
    evidence=ErrorEvidence(status_error=True, http_status=429),
    received_ns=1_700_000_000_000_000_000,
)
DECISION = Decision(
    action=Action.RETRY,
    policy="default.retry",
    params={"attempt": 1, "max_attempts": 3, "delay_s": 2.5, "jitter": True},
    reason="rate limited; retry after the provider's delay",
)
EXPECTED_ATTRIBUTES: dict[str, Any] = {
    "spanvisor.failure.class": "transient",
    "spanvisor.failure.kind": "rate_limit",
    "spanvisor.failure.dependency": "openai:gpt-4o",
    "spanvisor.failure.message": "Error code: 429 - rate limit exceeded",
    "spanvisor.rule": "builtin.http_429",
    "spanvisor.action": "retry",
    "spanvisor.policy": "default.retry",
    "spanvisor.run_id": "conv-42",
    "spanvisor.service": "travel-agent",
    "spanvisor.observe_only": False,
    "spanvisor.reason": "rate limited; retry after the provider's delay",
    "spanvisor.decision.attempt": 1,
    "spanvisor.decision.max_attempts": 3,
    "spanvisor.decision.delay_s": 2.5,
    "spanvisor.decision.jitter": True,
}


@pytest.fixture
def recorder() -> Iterator[OtlpRecorder]:
    with OtlpRecorder() as rec:
        yield rec


@pytest.fixture
def make_tracer() -> Iterator[MakeTracer]:
    """DecisionTracer's constructor; every tracer made is shut down after the test."""
    made: list[DecisionTracer] = []

    def make(*args: Any, **kwargs: Any) -> DecisionTracer:
        made.append(DecisionTracer(*args, **kwargs))
        return made[-1]

    yield make
    for tracer in made:
        tracer.shutdown(2.0)


def plain(value: AnyValue) -> Any:
    """An OTLP AnyValue as plain Python."""
    which = value.WhichOneof("value")
    if which == "array_value":
        return [plain(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def pb_attributes(span: PbSpan) -> dict[str, Any]:
    return {kv.key: plain(kv.value) for kv in span.attributes}


@pytest.mark.parametrize(
    ("protocol", "compression"),
    [("http/protobuf", "none"), ("http/protobuf", "gzip"), ("grpc", "none"), ("grpc", "gzip")],
)
def test_decision_span_reaches_a_real_otlp_receiver_as_child_of_the_failing_span(
    recorder: OtlpRecorder, protocol: str, compression: str
) -> None:
    endpoint = recorder.http_endpoint if protocol == "http/protobuf" else recorder.grpc_endpoint
    downstream = Downstream(
        endpoint=endpoint,
        protocol=protocol,  # type: ignore[arg-type]
        insecure=True,
        timeout_s=5.0,
        compression=compression,  # type: ignore[arg-type]
    )
    tracer = DecisionTracer(downstream, service_name="spanvisor-test")
    try:
        span_id = tracer.emit(FAILURE, DECISION)
        assert tracer.force_flush(5.0)
        (span,) = recorder.wait_for_spans(1, timeout_s=5.0)
    finally:
        tracer.shutdown(5.0)

    assert (span.trace_id.hex(), span.parent_span_id.hex(), span.span_id.hex()) == (
        TRACE_ID,
        SPAN_ID,
        span_id,
    )
    assert (span.name, span.kind, span.status.code) == (
        "spanvisor.decide",
        PbSpan.SpanKind.SPAN_KIND_INTERNAL,
        0,  # STATUS_CODE_UNSET: deciding succeeded
    )
    # The SDK's encoder carries the remote-parent bits, not the sampled bit:
    # that the span was exported at all is what "sampled" means on the wire.
    assert span.flags == REMOTE_PARENT_FLAGS
    assert pb_attributes(span) == EXPECTED_ATTRIBUTES
    resource = recorder.requests[0].request.resource_spans[0].resource
    assert {kv.key: plain(kv.value) for kv in resource.attributes}["service.name"] == (
        "spanvisor-test"
    )


def test_decision_span_in_memory_parent_context_and_sampling(make_tracer: MakeTracer) -> None:
    exporter = InMemorySpanExporter()
    tracer = make_tracer(None, exporter=exporter)
    span_id = tracer.emit(FAILURE, DECISION)
    assert tracer.force_flush(5.0)
    tracer.shutdown(5.0)

    (span,) = exporter.get_finished_spans()
    assert span.parent is not None
    assert (
        format(span.context.trace_id, "032x"),
        format(span.context.span_id, "016x"),
        format(span.parent.span_id, "016x"),
        span.parent.is_remote,
        span.parent.trace_flags.sampled,
        span.context.trace_flags.sampled,
    ) == (TRACE_ID, span_id, SPAN_ID, True, True, True)
    assert (span.name, span.kind, span.status.status_code) == (
        "spanvisor.decide",
        SpanKind.INTERNAL,
        StatusCode.UNSET,
    )
    assert dict(span.attributes or {}) == EXPECTED_ATTRIBUTES
    assert span.resource.attributes["service.name"] == "spanvisor"
    assert tracer.stats() == TracerStats(emitted=1, errors=0)


def test_observe_only_and_long_messages_are_bounded(make_tracer: MakeTracer) -> None:
    exporter = InMemorySpanExporter()
    tracer = make_tracer(None, exporter=exporter)
    failure = replace(FAILURE, message="é" * 5000)
    decision = replace(DECISION, observe_only=True, reason="r" * 5000, params={})
    tracer.emit(failure, decision)
    assert tracer.force_flush(5.0)

    (span,) = exporter.get_finished_spans()
    attributes = dict(span.attributes or {})
    assert (
        attributes["spanvisor.observe_only"],
        attributes["spanvisor.failure.message"],
        attributes["spanvisor.reason"],
    ) == (True, "é" * 1024, "r" * 1024)
    assert not [key for key in attributes if key.startswith("spanvisor.decision.")]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, {}),
        (
            {"chain": ("openai:gpt-4o-mini", "anthropic:claude")},
            {"spanvisor.decision.chain": ["openai:gpt-4o-mini", "anthropic:claude"]},
        ),
        ({"codes": (429, 503)}, {"spanvisor.decision.codes": [429, 503]}),
        ({"weights": (0.5, 1.5)}, {"spanvisor.decision.weights": [0.5, 1.5]}),
        ({"flags": (True, False)}, {"spanvisor.decision.flags": [True, False]}),
        ({"mixed": (1, "a")}, {}),
        ({"empty": ()}, {}),
        ({"nested": {"a": 1}}, {}),
        ({"raw": b"\x00"}, {}),
        ({"none": None}, {}),
        (
            {"zero": 0, "no": False, "neg": -1.5},
            {
                "spanvisor.decision.zero": 0,
                "spanvisor.decision.no": False,
                "spanvisor.decision.neg": -1.5,
            },
        ),
    ],
)
def test_params_are_flattened_as_scalars(
    params: Mapping[str, AttrValue], expected: dict[str, Any]
) -> None:
    assert flatten_params(params) == expected


@pytest.mark.parametrize(
    ("trace_id", "span_id"),
    [
        ("not-hex", SPAN_ID),
        (TRACE_ID, "0x" + SPAN_ID[2:]),
        (TRACE_ID[:-1], SPAN_ID),
        ("0" * 32, SPAN_ID),
        (TRACE_ID, "0" * 16),
        ("", ""),
    ],
)
def test_emit_never_raises_and_counts_bad_ids(
    trace_id: str, span_id: str, make_tracer: MakeTracer
) -> None:
    exporter = InMemorySpanExporter()
    tracer = make_tracer(None, exporter=exporter)
    result = tracer.emit(replace(FAILURE, trace_id=trace_id, span_id=span_id), DECISION)
    assert tracer.force_flush(5.0)
    assert (result, exporter.get_finished_spans(), tracer.stats()) == (
        "",
        (),
        TracerStats(emitted=0, errors=1),
    )


def test_emit_errors_are_logged_once(
    caplog: pytest.LogCaptureFixture, make_tracer: MakeTracer
) -> None:
    tracer = make_tracer(None, exporter=InMemorySpanExporter())
    bad = replace(FAILURE, trace_id="zz")
    with caplog.at_level(logging.WARNING, logger="spanvisor.telemetry"):
        for _ in range(5):
            tracer.emit(bad, DECISION)
    assert len(caplog.records) == 1
    assert tracer.stats() == TracerStats(emitted=0, errors=5)


def test_no_downstream_and_no_exporter_still_makes_span_ids(make_tracer: MakeTracer) -> None:
    tracer = make_tracer(None)
    first, second = tracer.emit(FAILURE, DECISION), tracer.emit(FAILURE, DECISION)
    assert tracer.force_flush(1.0)
    tracer.shutdown(1.0)
    assert (len(first), len(second), first != second, int(first, 16) != 0) == (16, 16, True, True)


def test_the_global_tracer_provider_is_left_alone(make_tracer: MakeTracer) -> None:
    before = trace.get_tracer_provider()
    tracer = make_tracer(None, exporter=InMemorySpanExporter())
    tracer.emit(FAILURE, DECISION)
    assert trace.get_tracer_provider() is before
    assert tracer._provider is not before


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_shutdown_with_a_dead_downstream_returns_within_its_timeout(protocol: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}/v1/traces"
    dead = Downstream(endpoint=endpoint, protocol=protocol, insecure=True, timeout_s=1.0)  # type: ignore[arg-type]
    tracer = DecisionTracer(dead)
    tracer.emit(FAILURE, DECISION)
    started = time.perf_counter()
    tracer.shutdown(0.3)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"shutdown took {elapsed:.3f} s"
