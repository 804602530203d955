"""A real OTLP trace receiver on loopback that records what it gets.

Tests and the demo point real exporters (the forwarder, the OpenTelemetry
SDK) at it instead of a Jaeger: it speaks OTLP/HTTP (``POST /v1/traces``,
protobuf, optionally gzipped) and OTLP/gRPC (``TraceService/Export``) on
``127.0.0.1`` with ephemeral ports, keeps every accepted request (bounded),
and can be told to refuse or delay answers to play a broken downstream.
Waiting is by condition variable with a deadline, never a fixed sleep.

    with OtlpRecorder() as rec:
        exporter = OTLPSpanExporter(endpoint=rec.http_endpoint)
        ...
        spans = rec.wait_for_spans(3, timeout_s=5)
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from supervisor.testing.loopback import LOOPBACK, LoopbackHTTPServer, LoopbackServer

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
_PATH = "/v1/traces"
_MAX_BODY = 64 * 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class RecordedRequest:
    """One accepted export request: its decompressed bytes and what they decode to."""

    protocol: Literal["http", "grpc"]
    body: bytes
    request: ExportTraceServiceRequest
    #: Header / metadata names lowercased.
    headers: tuple[tuple[str, str], ...]
    #: ``Content-Encoding`` of an HTTP request, ``""`` when none; always ``""``
    #: for gRPC, whose server decompresses without telling the handler.
    encoding: str

    def spans(self) -> list[Span]:
        return list(iter_spans(self.request))


@dataclass(frozen=True)
class PlannedFailure:
    """How to refuse one request, on whichever protocol it arrives."""

    http_status: int = 503
    #: The ``Retry-After`` header value, e.g. ``"1"``; None sends none.
    retry_after: str | None = None
    grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    #: A RetryInfo delay in the gRPC status details; None sends none.
    grpc_retry_delay_s: float | None = None
    message: str = "refused by OtlpRecorder"


class OtlpRecorder:
    """OTLP/HTTP and OTLP/gRPC receivers that record, refuse or stall on demand."""

    def __init__(self, *, max_requests: int = 10_000, host: str = LOOPBACK) -> None:
        self._host = host
        self._cond = threading.Condition()
        self._requests: deque[RecordedRequest] = deque(maxlen=max_requests)
        self._failures: deque[PlannedFailure] = deque()
        self._delay_s = 0.0
        self._closing = threading.Event()
        #: Requests received, accepted or not.
        self.attempts = 0
        #: Requests answered with a planned failure.
        self.refused = 0
        #: Accepted requests pushed out of the bounded list.
        self.evicted = 0
        self._http = LoopbackServer(_Handler, self, host=host, name="otlp-recorder-http")
        self._grpc: Any = None
        self._grpc_pool: futures.ThreadPoolExecutor | None = None
        self.http_port = 0
        self.grpc_port = 0

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> OtlpRecorder:
        """Bind both receivers on ephemeral ports and serve in background threads."""
        self.http_port = self._http.start().port

        self._grpc_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="otlp-rec")
        self._grpc = grpc.server(self._grpc_pool)
        handler = grpc.unary_unary_rpc_method_handler(self._grpc_export)
        self._grpc.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Export": handler}),)
        )
        self.grpc_port = int(self._grpc.add_insecure_port(f"{self._host}:0"))
        self._grpc.start()
        return self

    def close(self) -> None:
        """Stop both receivers; stalled answers are released at once."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._grpc_pool is not None:
            self._grpc_pool.shutdown(wait=True)
            self._grpc_pool = None
        self._http.stop(5)

    def __enter__(self) -> OtlpRecorder:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def http_endpoint(self) -> str:
        """The full OTLP/HTTP traces URL, e.g. ``http://127.0.0.1:PORT/v1/traces``."""
        return f"http://{self._host}:{self.http_port}{_PATH}"

    @property
    def grpc_endpoint(self) -> str:
        """``127.0.0.1:PORT`` (plaintext)."""
        return f"{self._host}:{self.grpc_port}"

    # -- knobs -----------------------------------------------------------------

    def fail_next(
        self,
        count: int = 1,
        *,
        http_status: int = 503,
        retry_after: str | float | None = None,
        grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        grpc_retry_delay_s: float | None = None,
    ) -> None:
        """Refuse the next ``count`` requests (either protocol) this way."""
        planned = PlannedFailure(
            http_status=http_status,
            retry_after=None if retry_after is None else _header_number(retry_after),
            grpc_code=grpc_code,
            grpc_retry_delay_s=grpc_retry_delay_s,
        )
        with self._cond:
            self._failures.extend([planned] * count)

    def set_delay(self, seconds: float) -> None:
        """Hold every answer this long from now on (0 to stop): a slow downstream."""
        with self._cond:
            self._delay_s = max(0.0, seconds)

    def clear(self) -> None:
        """Forget what was recorded and any planned failures."""
        with self._cond:
            self._requests.clear()
            self._failures.clear()
            self.attempts = self.refused = self.evicted = 0

    # -- reading -----------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """Accepted requests so far, oldest first (a snapshot)."""
        with self._cond:
            return list(self._requests)

    def spans(self) -> list[Span]:
        """Every span of every accepted request, in arrival order."""
        return [span for req in self.requests for span in req.spans()]

    def wait_for_spans(
        self, what: int | Callable[[list[Span]], bool], timeout_s: float = 5.0
    ) -> list[Span]:
        """Every span received once there are ``what`` of them (a count), or once
        ``what(spans)`` is true (a predicate over all spans so far).

        Raises TimeoutError, saying how many spans did arrive, at the deadline.
        """

        def ready() -> list[Span] | None:
            spans = [span for req in self._requests for span in req.spans()]
            done = len(spans) >= what if isinstance(what, int) else what(spans)
            return spans if done else None

        return self._wait(ready, timeout_s, lambda: f"{len(self.spans())} spans")

    def wait_for_attempts(self, count: int, timeout_s: float = 5.0) -> int:
        """Wait until at least ``count`` requests arrived (accepted or refused)."""
        return self._wait(
            lambda: self.attempts if self.attempts >= count else None,
            timeout_s,
            lambda: f"{self.attempts} requests",
        )

    def _wait(self, ready: Callable[[], T | None], timeout_s: float, seen: Callable[[], str]) -> T:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                result = ready()
                if result is not None:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing.is_set():
                    break
                self._cond.wait(remaining)
        raise TimeoutError(f"OtlpRecorder: condition not met within {timeout_s} s; got {seen()}")

    # -- the receiving side (server threads) ------------------------------------

    def _admit(self) -> PlannedFailure | None:
        """Count an arriving request, stall if asked, and say whether to refuse it."""
        with self._cond:
            self.attempts += 1
            delay = self._delay_s
            planned = self._failures.popleft() if self._failures else None
            if planned is not None:
                self.refused += 1
            self._cond.notify_all()
        if delay > 0:
            self._closing.wait(delay)
        return planned

    def _record(self, item: RecordedRequest) -> None:
        with self._cond:
            if len(self._requests) == self._requests.maxlen:
                self.evicted += 1
            self._requests.append(item)
            self._cond.notify_all()

    def _grpc_export(self, body: bytes, context: Any) -> bytes:
        planned = self._admit()
        if planned is not None:
            if planned.grpc_retry_delay_s is not None:
                context.set_trailing_metadata(_retry_info_trailers(planned))
            context.abort(planned.grpc_code, planned.message)
        try:
            request = ExportTraceServiceRequest.FromString(body)
        except Exception:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not an ExportTraceServiceRequest")
            return b""  # abort raises; this is never reached
        metadata = tuple(
            (k.lower(), v) for k, v in context.invocation_metadata() if isinstance(v, str)
        )
        self._record(RecordedRequest("grpc", body, request, metadata, ""))
        return bytes(ExportTraceServiceResponse().SerializeToString())


