"""OTLP/HTTP trace receiver: ``POST /v1/traces`` in protobuf or JSON, gzip or not.

It answers the way the OTLP specification asks, so real exporters do the
right thing without being told about us: 200 with an
``ExportTraceServiceResponse`` (and ``partial_success`` when spans were
rejected), 400/413/415 with a ``google.rpc.Status`` body for requests that
must not be retried, and 503 with ``Retry-After`` when the queue is full, which
exporters retry. Every answer uses the encoding the request came in. A 200
is sent only once the request is in the ingest log
(:mod:`supervisor.ingest.wal`), so it is judged even after a crash; when the
log is full the answer is 503 too.

The body is read with a bound: a Content-Length or a stream far over the limit
is refused without reading it all; one modestly over is drained first, so the
client reliably gets its 413 instead of a reset connection. It is read with a
deadline too (``read_timeout_s``): a client trickling its body gets 408 and
holds the connection no longer. Bodies are decoded in a worker thread (big
protobuf ones in slices, :mod:`.slices`), so the event loop keeps answering,
and the bytes being decoded count against the queue's byte bound.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from supervisor.errors import IngestError, PayloadTooLarge
from supervisor.ingest import codec
from supervisor.ingest.codec import UnsupportedContentType
from supervisor.ingest.queue import Batch, IngestQueue, Transport
from supervisor.ingest.wal import NoLog, SpanLog

__all__ = ["build_otlp_http_app"]

_log = logging.getLogger(__name__)

#: A body up to this many times the wire limit is drained before answering
#: 413; past it the connection is simply not read any further.
_DRAIN_FACTOR = 4


def build_otlp_http_app(
    queue: IngestQueue,
    *,
    max_body_bytes: int,
    retry_after_s: float = 1.0,
    read_timeout_s: float = 30.0,
    ingest_log: SpanLog | None = None,
) -> Starlette:
    """An ASGI app serving ``POST /v1/traces`` into ``queue``.

    ``max_body_bytes`` bounds the decompressed payload; ``retry_after_s`` is
    what a throttled client is told to wait (sent as whole seconds, at least 1);
    ``read_timeout_s`` bounds the time to read one body (then 408);
    ``ingest_log`` is where an accepted request is made durable before the 200.
    """
    receiver = _HttpReceiver(
        queue,
        max_body_bytes=max_body_bytes,
        retry_after_s=retry_after_s,
        read_timeout_s=read_timeout_s,
    )
    receiver.ingest_log = ingest_log if ingest_log is not None else NoLog()
    return Starlette(routes=[Route("/v1/traces", receiver.export, methods=["POST"])])


class _TooLargeOnWire(PayloadTooLarge):
    """The body is over the limit before any decompression."""


class _HttpReceiver:
    def __init__(
        self,
        queue: IngestQueue,
        *,
        max_body_bytes: int,
        retry_after_s: float,
        read_timeout_s: float,
    ) -> None:
        self._queue = queue
        self._max_body_bytes = max_body_bytes
        self._read_timeout_s = read_timeout_s
        self._retry_after = str(max(1, math.ceil(retry_after_s)))
        self._logged_internal = False
        self.ingest_log: SpanLog = NoLog()

    async def export(self, request: Request) -> Response:
        """The route handler; never raises (a bug of ours becomes a 500)."""
        as_json = _wants_json(request.headers.get("content-type", ""))
        try:
            return await self._export(request)
        except ClientDisconnect:
            _log.debug("OTLP/HTTP client went away before sending its whole body")
            return Response(status_code=400)
        except Exception:
            self._queue.record_internal_error()
            if not self._logged_internal:
                self._logged_internal = True
                _log.exception("OTLP/HTTP receiver failed on a request (logged once, counted)")
            return _status(500, codec.INTERNAL, "internal error in the receiver", as_json=as_json)

    async def _export(self, request: Request) -> Response:
        received_ns = time.time_ns()
        content_type = request.headers.get("content-type", "")
        encoding = request.headers.get("content-encoding", "")
        try:
            media = codec.media_type(content_type)
            # Checked before reading the body, so a bad type costs nothing.
            coding = codec.content_coding(encoding)
        except UnsupportedContentType as exc:
            self._queue.record_decode_error()
            return _status(415, codec.INVALID_ARGUMENT, str(exc), as_json=False)
        as_json = media == codec.JSON
        # A body counts in ingest's byte bound from before it is read, when its
        # length is declared: eight senders of 14 MB bodies otherwise held 112 MB
        # that no bound saw. A chunked body counts once it is read.
        declared = request.headers.get("content-length", "")
        reserved = int(declared) if declared.isdigit() else 0
        if reserved and not self._queue.reserve(reserved):
            return self._throttled(as_json, close=True)  # its body was not read
        try:
            try:
                body = await asyncio.wait_for(
                    self._read_body(request, coding), self._read_timeout_s
                )
            except asyncio.TimeoutError:
                self._queue.record_read_timeout()
                _log.debug("OTLP/HTTP body not read within %s s", self._read_timeout_s)
                return _status(
                    408,
                    codec.INVALID_ARGUMENT,
                    f"request body not received within {self._read_timeout_s:g} s",
                    as_json=as_json,
                    close=True,
                )
            if not reserved:
                if not self._queue.reserve(len(body)):
                    return self._throttled(as_json)
                reserved = len(body)
            decoded = await self._queue.decoder.decode(
                len(body), lambda: self._decode(body, coding=coding, media=media)
            )
        except PayloadTooLarge as exc:
            self._queue.record_too_large()
            _log.debug("OTLP/HTTP request too large: %s", exc)
            return _status(413, codec.RESOURCE_EXHAUSTED, str(exc), as_json=as_json)
        except IngestError as exc:
            self._queue.record_decode_error()
            _log.debug("OTLP/HTTP request undecodable: %s", exc)
            return _status(400, codec.INVALID_ARGUMENT, str(exc), as_json=as_json)
        finally:
            self._queue.release(reserved)

        request_pb, raw_protobuf, validation = decoded
        transport: Transport = "http/json" if as_json else "http/protobuf"
        if validation.accepted:
            batch = Batch(
                request=request_pb,
                raw_protobuf=raw_protobuf,
                received_ns=received_ns,
                transport=transport,
                span_count=validation.accepted,
            )
            # Acknowledged only once durable (the log, when full, throttles too).
            if not await self.ingest_log.admit(batch, self._queue.offer):
                return self._throttled(as_json)
        self._queue.record_rejected(validation.rejected, transport)
        return Response(
            codec.encode_response(validation.rejected, validation.message, json=as_json),
            status_code=200,
            media_type=codec.JSON if as_json else codec.PROTOBUF,
        )

    def _throttled(self, as_json: bool, *, close: bool = False) -> Response:
        return _status(
            503,
            codec.UNAVAILABLE,
            "spanvisor ingest queue is full; retry later",
            as_json=as_json,
            retry_after=self._retry_after,
            close=close,
        )

    def _decode(
        self, body: bytes, *, coding: str, media: str
    ) -> tuple[Any, bytes, codec.Validation]:
        """Decompress, decode and validate; the bytes are what gets forwarded."""
        payload = codec.decompress(body, content_encoding=coding, max_bytes=self._max_body_bytes)
        if media == codec.JSON:  # forwarded, and read, as protobuf
            payload = codec.decode_payload(payload, media=media).SerializeToString()
        request = codec.decode_spans(payload)
        validation = codec.validate_spans(request)
        if not validation.rejected:
            return request, payload, validation
        raw = request.SerializeToString() if validation.accepted else b""
        return request, raw, validation

    async def _read_body(self, request: Request, coding: str) -> bytes:
        """Read at most the wire limit; raise :class:`_TooLargeOnWire` past it."""
        limit = _wire_limit(self._max_body_bytes, coding)
        drain_limit = limit * _DRAIN_FACTOR
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > drain_limit:
            raise _TooLargeOnWire(
                f"body is {declared} bytes on the wire, over the {limit}-byte limit"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > drain_limit:
                break  # stop reading; the connection will be closed
            if size <= limit:
                chunks.append(chunk)
            else:
                chunks.clear()  # keep draining, so the client reads our 413
        if size > limit:
            raise _TooLargeOnWire(f"body is over the {limit}-byte limit on the wire")
        return b"".join(chunks)


def _wire_limit(max_body_bytes: int, coding: str) -> int:
    """The most bytes a within-limit payload can take on the wire.

    Compression can expand incompressible data slightly (gzip: about 0.03%
    plus a header), so compressed bodies get a little headroom; the exact
    check happens after decompression.
    """
    if coding == "identity":
        return max_body_bytes
    return max_body_bytes + max_body_bytes // 500 + 1024


def _wants_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == codec.JSON


def _status(
    http_status: int,
    code: int,
    message: str,
    *,
    as_json: bool,
    retry_after: str | None = None,
    close: bool = False,
) -> Response:
    body = codec.encode_status(
        code,
        message,
        json=as_json,
        retry_after_s=float(retry_after) if retry_after is not None else None,
    )
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    if close:  # what is left of a body not read must not be taken for the next request
        headers["Connection"] = "close"
    return Response(
        body,
        status_code=http_status,
        headers=headers,
        media_type=codec.JSON if as_json else codec.PROTOBUF,
    )
