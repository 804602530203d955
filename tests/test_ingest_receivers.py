"""The OTLP receivers against the real OpenTelemetry exporters and hand-made bad payloads.

The receivers run on an asyncio loop in a background thread, as in the app;
the tests talk to them over real sockets on 127.0.0.1 with ephemeral ports and
look at the queue only through that loop.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import uvicorn
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from supervisor.errors import ConfigError
from supervisor.ingest import (
    Batch,
    GrpcReceiver,
    IngestQueue,
    IngestStats,
    QueueClosed,
    build_otlp_http_app,
    codec,
)
from supervisor.ingest.wal import IngestLog, SpanLog

T = TypeVar("T")
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PB = "application/x-protobuf"
JS = "application/json"
TRACE = bytes.fromhex("0102030405060708090a0b0c0d0e0f10")


# --------------------------------------------------------------------- harness


class Receivers:
    """Both receivers and their queue on an event loop in a background thread."""

    def __init__(
        self,
        *,
        max_batches: int = 100,
        max_spans: int = 1_000_000,
        max_body_bytes: int = 8 * 1024 * 1024,
        retry_after_s: float = 1.0,
        max_bytes: int = 256 * 1024 * 1024,
        read_timeout_s: float = 30.0,
        ingest_log: SpanLog | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.queue: IngestQueue = self.call(lambda: IngestQueue(max_batches, max_spans, max_bytes))
        self.baseline = self.call(self.queue.stats)
        self.grpc = GrpcReceiver(
            self.queue,
            host="127.0.0.1",
            port=0,
            max_body_bytes=max_body_bytes,
            retry_after_s=retry_after_s,
            ingest_log=ingest_log,
        )
        self.grpc_port = self.run(self.grpc.start())
        app = build_otlp_http_app(
            self.queue,
            max_body_bytes=max_body_bytes,
            retry_after_s=retry_after_s,
            read_timeout_s=read_timeout_s,
            ingest_log=ingest_log,
        )
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            ws="none",
            http="h11",
        )
        self.http_server = uvicorn.Server(config)
        self.serve_task = asyncio.run_coroutine_threadsafe(self.http_server.serve(), self.loop)
        deadline = time.monotonic() + 10
        while not self.http_server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert not self.serve_task.done(), self.serve_task.exception()
            time.sleep(0.005)  # polling with a deadline, not synchronising on time
        self.http_port = self.http_server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.http_port}/v1/traces"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.export = self.channel.unary_unary(EXPORT_METHOD)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    def stats(self) -> IngestStats:
        """Counters since :meth:`reset` (the queue's own are cumulative)."""
        now = self.call(self.queue.stats)
        base = self.baseline
        return dataclasses.replace(
            now,
            **{
                field.name: getattr(now, field.name) - getattr(base, field.name)
                for field in dataclasses.fields(now)
                if not field.name.startswith("queued_")
            },
        )

    def reset(self) -> Receivers:
        """Drain the queue and start counting afresh, between tests."""
        self.drain()
        self.baseline = self.call(self.queue.stats)
        return self

    def drain(self) -> list[Batch]:
        def take() -> list[Batch]:
            out = []
            while (batch := self.queue.get_nowait()) is not None:
                self.queue.task_done(batch)
                out.append(batch)
            return out

        return self.call(take)

    def wait_for(
        self, predicate: Callable[[IngestStats], bool], timeout: float = 10
    ) -> IngestStats:
        deadline = time.monotonic() + timeout
        while not predicate(stats := self.stats()):
            assert time.monotonic() < deadline, f"condition not met: {stats}"
            time.sleep(0.01)  # polling with a deadline
        return stats

    def close(self) -> None:
        self.channel.close()
        self.http_server.should_exit = True
        self.serve_task.result(10)
        self.run(self.grpc.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def shared_rx() -> Iterator[Receivers]:
    receivers = Receivers()
    yield receivers
    receivers.close()


@pytest.fixture(scope="module")
def shared_small() -> Iterator[Receivers]:
    receivers = Receivers(max_body_bytes=64 * 1024)
    yield receivers
    receivers.close()


@pytest.fixture
def rx(shared_rx: Receivers) -> Receivers:
    """Receivers with an 8 MiB body limit, drained, counters at zero."""
    return shared_rx.reset()


@pytest.fixture
def small(shared_small: Receivers) -> Receivers:
    """Receivers with a 64 KiB body limit, drained, counters at zero."""
    return shared_small.reset()


def decoded(batch: Batch) -> ExportTraceServiceRequest:
    """The batch's one decoding (attributes left encoded), read as a whole request."""
    return ExportTraceServiceRequest.FromString(batch.request.SerializeToString())


def sdk_spans(*names: str) -> list[ReadableSpan]:
    """Real SDK spans (a parent and its children), captured in memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "test-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tests")
    with tracer.start_as_current_span(names[0]) as root:
        root.set_attribute("gen_ai.request.model", "gpt-4o")
        for name in names[1:]:
            with tracer.start_as_current_span(name):
                pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def ids(spans: list[ReadableSpan]) -> set[tuple[str, bytes, bytes]]:
    out = set()
    for span in spans:
        assert span.context is not None
        out.add(
            (
                span.name,
                span.context.trace_id.to_bytes(16, "big"),
                span.context.span_id.to_bytes(8, "big"),
            )
        )
    return out


def received(batches: list[Batch]) -> set[tuple[str, bytes, bytes]]:
    return {
        (span.name, span.trace_id, span.span_id)
        for batch in batches
        for rs in decoded(batch).resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    }


def good_request(*names: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for n, name in enumerate(names, start=1):
        scope.spans.add(trace_id=TRACE, span_id=n.to_bytes(8, "big"), name=name)
    return request


def assert_still_serving(rx: Receivers) -> None:
    """A good request over each transport succeeds after whatever came before."""
    rx.drain()
    body = good_request("after-http").SerializeToString()
    response = httpx.post(rx.url, content=body, headers={"Content-Type": PB})
    assert (response.status_code, response.content) == (200, b"")
    assert rx.export(good_request("after-grpc").SerializeToString(), timeout=10) == b""
    assert {"after-http", "after-grpc"} == {name for name, _, _ in received(rx.drain())}


def grpc_error(rx: Receivers, body: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        rx.export(body, timeout=10)
    return info.value


def status_of(response: httpx.Response) -> status_pb2.Status:
    status = status_pb2.Status()
    if response.headers["content-type"] == JS:
        json_format.Parse(response.content, status)
    else:
        status.ParseFromString(response.content)
    return status


# ------------------------------------------------------------ real exporters


@pytest.mark.parametrize("gzip_on", [False, True], ids=["plain", "gzip"])
def test_grpc_exporter_spans_arrive_exactly(rx: Receivers, gzip_on: bool) -> None:
    spans = sdk_spans("invoke_agent", "chat gpt-4o", "execute_tool search")
    exporter = GrpcSpanExporter(
        endpoint=f"http://127.0.0.1:{rx.grpc_port}",
        insecure=True,
        timeout=10,
        compression=grpc.Compression.Gzip if gzip_on else grpc.Compression.NoCompression,
    )
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    batches = rx.drain()
    assert [b.transport for b in batches] == ["grpc"]
    assert ids(spans) == received(batches)
    assert batches[0].span_count == 3
    assert encode_spans(spans) == ExportTraceServiceRequest.FromString(batches[0].raw_protobuf)


@pytest.mark.parametrize("gzip_on", [False, True], ids=["plain", "gzip"])
def test_http_exporter_spans_arrive_exactly(rx: Receivers, gzip_on: bool) -> None:
    spans = sdk_spans("invoke_agent", "chat gpt-4o", "execute_tool search")
    exporter = HttpSpanExporter(
        endpoint=rx.url,
        timeout=10,
        compression=HttpCompression.Gzip if gzip_on else HttpCompression.NoCompression,
    )
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK
    batches = rx.drain()
    assert [b.transport for b in batches] == ["http/protobuf"]
    assert ids(spans) == received(batches)
    # The forwarded bytes are what the exporter serialised, decompressed.
    assert encode_spans(spans).SerializeToString() == batches[0].raw_protobuf


def test_http_deflate_from_the_exporter_is_accepted(rx: Receivers) -> None:
    spans = sdk_spans("a", "b")
    exporter = HttpSpanExporter(endpoint=rx.url, timeout=10, compression=HttpCompression.Deflate)
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK
    assert ids(spans) == received(rx.drain())


def test_received_time_and_stats_are_recorded(rx: Receivers) -> None:
    before = time.time_ns()
    body = good_request("a", "b").SerializeToString()
    assert httpx.post(rx.url, content=body, headers={"Content-Type": PB}).status_code == 200
    stats = rx.stats()
    assert (
        stats.accepted_batches,
        stats.accepted_spans,
        stats.queued_batches,
        stats.queued_spans,
    ) == (1, 2, 1, 2)
    [batch] = rx.drain()
    assert before <= batch.received_ns <= time.time_ns()
    assert rx.stats().queued_spans == 0


# ------------------------------------------------------------------ throttling


@pytest.fixture
def full() -> Iterator[Receivers]:
    """Receivers whose one-batch queue is already full, with a short retry delay."""
    receivers = Receivers(max_batches=1, retry_after_s=0.25)
    filler = Batch(
        request=good_request("filler"),
        raw_protobuf=b"",
        received_ns=0,
        transport="grpc",
        span_count=1,
    )
    assert receivers.call(lambda: receivers.queue.offer(filler))
    yield receivers
    receivers.close()


def throttled_then_drained(rx: Receivers, export: Callable[[], SpanExportResult]) -> list[Batch]:
    """Run ``export`` while the queue is full; drain once it has been throttled."""
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(export)
        rx.wait_for(lambda s: s.throttled_batches >= 1)
        assert [name for name, _, _ in received(rx.drain())] == ["filler"]
        assert result.result(15) == SpanExportResult.SUCCESS
    return rx.drain()


def test_grpc_exporter_is_told_to_retry_and_honours_our_delay(
    full: Receivers, caplog: pytest.LogCaptureFixture
) -> None:
    spans = sdk_spans("throttled-grpc", "child")
    exporter = GrpcSpanExporter(
        endpoint=f"http://127.0.0.1:{full.grpc_port}", insecure=True, timeout=10
    )
    try:
        with caplog.at_level(logging.WARNING):
            batches = throttled_then_drained(full, lambda: exporter.export(spans))
    finally:
        exporter.shutdown()
    assert ids(spans) == received(batches)
    # The exporter's own log line shows the delay came from our RetryInfo.
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert retries
    assert all(
        m.endswith("retrying in 0.25s. Error details: spanvisor ingest queue is full; retry later")
        for m in retries
    )
    stats = full.stats()
    assert (len(retries), 2 * len(retries)) == (stats.throttled_batches, stats.throttled_spans)


def test_http_exporter_gets_503_retry_after_and_retries(
    full: Receivers, caplog: pytest.LogCaptureFixture
) -> None:
    spans = sdk_spans("throttled-http", "child")
    exporter = HttpSpanExporter(endpoint=full.url, timeout=10)
    try:
        with caplog.at_level(logging.WARNING):
            batches = throttled_then_drained(full, lambda: exporter.export(spans))
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK
    assert ids(spans) == received(batches)
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert retries
    assert all("retrying in 1.00s" in m for m in retries)  # Retry-After: whole seconds, >= 1


def test_throttled_http_answer_is_503_with_retry_after_and_status(full: Receivers) -> None:
    body = json.dumps({"resourceSpans": []}).encode()
    assert httpx.post(full.url, content=body, headers={"Content-Type": JS}).status_code == 200
    response = httpx.post(
        full.url, content=good_request("x").SerializeToString(), headers={"Content-Type": PB}
    )
    assert (
        response.status_code,
        response.headers["retry-after"],
        response.headers["content-type"],
    ) == (503, "1", PB)
    status = status_of(response)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert (status.code, info.retry_delay.seconds) == (14, 1)
    as_json = json.dumps(
        {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {"spans": [{"traceId": TRACE.hex(), "spanId": "0000000000000001"}]}
                    ]
                }
            ]
        }
    )
    response = httpx.post(full.url, content=as_json, headers={"Content-Type": JS})
    assert (response.status_code, response.headers["content-type"], status_of(response).code) == (
        503,
        JS,
        14,
    )


def test_throttled_grpc_answer_carries_retry_info_both_ways(full: Receivers) -> None:
    error = grpc_error(full, good_request("x").SerializeToString())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    trailers = dict(error.trailing_metadata())
    info = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
    assert (info.retry_delay.seconds, info.retry_delay.nanos) == (0, 250_000_000)
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    detail = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(detail)
    assert (14, "spanvisor ingest queue is full; retry later", info) == (
        status.code,
        status.message,
        detail,
    )


# ------------------------------------------------------------ bad payloads (HTTP)


@pytest.mark.parametrize(
    ("body", "headers", "http_status", "needle"),
    [
        (b"\x0a\x05abc", {"Content-Type": PB}, 400, "declares 5 bytes but only 3 remain"),
        (b'{"resourceSpans": [', {"Content-Type": JS}, 400, "malformed JSON at line 1"),
        (b"hello", {"Content-Type": "text/plain"}, 415, "unsupported Content-Type 'text/plain'"),
        (b"hello", {}, 415, "unsupported Content-Type '(none)'"),
        (
            b"hello",
            {"Content-Type": PB, "Content-Encoding": "br"},
            415,
            "unsupported Content-Encoding",
        ),
        (
            gzip.compress(good_request("x").SerializeToString())[:-8],
            {"Content-Type": PB, "Content-Encoding": "gzip"},
            400,
            "gzip stream is truncated",
        ),
        (b"", {"Content-Type": JS}, 400, "empty JSON body"),
        (b'{"resourceSpans": "\xff"}', {"Content-Type": JS}, 400, "not valid UTF-8: byte 19"),
        (
            b"\x0a\x0a\x12\x08\x12\x06\x2a\x04\xff\xfe\xfd\xfc",
            {"Content-Type": PB},
            400,
            "invalid UTF-8 in string resource_spans[0].scope_spans[0].spans[0].name",
        ),
    ],
    ids=[
        "malformed-protobuf",
        "malformed-json",
        "wrong-content-type",
        "no-content-type",
        "unknown-encoding",
        "truncated-gzip",
        "empty-json",
        "invalid-utf8-json",
        "invalid-utf8-protobuf",
    ],
)
def test_http_bad_payload_gets_status_and_receiver_keeps_serving(
    rx: Receivers, body: bytes, headers: dict[str, str], http_status: int, needle: str
) -> None:
    response = httpx.post(rx.url, content=body, headers=headers)
    assert http_status == response.status_code
    status = status_of(response)
    assert status.code == 3
    assert needle in status.message
    expected_type = JS if headers.get("Content-Type") == JS else PB
    assert expected_type == response.headers["content-type"]
    assert rx.stats().decode_errors == 1
    assert_still_serving(rx)


def test_http_empty_protobuf_body_is_an_empty_success(rx: Receivers) -> None:
    response = httpx.post(rx.url, content=b"", headers={"Content-Type": PB})
    assert (response.status_code, response.content) == (200, b"")
    assert (rx.stats().accepted_batches, rx.call(lambda: rx.queue.qsize)) == (0, 0)


def test_http_partial_success_for_bad_ids(rx: Receivers) -> None:
    request = good_request("good-1", "good-2")
    scope = request.resource_spans[0].scope_spans[0]
    scope.spans.add(trace_id=b"", span_id=b"\1" * 8, name="no-trace")
    scope.spans.add(trace_id=TRACE, span_id=b"\1" * 4, name="short-span")
    response = httpx.post(rx.url, content=request.SerializeToString(), headers={"Content-Type": PB})
    assert response.status_code == 200
    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 2
    assert partial.error_message.startswith("rejected 2 of 4 spans: ")
    assert "trace_id is missing" in partial.error_message
    assert "span_id is 4 bytes, want 8" in partial.error_message
    [batch] = rx.drain()
    assert {"good-1", "good-2"} == {name for name, _, _ in received([batch])}
    # Forwarded bytes are the cleaned request, not the original.
    assert batch.request.SerializeToString() == batch.raw_protobuf
    assert (rx.stats().rejected_spans, batch.span_count) == (2, 2)
    assert_still_serving(rx)


def test_http_json_partial_success_answers_in_json(rx: Receivers) -> None:
    spans = [
        {"traceId": TRACE.hex(), "spanId": "0000000000000001", "name": "ok"},
        {"traceId": TRACE.hex(), "spanId": "0000000000000000", "name": "zero"},
    ]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})
    response = httpx.post(
        rx.url, content=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert (response.status_code, response.headers["content-type"]) == (200, JS)
    assert response.json() == {
        "partialSuccess": {
            "rejectedSpans": "1",
            "errorMessage": "rejected 1 of 2 spans: 1 x span_id is all zeros "
            "(first at resource_spans[0].scope_spans[0].spans[1])",
        }
    }
    [batch] = rx.drain()
    assert ("http/json", {"ok"}) == (batch.transport, {n for n, _, _ in received([batch])})


def test_http_large_json_is_decoded_off_the_loop_and_arrives(rx: Receivers) -> None:
    spans = [
        {"traceId": TRACE.hex(), "spanId": f"{n:016x}", "name": f"s{n}", "kind": 1}
        for n in range(1, 2001)
    ]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()
    assert len(body) > 64 * 1024  # over the inline-decode threshold
    response = httpx.post(rx.url, content=body, headers={"Content-Type": JS}, timeout=30)
    assert (response.status_code, response.json()) == (200, {})
    [batch] = rx.drain()
    expected = {(f"s{n}", TRACE, n.to_bytes(8, "big")) for n in range(1, 2001)}
    assert received([batch]) == expected
    assert ExportTraceServiceRequest.FromString(batch.raw_protobuf) == decoded(batch)


def test_http_all_spans_rejected_enqueues_nothing(rx: Receivers) -> None:
    request = good_request("x")
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = b"\0" * 16
    response = httpx.post(rx.url, content=request.SerializeToString(), headers={"Content-Type": PB})
    assert (
        ExportTraceServiceResponse.FromString(response.content).partial_success.rejected_spans == 1
    )
    assert rx.drain() == []


def test_http_huge_attribute_value_under_limit_is_accepted(rx: Receivers) -> None:
    request = good_request("big")
    attr = request.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="gen_ai.prompt")
    attr.value.string_value = "\u00e9\u4e2d" * 1_000_000  # 5 MB of UTF-8
    response = httpx.post(rx.url, content=request.SerializeToString(), headers={"Content-Type": PB})
    assert response.status_code == 200
    [batch] = rx.drain()
    assert (
        attr.value.string_value
        == decoded(batch).resource_spans[0].scope_spans[0].spans[0].attributes[0].value.string_value
    )


def test_http_100k_spans_in_one_request_are_accepted(rx: Receivers) -> None:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for i in range(1, 100_001):
        spans.add(trace_id=TRACE, span_id=i.to_bytes(8, "big"), name="s")
    body = request.SerializeToString()
    response = httpx.post(
        rx.url,
        content=gzip.compress(body),
        headers={"Content-Type": PB, "Content-Encoding": "gzip"},
        timeout=30,
    )
    assert (response.status_code, response.content) == (200, b"")
    [batch] = rx.drain()
    assert (100_000, body) == (batch.span_count, batch.raw_protobuf)


def test_http_over_limit_is_413(small: Receivers) -> None:
    body = good_request("x" * 70_000).SerializeToString()
    response = httpx.post(small.url, content=body, headers={"Content-Type": PB})
    assert response.status_code == 413
    assert status_of(response).code == 8
    assert "over the 65536-byte limit" in status_of(response).message
    assert small.stats().too_large == 1
    assert_still_serving(small)


def test_http_gzip_bomb_is_413_without_inflating(small: Receivers) -> None:
    bomb = gzip.compress(b"\x0a" * 30_000_000)  # ~30 KB on the wire, 30 MB inflated
    response = httpx.post(
        small.url, content=bomb, headers={"Content-Type": PB, "Content-Encoding": "gzip"}
    )
    assert response.status_code == 413
    assert "inflates to more than the 65536-byte limit" in status_of(response).message
    assert_still_serving(small)


def test_http_absurd_content_length_is_refused_before_reading(small: Receivers) -> None:
    # Declares far more than the limit and sends almost nothing: the receiver
    # must answer from the header alone instead of waiting for the body.
    with socket.create_connection(("127.0.0.1", small.http_port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 999999999\r\n\r\n" + b"\0" * 10
        )
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert_still_serving(small)


def test_http_wrong_method_and_path(rx: Receivers) -> None:
    assert httpx.get(rx.url).status_code == 405
    assert httpx.post(rx.url.replace("/v1/traces", "/v1/logs"), content=b"").status_code == 404


# ------------------------------------------------------------ bad payloads (gRPC)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\x0a\x05abc", "declares 5 bytes but only 3 remain"),
        (b"\xff\xff\xff", "truncated"),
        (b"\x0a\x0a\x12\x08\x12\x06\x2a\x04\xff\xfe\xfd\xfc", "invalid UTF-8 in string"),
        (b'{"resourceSpans": []}', "send Content-Type: application/json"),
    ],
    ids=["malformed", "garbage", "invalid-utf8", "json-over-grpc"],
)
def test_grpc_bad_payload_is_invalid_argument_and_receiver_keeps_serving(
    rx: Receivers, body: bytes, needle: str
) -> None:
    error = grpc_error(rx, body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.details()
    assert rx.stats().decode_errors == 1
    assert_still_serving(rx)


def test_grpc_empty_message_is_an_empty_success(rx: Receivers) -> None:
    assert rx.export(b"", timeout=10) == b""
    assert rx.drain() == []


def test_grpc_partial_success_for_bad_ids(rx: Receivers) -> None:
    request = good_request("good")
    request.resource_spans[0].scope_spans[0].spans.add(
        trace_id=TRACE[:15], span_id=b"\1" * 8, name="bad"
    )
    response = ExportTraceServiceResponse.FromString(
        rx.export(request.SerializeToString(), timeout=10)
    )
    assert (
        response.partial_success.rejected_spans,
        response.partial_success.error_message,
    ) == (
        1,
        "rejected 1 of 2 spans: 1 x trace_id is 15 bytes, want 16 "
        "(first at resource_spans[0].scope_spans[0].spans[1])",
    )
    [batch] = rx.drain()
    assert {"good"} == {n for n, _, _ in received([batch])}
    assert_still_serving(rx)


def test_grpc_raw_bytes_are_forwarded_unchanged(rx: Receivers) -> None:
    raw = good_request("a").SerializeToString() + b"\xf8\x01\x07"  # plus an unknown field
    assert rx.export(raw, timeout=10) == b""
    [batch] = rx.drain()
    assert raw == batch.raw_protobuf


def test_grpc_100k_spans_in_one_request_are_accepted(rx: Receivers) -> None:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for i in range(1, 100_001):
        spans.add(trace_id=TRACE, span_id=i.to_bytes(8, "big"), name="s")
    assert rx.export(request.SerializeToString(), timeout=30) == b""
    [batch] = rx.drain()
    assert batch.span_count == 100_000


def test_grpc_over_limit_is_resource_exhausted(small: Receivers) -> None:
    # Just over: it reaches our handler, which refuses it and counts it.
    just_over = good_request("x" * (65536 - 43)).SerializeToString()
    assert len(just_over) == 65537
    error = grpc_error(small, just_over)
    assert (
        error.code(),
        error.details(),
    ) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "payload is 65537 bytes, over the 65536-byte limit")
    assert small.stats().too_large == 1
    # Far over: gRPC refuses it before our handler sees it.
    error = grpc_error(small, good_request("x" * 200_000).SerializeToString())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert small.stats().too_large == 1
    assert_still_serving(small)


def test_grpc_compressed_message_is_limited_after_decompression(small: Receivers) -> None:
    # 200 KB of one repeated byte compresses to a few hundred bytes on the wire.
    request = good_request("x" * 200_000)
    address = f"127.0.0.1:{small.grpc_port}"
    with (
        grpc.insecure_channel(address, compression=grpc.Compression.Gzip) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        channel.unary_unary(EXPORT_METHOD)(request.SerializeToString(), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_serving(small)


def test_grpc_receiver_bind_failure_is_a_config_error(rx: Receivers) -> None:
    other = GrpcReceiver(rx.queue, host="127.0.0.1", port=rx.grpc_port, max_body_bytes=1000)
    with pytest.raises(ConfigError) as info:
        rx.run(other.start())
    assert f"cannot bind the OTLP/gRPC receiver to 127.0.0.1:{rx.grpc_port}" in str(info.value)


def test_a_bug_of_ours_is_500_and_internal_logged_once_and_counted(
    rx: Receivers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(request: ExportTraceServiceRequest) -> Any:
        raise RuntimeError("validator bug")

    monkeypatch.setattr(codec, "validate_spans", broken)
    body = good_request("x").SerializeToString()
    with caplog.at_level(logging.ERROR, logger="supervisor.ingest"):
        for _ in range(2):
            response = httpx.post(rx.url, content=body, headers={"Content-Type": PB})
            assert (response.status_code, status_of(response).code) == (500, 13)
            assert grpc_error(rx, body).code() == grpc.StatusCode.INTERNAL
    assert rx.stats().internal_errors == 4
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert logged == [
        "OTLP/HTTP receiver failed on a request (logged once, counted)",
        "OTLP/gRPC receiver failed on a request (logged once, counted)",
    ]
    monkeypatch.undo()
    assert_still_serving(rx)


# --------------------------------------------------------------- JSON round trip


def test_otlp_json_by_hand_decodes_to_the_same_spans_as_protobuf(rx: Receivers) -> None:
    spans = sdk_spans("invoke_agent", "chat gpt-4o")
    request = encode_spans(spans)
    document = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in document["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
                span["aFieldFromTheFuture"] = {"x": 1}
    assert isinstance(document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["kind"], int)
    response = httpx.post(rx.url, content=json.dumps(document), headers={"Content-Type": JS})
    assert (response.status_code, response.json()) == (200, {})
    [batch] = rx.drain()
    assert request == decoded(batch)
    assert request.SerializeToString() == batch.raw_protobuf


# ------------------------------------------------------------------ the queue


def batch_of(spans: int, name: str = "b") -> Batch:
    return Batch(
        request=good_request(name),
        raw_protobuf=b"",
        received_ns=0,
        transport="grpc",
        span_count=spans,
    )


def test_queue_bounds_batches_and_spans_and_counts_throttling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = IngestQueue(max_batches=2, max_spans=10)
    with caplog.at_level(logging.INFO, logger="supervisor.ingest.queue"):
        assert [
            queue.offer(batch_of(6)),
            queue.offer(batch_of(5)),  # spans: 11 > 10
            queue.offer(batch_of(4)),
            queue.offer(batch_of(1)),  # batches: 3 > 2
            queue.offer(batch_of(1)),
        ] == [True, False, True, False, False]
        first = queue.get_nowait()
        assert first is not None
        queue.task_done(first)
        assert queue.offer(batch_of(1))
    stats = queue.stats()
    assert (
        stats.accepted_batches,
        stats.accepted_spans,
        stats.throttled_batches,
        stats.throttled_spans,
        stats.queued_batches,
        stats.queued_spans,
    ) == (3, 11, 3, 7, 2, 5)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("queue full, throttling" in m for m in messages) == 2  # two episodes, three requests
    assert [m for m in messages if "accepting again" in m] == [
        "ingest queue accepting again after throttling 1 batches",
        "ingest queue accepting again after throttling 2 batches",
    ]


def test_queue_admits_an_oversized_batch_only_when_idle() -> None:
    queue = IngestQueue(max_batches=5, max_spans=10)
    assert queue.offer(batch_of(50))
    assert not queue.offer(batch_of(1))
    taken = queue.get_nowait()
    assert taken is not None
    assert not queue.offer(batch_of(1))  # still outstanding until task_done
    queue.task_done(taken)
    assert queue.offer(batch_of(1))
    assert not queue.offer(batch_of(50))


def test_queue_task_done_twice_is_an_error() -> None:
    queue = IngestQueue(max_batches=5, max_spans=10)
    queue.offer(batch := batch_of(1))
    assert batch is queue.get_nowait()
    queue.task_done(batch)
    with pytest.raises(ValueError, match="not outstanding"):
        queue.task_done(batch)
    assert queue.queued_spans == 0


@pytest.mark.parametrize(("batches", "spans"), [(0, 1), (1, 0), (-1, 5)])
def test_queue_rejects_unbounded_configuration(batches: int, spans: int) -> None:
    with pytest.raises(ConfigError):
        IngestQueue(batches, spans)


def test_queue_get_waits_then_close_wakes_and_raises() -> None:
    async def scenario() -> list[str]:
        queue = IngestQueue(max_batches=5, max_spans=10)
        waiter = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        queue.offer(batch_of(1, "first"))
        got = await asyncio.wait_for(waiter, 5)
        queue.offer(batch_of(1, "left-over"))
        closer = asyncio.ensure_future(queue.get())
        left = await closer
        pending = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.close()
        with pytest.raises(QueueClosed):
            await asyncio.wait_for(pending, 5)
        assert not queue.offer(batch_of(1))
        return [
            decoded(got).resource_spans[0].scope_spans[0].spans[0].name,
            decoded(left).resource_spans[0].scope_spans[0].spans[0].name,
        ]

    assert asyncio.run(scenario()) == ["first", "left-over"]


def test_queue_cancelled_getter_does_not_lose_a_batch() -> None:
    async def scenario() -> str:
        queue = IngestQueue(max_batches=5, max_spans=10)
        first = asyncio.ensure_future(queue.get())
        second = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.offer(batch_of(1, "only"))
        first.cancel()  # woken but cancelled before it ran
        got = await asyncio.wait_for(second, 5)
        return decoded(got).resource_spans[0].scope_spans[0].spans[0].name

    assert asyncio.run(scenario()) == "only"


# ------------------------------------------------------------ the ingest log


def test_a_200_or_ok_is_answered_once_the_request_is_on_disk(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path / "log", max_bytes=1 << 20)
    wal.start()
    receivers = Receivers(ingest_log=wal)
    try:
        body = good_request("logged-http").SerializeToString()
        response = httpx.post(receivers.url, content=body, headers={"Content-Type": PB})
        assert response.status_code == 200
        receivers.export(good_request("logged-grpc").SerializeToString(), timeout=10)
        # Read back by another reader at once, as after kill -9: both are there.
        found = IngestLog(tmp_path / "log", max_bytes=1 << 20).recovered()
        assert [e.transport for e in found] == ["http/protobuf", "grpc"]
        names = [ExportTraceServiceRequest.FromString(e.payload) for e in found]
        assert [r.resource_spans[0].scope_spans[0].spans[0].name for r in names] == [
            "logged-http",
            "logged-grpc",
        ]
    finally:
        receivers.close()
        wal.close()


def test_a_full_ingest_log_throttles_both_receivers(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path / "log", max_bytes=1)
    wal.start()
    receivers = Receivers(ingest_log=wal)
    try:
        first = good_request("fills-the-log").SerializeToString()
        assert (
            httpx.post(receivers.url, content=first, headers={"Content-Type": PB}).status_code
            == 200
        )
        body = good_request("refused").SerializeToString()
        response = httpx.post(receivers.url, content=body, headers={"Content-Type": PB})
        assert (response.status_code, response.headers["retry-after"]) == (503, "1")
        assert grpc_error(receivers, body).code() == grpc.StatusCode.UNAVAILABLE
        assert wal.stats().refused_full == 2
    finally:
        receivers.close()
        wal.close()