def _retry_info_trailers(planned: PlannedFailure) -> tuple[tuple[str, bytes], ...]:
    """RetryInfo both where gRPC puts status details and where the OTel Python SDK looks."""
    assert planned.grpc_retry_delay_s is not None
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(planned.grpc_retry_delay_s * 1e9))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=planned.grpc_code.value[0], message=planned.message)
    status.details.add().Pack(info)
    return (
        ("grpc-status-details-bin", status.SerializeToString()),
        ("google.rpc.retryinfo-bin", info.SerializeToString()),
    )


def _header_number(value: str | float) -> str:
    if isinstance(value, str):
        return value
    return str(int(value)) if float(value).is_integer() else str(value)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LoopbackHTTPServer[OtlpRecorder]
    # Idle keep-alive connections end on their own.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:  # stdlib's parameter name
        return  # quiet: tests read the recorder, not stderr

    def do_POST(self) -> None:
        recorder = self.server.context
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > _MAX_BODY:
            self._answer(413, b"too large")
            return
        raw = self.rfile.read(length)
        if self.path.split("?", 1)[0] != _PATH:
            self._answer(404, b"not found")
            return
        planned = recorder._admit()
        if planned is not None:
            extra = {} if planned.retry_after is None else {"Retry-After": planned.retry_after}
            self._answer(planned.http_status, planned.message.encode(), extra)
            return
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type != "application/x-protobuf":
            self._answer(415, b"only application/x-protobuf")
            return
        encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
        try:
            body = gzip.decompress(raw) if encoding == "gzip" else raw
            request = ExportTraceServiceRequest.FromString(body)
        except Exception:
            self._answer(400, b"not an ExportTraceServiceRequest")
            return
        headers = tuple((k.lower(), v) for k, v in self.headers.items())
        recorder._record(RecordedRequest("http", body, request, headers, encoding))
        self._answer(
            200,
            ExportTraceServiceResponse().SerializeToString(),
            {"Content-Type": "application/x-protobuf"},
        )

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def iter_spans(request: ExportTraceServiceRequest) -> Iterator[Span]:
    """Every span of an export request."""
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            yield from ss.spans
