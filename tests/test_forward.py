"""The forwarder against a real OTLP receiver: unchanged bytes, retries, drops, bounded shutdown."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from supervisor.errors import ConfigError
from supervisor.forward.downstream import Downstream
from supervisor.forward.relay import Forwarder, ForwardStats
from supervisor.retry_after import parse_retry_after
from supervisor.testing.otlp_recorder import OtlpRecorder

PROTOCOLS = ["http/protobuf", "grpc"]


class RecordingSleep:
    """An injected sleep: records each requested delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


class StuckSleep:
    """An injected sleep that never returns: the worker stays parked in backoff."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, seconds: float) -> None:
        self.calls += 1
        await asyncio.Event().wait()


@pytest.fixture
def recorder() -> Iterator[OtlpRecorder]:
    with OtlpRecorder() as rec:
        yield rec


def make_request(n_spans: int, tag: str = "a") -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    service = KeyValue(key="service.name", value=AnyValue(string_value="agent"))
    rs.resource.attributes.append(service)
    ss = rs.scope_spans.add()
    for i in range(n_spans):
        span = ss.spans.add()
        span.trace_id = bytes(range(16))
        span.span_id = (i + 1).to_bytes(8, "big")
        span.name = f"{tag}-{i}"
        span.start_time_unix_nano = 1_700_000_000_000_000_000 + i
        span.end_time_unix_nano = 1_700_000_000_000_000_100 + i
    return request.SerializeToString()


def downstream_for(rec: OtlpRecorder, protocol: str, **kw: object) -> Downstream:
    endpoint = rec.http_endpoint if protocol == "http/protobuf" else rec.grpc_endpoint
    fields: dict[str, object] = {
        "endpoint": endpoint,
        "protocol": protocol,
        "timeout_s": 5.0,
        "insecure": True,
    }
    fields.update(kw)
    return Downstream(**fields)  # type: ignore[arg-type]


def dead_endpoint(protocol: str) -> Downstream:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    endpoint = f"http://{address}/v1/traces" if protocol == "http/protobuf" else address
    return Downstream(endpoint=endpoint, protocol=protocol, timeout_s=1.0, insecure=True)  # type: ignore[arg-type]


async def run_forwarder(
    fwd: Forwarder, bodies: list[tuple[bytes, int]], timeout_s: float = 5.0
) -> ForwardStats:
    """Start, offer every body, flush, shut down; the final stats."""
    fwd.start()
    try:
        for body, count in bodies:
            assert fwd.offer(body, count)
        assert await fwd.flush(timeout_s)
    finally:
        await fwd.shutdown(timeout_s)
    return fwd.stats()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_bytes_arrive_unchanged_and_in_order(
    recorder: OtlpRecorder, protocol: str, compression: str
) -> None:
    bodies = [make_request(3, "a"), make_request(1, "b"), make_request(70_000 // 60, "c")]
    ds = downstream_for(recorder, protocol, compression=compression, headers=(("x-tenant", "t1"),))
    stats = asyncio.run(run_forwarder(Forwarder(ds), [(b, 1) for b in bodies]))

    assert [r.body for r in recorder.requests] == bodies
    assert ForwardStats(3, 3, 0, 0, 0, 0, 0, 0) == stats
    first = recorder.requests[0]
    headers = dict(first.headers)
    assert headers["x-tenant"] == "t1"
    if protocol == "http/protobuf":
        assert headers["content-type"] == "application/x-protobuf"
        assert first.encoding == ("gzip" if compression == "gzip" else "")
    assert [s.name for s in first.spans()] == ["a-0", "a-1", "a-2"]


@pytest.mark.parametrize(
    ("protocol", "failure", "expected_delay"),
    [
        ("http/protobuf", {"http_status": 503, "retry_after": 7}, 7.0),
        ("http/protobuf", {"http_status": 429, "retry_after": "2"}, 2.0),
        ("grpc", {"grpc_code": grpc.StatusCode.UNAVAILABLE, "grpc_retry_delay_s": 1.5}, 1.5),
        (
            "grpc",
            {"grpc_code": grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc_retry_delay_s": 3.25},
            3.25,
        ),
    ],
)
def test_retryable_answer_with_hint_is_retried_once_after_the_hinted_delay(
    recorder: OtlpRecorder, protocol: str, failure: dict[str, object], expected_delay: float
) -> None:
    recorder.fail_next(1, **failure)  # type: ignore[arg-type]
    sleep = RecordingSleep()
    body = make_request(2)
    fwd = Forwarder(downstream_for(recorder, protocol), sleep=sleep)
    stats = asyncio.run(run_forwarder(fwd, [(body, 2)]))

    assert [expected_delay] == sleep.delays
    assert recorder.attempts == 2
    assert [body] == [r.body for r in recorder.requests]
    assert ForwardStats(1, 2, 0, 0, 1, 0, 0, 0) == stats


def test_retry_after_as_http_date_and_cap(recorder: OtlpRecorder) -> None:
    later = format_datetime(datetime.now(timezone.utc) + timedelta(hours=1), usegmt=True)
    recorder.fail_next(1, http_status=503, retry_after=later)
    recorder.fail_next(1, http_status=503, retry_after="3600")
    sleep = RecordingSleep()
    fwd = Forwarder(downstream_for(recorder, "http/protobuf"), max_backoff_s=4.0, sleep=sleep)
    asyncio.run(run_forwarder(fwd, [(make_request(1), 1)]))

    assert sleep.delays == [4.0, 4.0]
    assert len(recorder.requests) == 1


@pytest.mark.parametrize(
    ("protocol", "failure"),
    [
        ("http/protobuf", {"http_status": 400}),
        ("http/protobuf", {"http_status": 500}),
        ("http/protobuf", {"http_status": 413}),
        ("grpc", {"grpc_code": grpc.StatusCode.INVALID_ARGUMENT}),
        ("grpc", {"grpc_code": grpc.StatusCode.UNAUTHENTICATED}),
        # RESOURCE_EXHAUSTED is only retryable when the server says when.
        ("grpc", {"grpc_code": grpc.StatusCode.RESOURCE_EXHAUSTED}),
    ],
)
def test_non_retryable_answer_is_dropped_and_counted_not_retried(
    recorder: OtlpRecorder, protocol: str, failure: dict[str, object]
) -> None:
    recorder.fail_next(1, **failure)  # type: ignore[arg-type]
    sleep = RecordingSleep()
    fwd = Forwarder(downstream_for(recorder, protocol), sleep=sleep)
    stats = asyncio.run(run_forwarder(fwd, [(make_request(4), 4), (make_request(1, "next"), 1)]))

    assert sleep.delays == []
    assert recorder.attempts == 2  # the refused one, once, then the next batch
    assert [s.name for s in recorder.spans()] == ["next-0"]
    assert ForwardStats(1, 1, 1, 4, 0, 1, 0, 0) == stats


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_attempts_are_bounded_with_exponential_backoff(
    recorder: OtlpRecorder, protocol: str
) -> None:
    recorder.fail_next(10, http_status=502, grpc_code=grpc.StatusCode.UNAVAILABLE)
    sleep = RecordingSleep()
    fwd = Forwarder(
        downstream_for(recorder, protocol),
        max_attempts=4,
        initial_backoff_s=1.0,
        max_backoff_s=3.0,
        sleep=sleep,
    )
    stats = asyncio.run(run_forwarder(fwd, [(make_request(2), 2)]))

    assert recorder.attempts == 4
    assert recorder.requests == []
    assert ForwardStats(0, 0, 1, 2, 3, 1, 0, 0) == stats
    # 1 s, 2 s, 4 s doubling, plus up to 1 s of jitter, capped at 3 s.
    low, mid, high = sleep.delays
    assert 1.0 <= low < 2.0
    assert 2.0 <= mid <= 3.0
    assert high == 3.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_dead_downstream_full_queue_offer_stays_fast_and_drops_are_counted(protocol: str) -> None:
    async def scenario() -> tuple[list[bool], float, ForwardStats]:
        sleep = StuckSleep()
        fwd = Forwarder(dead_endpoint(protocol), max_queue_batches=3, sleep=sleep)
        fwd.start()
        body = make_request(5)
        results = [fwd.offer(body, 5) for _ in range(3)]
        # Let the worker take one batch, fail to connect and park in its backoff.
        deadline = time.monotonic() + 5
        while sleep.calls == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        started = time.perf_counter()
        results += [fwd.offer(body, 5) for _ in range(2000)]
        elapsed = time.perf_counter() - started
        stats_before = fwd.stats()
        await fwd.shutdown(0.1)
        return results, elapsed, stats_before

    results, elapsed, stats = asyncio.run(scenario())

    # Three queued, one taken by the worker, then one more fits; the rest is refused.
    assert results == [True] * 4 + [False] * 1999
    assert (
        stats.dropped_batches,
        stats.dropped_spans,
        stats.queued,
        stats.retries,
    ) == (1999, 1999 * 5, 4, 1)
    assert elapsed < 0.5, f"2000 offers took {elapsed:.3f} s"


def test_queue_is_bounded_by_bytes() -> None:
    fwd = Forwarder(dead_endpoint("http/protobuf"), max_queue_bytes=1000)
    assert fwd.offer(b"x" * 600, 1)
    assert not fwd.offer(b"x" * 600, 2)
    assert fwd.offer(b"x" * 400, 3)
    assert not fwd.offer(b"x", 4)
    assert ForwardStats(0, 0, 2, 6, 0, 0, 2, 1000) == fwd.stats()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_with_dead_downstream_returns_within_its_timeout(protocol: str) -> None:
    async def scenario() -> tuple[float, ForwardStats]:
        # Real backoff (asyncio.sleep): the worker would wait 0.5 s, 1 s, ...
        fwd = Forwarder(dead_endpoint(protocol))
        fwd.start()
        for _ in range(5):
            fwd.offer(make_request(2), 2)
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        await fwd.shutdown(0.3)
        return time.perf_counter() - started, fwd.stats()

    elapsed, stats = asyncio.run(scenario())

    assert elapsed < 1.0, f"shutdown took {elapsed:.3f} s"
    assert ForwardStats(0, 0, 5, 10, stats.retries, 0, 0, 0) == stats


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_with_slow_downstream_returns_within_its_timeout(
    recorder: OtlpRecorder, protocol: str
) -> None:
    recorder.set_delay(30)

    async def scenario() -> tuple[float, ForwardStats]:
        fwd = Forwarder(downstream_for(recorder, protocol, timeout_s=20.0))
        fwd.start()
        fwd.offer(make_request(3), 3)
        await asyncio.sleep(0)
        started = time.perf_counter()
        await fwd.shutdown(0.3)
        return time.perf_counter() - started, fwd.stats()

    elapsed, stats = asyncio.run(scenario())

    assert elapsed < 1.0, f"shutdown took {elapsed:.3f} s"
    assert ForwardStats(0, 0, 1, 3, 0, 0, 0, 0) == stats


def test_offer_from_another_thread_is_delivered(recorder: OtlpRecorder) -> None:
    async def scenario() -> ForwardStats:
        fwd = Forwarder(downstream_for(recorder, "http/protobuf"))
        fwd.start()
        offered: list[bool] = []
        bodies = [make_request(1, tag) for tag in "xyz"]
        thread = threading.Thread(target=lambda: offered.extend(fwd.offer(b, 1) for b in bodies))
        thread.start()
        await asyncio.to_thread(thread.join, 5)
        assert offered == [True, True, True]
        recorder_spans = await asyncio.to_thread(recorder.wait_for_spans, 3, 5.0)
        assert [s.name for s in recorder_spans] == ["x-0", "y-0", "z-0"]
        await fwd.shutdown(5)
        return fwd.stats()

    assert ForwardStats(3, 3, 0, 0, 0, 0, 0, 0) == asyncio.run(scenario())


def test_offer_before_start_is_sent_after_start_and_after_shutdown_is_refused(
    recorder: OtlpRecorder,
) -> None:
    async def scenario() -> ForwardStats:
        fwd = Forwarder(downstream_for(recorder, "grpc"))
        assert fwd.offer(make_request(1, "early"), 1)
        fwd.start()
        assert await fwd.flush(5)
        await fwd.shutdown(5)
        assert not fwd.offer(make_request(1, "late"), 1)
        return fwd.stats()

    assert ForwardStats(1, 1, 1, 1, 0, 0, 0, 0) == asyncio.run(scenario())
    assert [s.name for s in recorder.spans()] == ["early-0"]


def test_offer_never_raises_on_garbage() -> None:
    fwd = Forwarder(dead_endpoint("http/protobuf"))
    assert not fwd.offer(None, 3)  # type: ignore[arg-type]
    assert fwd.stats().dropped_batches == 1


def test_flush_times_out_while_downstream_is_stuck(recorder: OtlpRecorder) -> None:
    recorder.set_delay(30)

    async def scenario() -> tuple[bool, float]:
        fwd = Forwarder(downstream_for(recorder, "http/protobuf", timeout_s=20.0))
        fwd.start()
        fwd.offer(make_request(1), 1)
        started = time.perf_counter()
        flushed = await fwd.flush(0.2)
        elapsed = time.perf_counter() - started
        await fwd.shutdown(0.1)
        return flushed, elapsed

    flushed, elapsed = asyncio.run(scenario())
    assert (flushed, 0.15 < elapsed < 1.0) == (False, True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5", 5.0),
        (" 0 ", 0.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 100.0),
        ("Wed, 21 Oct 2015 07:20:00 GMT", 0.0),  # in the past
        ("soon", None),
        ("-3", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    now = datetime(2015, 10, 21, 7, 26, 20, tzinfo=timezone.utc).timestamp()
    assert expected == parse_retry_after(value, now=now)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue_batches": 0},
        {"max_queue_bytes": 0},
        {"max_attempts": 0},
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 5, "max_backoff_s": 1},
        {"max_backoff_s": float("inf")},
    ],
)
def test_bad_limits_fail_in_the_constructor(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Forwarder(dead_endpoint("grpc"), **kwargs)  # type: ignore[arg-type]


def test_recorder_wait_for_spans_predicate_timeout_and_bound() -> None:
    with OtlpRecorder(max_requests=2) as rec:
        fwd_stats = asyncio.run(
            run_forwarder(
                Forwarder(downstream_for(rec, "http/protobuf")),
                [(make_request(1, tag), 1) for tag in "pqr"],
            )
        )
        spans = rec.wait_for_spans(lambda got: any(s.name == "r-0" for s in got), timeout_s=1.0)
        with pytest.raises(TimeoutError, match="got 2 spans"):
            rec.wait_for_spans(3, timeout_s=0.05)

    assert fwd_stats.forwarded_batches == 3
    assert ([s.name for s in spans], rec.attempts, rec.evicted) == (["q-0", "r-0"], 3, 1)


def test_recorder_refuses_wrong_path_and_content_type(recorder: OtlpRecorder) -> None:
    base = recorder.http_endpoint.removesuffix("/v1/traces")
    body = make_request(1)
    wrong_path = httpx.post(f"{base}/v1/logs", content=body, timeout=5)
    wrong_type = httpx.post(
        recorder.http_endpoint, content=body, headers={"content-type": "text/plain"}, timeout=5
    )
    assert (wrong_path.status_code, wrong_type.status_code, recorder.requests) == (404, 415, [])


def test_queue_full_is_logged_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    fwd = Forwarder(dead_endpoint("http/protobuf"), max_queue_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="spanvisor.forward"):
        results = [fwd.offer(b"x" * size, 1) for size in (600, 600, 600, 300, 200, 200)]
    assert results == [True, False, False, True, False, False]
    assert [r.getMessage() for r in caplog.records] == ["forward queue full, dropping"] * 2
