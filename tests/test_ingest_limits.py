"""No single request makes the others wait, and ingest memory is bounded in bytes.

Gzip is inflated in linear time with a bounded number of members; big bodies
are decoded in slices off the loop; big batches are read in slices; the bytes
ingest holds are bounded (then OTLP throttling); a body trickled in too slowly
is answered 408. Real sockets where the behaviour is the network's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from supervisor.errors import IngestError, PayloadTooLarge
from supervisor.ingest import codec
from supervisor.ingest.queue import Batch, IngestQueue
from supervisor.ingest.slices import Unsliceable, merge_in_slices
from supervisor.normalize.wire import LiteRequest
from tests.test_ingest_receivers import PB, Receivers, good_request, status_of

MAX = 64 * 1024 * 1024


def many_spans(n: int, failing_every: int = 10) -> bytes:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(key="service.name").value.string_value = "svc"
    resource_spans.schema_url = "https://example.com/schema"  # unknown to the lite schema
    scope = resource_spans.scope_spans.add()
    scope.scope.name = "lib"
    for i in range(n):
        span = scope.spans.add(
            trace_id=(i // 10 + 1).to_bytes(16, "big"),
            span_id=(i + 1).to_bytes(8, "big"),
            name=f"call {i % 7}",
            start_time_unix_nano=1_700_000_000_000_000_000 + i,
            end_time_unix_nano=1_700_000_000_000_100_000 + i,
        )
        span.attributes.add(key="input.value").value.string_value = "x" * 40
        if i % failing_every == 0:
            span.status.code = 2
            span.status.message = "upstream timed out"
    return request.SerializeToString()


# ------------------------------------------------------------------------ gzip


def test_two_hundred_thousand_empty_gzip_members_are_refused_at_once() -> None:
    body = gzip.compress(b"") * 200_000  # 4 MB; the old inflater took tens of seconds
    started = time.monotonic()
    with pytest.raises(IngestError) as info:
        codec.decompress(body, content_encoding="gzip", max_bytes=MAX)
    assert time.monotonic() - started < 1.0
    assert f"more than {codec.MAX_GZIP_MEMBERS} members" in str(info.value)
    assert not isinstance(info.value, PayloadTooLarge)  # a 400, not a 413


def test_up_to_the_member_limit_still_inflates() -> None:
    raw = good_request(*(f"s{i}" for i in range(50))).SerializeToString()
    pieces = [raw[i : i + 1] for i in range(len(raw))][: codec.MAX_GZIP_MEMBERS - 1]
    body = b"".join(gzip.compress(p) for p in pieces) + gzip.compress(raw[len(pieces) :])
    assert codec.decompress(body, content_encoding="gzip", max_bytes=MAX) == raw


def test_member_spanning_many_input_slices_and_a_bomb() -> None:
    data = os.urandom(300_000)  # incompressible: several 64 KiB input slices
    assert codec.decompress(gzip.compress(data), content_encoding="gzip", max_bytes=MAX) == data
    bomb = gzip.compress(bytes(256 * 1024 * 1024))
    started = time.monotonic()
    with pytest.raises(PayloadTooLarge):
        codec.decompress(bomb, content_encoding="gzip", max_bytes=MAX)
    assert time.monotonic() - started < 5.0


@pytest.fixture
def rx() -> Iterator[Receivers]:
    receivers = Receivers()
    yield receivers
    receivers.close()


def test_many_members_over_http_are_a_clear_400(rx: Receivers) -> None:
    body = gzip.compress(b"") * 200_000
    headers = {"Content-Type": PB, "Content-Encoding": "gzip"}
    response = httpx.post(rx.url, content=body, headers=headers, timeout=30)
    assert response.status_code == 400
    assert "members" in status_of(response).message


# ---------------------------------------------------------------------- slices


def test_decoding_in_slices_gives_what_one_parse_gives() -> None:
    payload = many_spans(3000)
    whole = LiteRequest.FromString(payload)
    for slice_bytes in (64, 1000, 50_000):
        sliced = LiteRequest()
        merge_in_slices(sliced, payload, slice_bytes)
        assert sliced == whole
        assert sliced.SerializeToString() == whole.SerializeToString()


def test_a_payload_the_walk_cannot_follow_is_left_to_the_whole_parse() -> None:
    with pytest.raises(Unsliceable):
        merge_in_slices(LiteRequest(), b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 4)
    with pytest.raises(IngestError) as info:  # the usual message, by the whole parse
        codec.decode_spans(b"\x0a\x05abc" + b"\x00" * (400 * 1024))
    assert "protobuf parse failed" in str(info.value)


# ---------------------------------------------------------------- byte bound


def batch_of(nbytes: int, spans: int = 1) -> Batch:
    return Batch(
        request=None,
        raw_protobuf=b"x" * nbytes,
        received_ns=0,
        transport="grpc",
        span_count=spans,
    )


def test_queue_bounds_the_bytes_it_holds() -> None:
    queue = IngestQueue(max_batches=100, max_spans=1000, max_bytes=1000)
    first, second = batch_of(600), batch_of(300)
    assert queue.offer(first) and queue.offer(second)
    assert not queue.offer(batch_of(200))  # 1100 > 1000
    assert not queue.reserve(200)  # a body to decode counts as well
    stats = queue.stats()
    assert (stats.queued_bytes, stats.throttled_for_bytes, stats.throttled_batches) == (900, 2, 2)
    taken = queue.get_nowait()
    assert taken is first
    queue.task_done(taken)  # released once judged
    assert queue.reserve(500)
    assert queue.stats().queued_bytes == 800
    assert not queue.offer(batch_of(300))  # what is being decoded holds its place
    queue.release(500)
    assert queue.offer(batch_of(300))


def test_one_request_over_the_byte_bound_passes_alone() -> None:
    queue = IngestQueue(max_batches=100, max_spans=1000, max_bytes=1000)
    assert queue.reserve(5000)
    queue.release(5000)
    assert queue.offer(batch_of(5000))  # nothing else held: admitted, or never
    assert not queue.offer(batch_of(1))


@pytest.fixture
def byte_bound() -> Iterator[Receivers]:
    receivers = Receivers(max_bytes=4096)
    yield receivers
    receivers.close()


def test_byte_bound_throttles_both_transports_as_otlp_asks(byte_bound: Receivers) -> None:
    big = good_request(*(f"span-with-a-long-name-{i:04d}" for i in range(200))).SerializeToString()
    assert len(big) > 4096
    first = httpx.post(byte_bound.url, content=big, headers={"Content-Type": PB})
    assert first.status_code == 200  # alone, a request over the bound passes
    response = httpx.post(byte_bound.url, content=big, headers={"Content-Type": PB})
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    with pytest.raises(grpc.RpcError) as info:
        byte_bound.export(big, timeout=10)
    error = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    trailers = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    assert error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
    stats = byte_bound.stats()
    assert stats.throttled_for_bytes >= 2
    assert stats.throttled_batches >= 2
    assert stats.queued_bytes == len(big)
    byte_bound.drain()
    again = httpx.post(byte_bound.url, content=big, headers={"Content-Type": PB})
    assert again.status_code == 200


def test_a_declared_body_past_the_byte_bound_is_refused_before_it_is_read(
    byte_bound: Receivers,
) -> None:
    # Bodies being received count too: eight senders of big bodies held memory no
    # bound saw. A declared length that does not fit is answered at once, unread.
    big = good_request(*(f"span-with-a-long-name-{i:04d}" for i in range(200))).SerializeToString()
    assert httpx.post(byte_bound.url, content=big, headers={"Content-Type": PB}).status_code == 200
    host, port = byte_bound.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 100000\r\n\r\n"  # and no body: it is never sent
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"retry-after: 1" in answer.lower()
    assert b"connection: close" in answer.lower()


def test_settings_carry_the_byte_bound_and_read_timeout() -> None:
    from supervisor.settings import load_settings

    settings = load_settings(None, {"ingest_queue_bytes": 4096, "http_read_timeout_s": 2})
    assert (settings.ingest_queue_bytes, settings.http_read_timeout_s) == (4096, 2.0)
    default = load_settings(None, {})
    assert default.ingest_queue_bytes == 256 * 1024 * 1024


# ------------------------------------------------------------- slow clients


@pytest.fixture
def impatient() -> Iterator[Receivers]:
    receivers = Receivers(read_timeout_s=0.5)
    yield receivers
    receivers.close()


def test_a_trickled_body_gets_408_and_the_connection_closes(impatient: Receivers) -> None:
    with socket.create_connection(("127.0.0.1", impatient.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        sock.settimeout(0.05)
        answer = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # One byte at a time, never the whole body. Once the server closed, its
            # answer may still be there to read.
            with contextlib.suppress(OSError):
                sock.sendall(b"\x0a")
            try:
                got = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break  # reset: nothing more to read
            if not got:
                break
            answer += got
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"connection: close" in answer.lower()
    assert impatient.stats().read_timeouts == 1
    body = good_request("after").SerializeToString()  # and it still serves
    assert httpx.post(impatient.url, content=body, headers={"Content-Type": PB}).status_code == 200


# -------------------------------------------------------------- judging in slices


def _sidecar(folder: Path):  # type: ignore[no-untyped-def]
    from policies import load_policy
    from supervisor.settings import load_settings
    from supervisor.wiring import build_sidecar

    settings = load_settings(None, {"state_path": str(folder / "state.db")})
    return build_sidecar(settings, load_policy())


def test_the_worker_gives_the_loop_back_while_reading_a_big_batch(tmp_path: Path) -> None:
    sidecar = _sidecar(tmp_path)
    payload = many_spans(20_000)
    batch = Batch(codec.decode_spans(payload), payload, time.time_ns(), "grpc", 20_000)

    async def scenario() -> tuple[int, bool]:
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await sidecar._handle_in_slices(batch)
        done = True
        await task
        return ticks, sidecar._between_batches.is_set()

    try:
        ticks, settled = asyncio.run(scenario())  # the writer only queues: not started
    finally:
        sidecar.store.close()
    assert ticks > 5  # 20,000 spans take far more than one 10 ms slice
    assert settled


# ------------------------------------------------------------ slow headers


def _closed_while_trickling(port: int, head: bytes, within_s: float) -> bool:
    """Send ``head`` a byte every 20 ms; True when the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(0.02)
        deadline = time.monotonic() + within_s
        sent = 0
        while time.monotonic() < deadline:
            try:
                if sock.recv(4096) == b"":
                    return True
            except TimeoutError:
                pass
            except ConnectionError:
                return True
            try:
                sock.sendall(head[sent % len(head) : sent % len(head) + 1])
            except OSError:
                return True
            sent += 1
    return False


def test_headers_trickled_in_close_the_connection(tmp_path: Path) -> None:
    from policies import load_policy
    from supervisor.app import BackgroundSidecar
    from supervisor.settings import load_settings
    from supervisor.wiring import build_sidecar

    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": "tok",
            "token_file": str(tmp_path / "token"),
            "state_path": str(tmp_path / "state.db"),
            "http_read_timeout_s": 0.5,
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy()))
    ports = background.start()
    try:
        head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        assert _closed_while_trickling(ports.otlp_http, head, within_s=10)
        assert _closed_while_trickling(
            ports.api, b"GET /healthz HTTP/1.1\r\nX: " + b"b" * 10_000, 10
        )
        # A client that is not slow is served as before, on both.
        healthz = httpx.get(f"http://127.0.0.1:{ports.api}/healthz", timeout=10)
        assert healthz.status_code == 200
        body = good_request("ok").SerializeToString()
        url = f"http://127.0.0.1:{ports.otlp_http}/v1/traces"
        assert httpx.post(url, content=body, headers={"Content-Type": PB}).status_code == 200
    finally:
        background.stop()
