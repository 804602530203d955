"""OTLP/gRPC trace receiver: ``TraceService/Export`` on a ``grpc.aio`` server.

The service is registered as a generic handler whose request deserializer is
the identity, so the handler gets the exact bytes the exporter sent (gRPC has
already undone any message compression): they are forwarded unchanged when
every span is valid, and decoding stays under our control.

Answers follow the OTLP specification and what the OpenTelemetry exporters
act on:

* ``OK`` with an ``ExportTraceServiceResponse`` (``partial_success`` when
  spans were rejected);
* ``INVALID_ARGUMENT`` with the decode error, which exporters do not retry;
* ``RESOURCE_EXHAUSTED`` for a message over the limit. gRPC itself refuses
  messages past ``grpc.max_receive_message_length`` (set just above
  ``max_body_bytes``) before they reach us, with the same code;
* ``UNAVAILABLE`` when the queue or the ingest log is full, with a ``google.rpc.RetryInfo``
  both inside the ``grpc-status-details-bin`` trailer (the standard rich
  status) and as the ``google.rpc.retryinfo-bin`` trailer, which is the key
  the OpenTelemetry Python exporter reads for its next delay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.rpc import status_pb2

from supervisor.errors import ConfigError, IngestError, PayloadTooLarge
from supervisor.ingest import codec
from supervisor.ingest.queue import Batch, IngestQueue
from supervisor.ingest.wal import NoLog, SpanLog

__all__ = ["GrpcReceiver"]

_log = logging.getLogger(__name__)

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


class GrpcReceiver:
    """The OTLP/gRPC trace endpoint; start and stop it on the app's event loop."""

    def __init__(
        self,
        queue: IngestQueue,
        *,
        host: str,
        port: int,
        max_body_bytes: int,
        retry_after_s: float = 1.0,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        ingest_log: SpanLog | None = None,
    ) -> None:
        self._queue = queue
        self._interceptors = tuple(interceptors)  # e.g. the token check of ingest.auth
        #: OK is answered once the request is durable here (see supervisor.ingest.wal).
        self.ingest_log: SpanLog = ingest_log if ingest_log is not None else NoLog()
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._max_body_bytes = max_body_bytes
        self._retry_after_s = retry_after_s
        self._server: Any = None
        self._logged_internal = False

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        if self._server is not None:
            raise RuntimeError("GrpcReceiver already started")
        server = grpc.aio.server(
            interceptors=self._interceptors,
            options=[
                # One byte over the limit still reaches us and gets our own
                # message; anything larger is refused by gRPC itself.
                ("grpc.max_receive_message_length", self._max_body_bytes + 1),
                # gRPC turns SO_REUSEPORT on by default, so a second sidecar on
                # the same port would bind silently and split the traffic.
                ("grpc.so_reuseport", 0),
            ],
        )
        handler = grpc.unary_unary_rpc_method_handler(
            self._export, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Export": handler}),)
        )
        try:
            port = int(server.add_insecure_port(self._address))
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot bind the OTLP/gRPC receiver to {self._address}: {exc}"
            ) from exc
        await server.start()
        self._server = server
        _log.info("OTLP/gRPC receiver listening on %s (port %d)", self._address, port)
        return port

    async def stop(self, grace: float) -> None:
        """Stop accepting calls, let running ones finish within ``grace`` seconds."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    async def _export(self, request: bytes, context: Any) -> bytes:
        """The Export handler: decide an outcome, then answer outside the try."""
        try:
            outcome = await self._handle(request)
        except Exception:
            self._queue.record_internal_error()
            if not self._logged_internal:
                self._logged_internal = True
                _log.exception("OTLP/gRPC receiver failed on a request (logged once, counted)")
            outcome = (grpc.StatusCode.INTERNAL, "internal error in the receiver", ())
        if isinstance(outcome, bytes):
            return outcome
        code, details, trailers = outcome
        await context.abort(code, details, trailing_metadata=trailers)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def _handle(
        self, raw: bytes
    ) -> bytes | tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
        received_ns = time.time_ns()
        if not self._queue.reserve(len(raw)):
            return self._throttled()
        try:
            request, validation = await self._queue.decoder.decode(
                len(raw), lambda: self._decode(raw)
            )
        except PayloadTooLarge as exc:
            self._queue.record_too_large()
            _log.debug("OTLP/gRPC request too large: %s", exc)
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), ()
        except IngestError as exc:
            self._queue.record_decode_error()
            _log.debug("OTLP/gRPC request undecodable: %s", exc)
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
        finally:
            self._queue.release(len(raw))
        if validation.accepted:
            batch = Batch(
                request=request,
                raw_protobuf=raw if not validation.rejected else request.SerializeToString(),
                received_ns=received_ns,
                transport="grpc",
                span_count=validation.accepted,
            )
            if not await self.ingest_log.admit(batch, self._queue.offer):
                return self._throttled()
        self._queue.record_rejected(validation.rejected, "grpc")
        return codec.encode_response(validation.rejected, validation.message, json=False)

    def _decode(self, raw: bytes) -> tuple[Any, codec.Validation]:
        payload = codec.decompress(raw, content_encoding="identity", max_bytes=self._max_body_bytes)
        request = codec.decode_spans(payload)
        return request, codec.validate_spans(request)

    def _throttled(self) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
        message = "spanvisor ingest queue is full; retry later"
        info = codec.retry_info(self._retry_after_s)
        status = status_pb2.Status(code=codec.UNAVAILABLE, message=message)
        status.details.add().Pack(info)
        trailers = (
            ("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", info.SerializeToString()),
        )
        return grpc.StatusCode.UNAVAILABLE, message, trailers
