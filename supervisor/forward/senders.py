"""How a batch reaches the downstream: OTLP/HTTP or OTLP/gRPC, and what its answer means.

A sender sends a body as the agent exported it (gzipped when configured) and
says how the downstream answered: success, :class:`Retryable` (with the
downstream's own delay, from ``Retry-After`` or gRPC ``RetryInfo``, when it
gave one) or :class:`Rejected`, as the OTLP specification classifies them.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Any, Final, cast

import grpc
import grpc.aio
import httpx
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from supervisor.errors import DeliveryError
from supervisor.forward.downstream import Downstream
from supervisor.retry_after import parse_retry_after

log = logging.getLogger("spanvisor.forward")

EXPORT_METHOD: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
#: OTLP/HTTP answers worth retrying (the OTLP specification's list).
RETRYABLE_HTTP: Final = frozenset({429, 502, 503, 504})
#: gRPC codes worth retrying; RESOURCE_EXHAUSTED only when the server sent RetryInfo.
RETRYABLE_GRPC: Final = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Bodies above this are gzipped off the event loop.
_GZIP_INLINE_MAX: Final = 64 * 1024
# How much of a downstream's answer is read (an OTLP response is tiny).
_MAX_RESPONSE_BYTES: Final = 64 * 1024


class Retryable(DeliveryError):
    """The downstream may take the batch later; ``retry_after_s`` is its own hint."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Rejected(DeliveryError):
    """The downstream refused the batch for good."""


class Sender:
    """One transport to the downstream: send a prepared body, or raise Retryable/Rejected."""

    async def prepare(self, body: bytes) -> bytes:
        return body

    async def send(self, body: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class HttpSender(Sender):
    """``POST`` to the OTLP/HTTP endpoint with ``application/x-protobuf``."""

    def __init__(self, downstream: Downstream) -> None:
        self._url = downstream.http_url
        self._timeout_s = downstream.timeout_s
        self._gzip = downstream.compression == "gzip"
        headers = downstream.header_dict
        headers["content-type"] = "application/x-protobuf"
        if self._gzip:
            headers["content-encoding"] = "gzip"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(downstream.timeout_s),
            limits=httpx.Limits(max_connections=2, max_keepalive_connections=1),
            follow_redirects=False,
        )

    async def prepare(self, body: bytes) -> bytes:
        if not self._gzip:
            return body
        if len(body) <= _GZIP_INLINE_MAX:
            return gzip.compress(body)
        return await asyncio.to_thread(gzip.compress, body)

    async def send(self, body: bytes) -> None:
        try:
            # httpx times each phase; this bounds the whole exchange.
            response, answer = await asyncio.wait_for(self._post(body), self._timeout_s)
        except asyncio.TimeoutError as exc:
            raise Retryable(f"no answer within {self._timeout_s} s") from exc
        except httpx.TransportError as exc:  # connect, read, write, timeouts
            raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise Rejected(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if 200 <= status < 300:
            _log_partial_success(answer)
            return
        if status in RETRYABLE_HTTP:
            hint = parse_retry_after(response.headers.get("retry-after"))
            raise Retryable(f"HTTP {status}", retry_after_s=hint)
        raise Rejected(f"HTTP {status}")

    async def _post(self, body: bytes) -> tuple[httpx.Response, bytes]:
        async with self._client.stream("POST", self._url, content=body) as response:
            return response, await _read_bounded(response)

    async def close(self) -> None:
        await self._client.aclose()


async def _read_bounded(response: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= _MAX_RESPONSE_BYTES:
            break
    return b"".join(chunks)[:_MAX_RESPONSE_BYTES]


def _log_partial_success(answer: bytes) -> None:
    if not answer:
        return
    try:
        response = ExportTraceServiceResponse.FromString(answer)
    except Exception:  # the body is informational only
        return
    rejected = response.partial_success.rejected_spans
    if rejected:
        log.warning(
            "downstream rejected part of a batch",
            extra={
                "rejected_spans": rejected,
                "detail": response.partial_success.error_message[:200],
            },
        )


class GrpcSender(Sender):
    """``TraceService/Export`` over ``grpc.aio`` with identity serializers (bytes in, bytes out)."""

    def __init__(self, downstream: Downstream) -> None:
        self._timeout_s = downstream.timeout_s
        self._metadata = tuple(downstream.header_dict.items())
        gzipped = downstream.compression == "gzip"
        self._compression = grpc.Compression.Gzip if gzipped else grpc.Compression.NoCompression
        target = downstream.grpc_target
        if downstream.grpc_insecure:
            self._channel: Any = grpc.aio.insecure_channel(target)
        else:
            self._channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
        # No serializers: the agent's bytes go out exactly as received.
        self._export: Any = self._channel.unary_unary(EXPORT_METHOD)

    async def send(self, body: bytes) -> None:
        try:
            await self._export(
                body,
                timeout=self._timeout_s,
                metadata=self._metadata,
                compression=self._compression,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            delay = retry_delay_from_metadata(exc.trailing_metadata())
            message = f"gRPC {getattr(code, 'name', code)}: {exc.details()}"
            throttled = code == grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None
            if code in RETRYABLE_GRPC or throttled:
                raise Retryable(message, retry_after_s=delay) from exc
            raise Rejected(message) from exc

    async def close(self) -> None:
        await self._channel.close(None)


def retry_delay_from_metadata(metadata: Any) -> float | None:
    """The RetryInfo delay (seconds) in gRPC trailing metadata, or None.

    Read from the standard ``grpc-status-details-bin`` (a ``google.rpc.Status``
    whose details hold a ``RetryInfo``) and from ``google.rpc.retryinfo-bin``,
    which the OpenTelemetry Python exporter reads.
    """
    if not metadata:
        return None
    try:
        items = cast("list[tuple[str, Any]]", list(metadata))
    except TypeError:
        return None
    for key, value in items:
        if not isinstance(value, bytes):
            continue
        try:
            if key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                for detail in status.details:
                    info = error_details_pb2.RetryInfo()
                    if detail.Unpack(info):
                        return _duration_s(info)
            elif key == "google.rpc.retryinfo-bin":
                return _duration_s(error_details_pb2.RetryInfo.FromString(value))
        except Exception:  # a malformed hint is no hint
            log.debug("ignoring a malformed RetryInfo", exc_info=True)
    return None


def _duration_s(info: Any) -> float:
    return max(0.0, float(info.retry_delay.seconds) + float(info.retry_delay.nanos) / 1e9)
