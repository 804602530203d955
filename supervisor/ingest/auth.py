"""Bearer-token authentication of the OTLP receivers, for when they listen beyond loopback.

The spans a receiver accepts are judged, and judgements become commands to
agents; so a receiver that a network can reach takes spans only from senders
that show the token, as the OpenTelemetry Collector's ``bearertokenauth``
extension does: ``Authorization: Bearer <token>`` on OTLP/HTTP, the
``authorization`` metadata key on OTLP/gRPC (what an exporter sends when its
headers, e.g. ``OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>``,
say so). The comparison is constant-time. A refused request costs nothing
more: it is answered before its body is read (HTTP 401, gRPC
``UNAUTHENTICATED``), counted in :attr:`ReceiverAuth.refused`, and the first
refusal is logged. Exporters do not retry either answer.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import grpc
from google.rpc import code_pb2, status_pb2

from supervisor.ingest import codec

__all__ = ["BearerMiddleware", "GrpcBearerInterceptor", "ReceiverAuth"]

_log = logging.getLogger(__name__)

_REFUSED = "missing or wrong bearer token"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ReceiverAuth:
    """The one check both receivers make, and the count of what it refused."""

    __slots__ = ("_expected", "refused")

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        #: Requests refused for a missing or wrong token, both transports.
        self.refused = 0

    def allows(self, authorization: bytes | str | None) -> bool:
        """Whether an ``Authorization`` value carries the token; counts and logs a refusal."""
        given = authorization.encode() if isinstance(authorization, str) else authorization or b""
        if hmac.compare_digest(given, self._expected):
            return True
        self.refused += 1
        if self.refused == 1:
            _log.warning(
                "OTLP request refused: %s (logged once; counted in otlp_auth.refused)",
                _REFUSED if given else "no Authorization header or metadata",
            )
        return False


class BearerMiddleware:
    """ASGI middleware in front of the OTLP/HTTP app: a 401 unless the token is shown."""

    def __init__(self, app: ASGIApp, auth: ReceiverAuth) -> None:
        self._app = app
        self._auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self._auth.allows(header):
            await self._app(scope, receive, send)
            return
        as_json = any(k == b"content-type" and b"json" in v.lower() for k, v in scope["headers"])
        status = status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=_REFUSED)
        if as_json:
            body = b'{"code": 16, "message": "' + _REFUSED.encode() + b'"}'
            media = codec.JSON.encode()
        else:
            body = status.SerializeToString()
            media = codec.PROTOBUF.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", media),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="spanvisor-otlp"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class GrpcBearerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """``UNAUTHENTICATED`` for a call without the token, before its handler runs."""

    def __init__(self, auth: ReceiverAuth) -> None:
        self._auth = auth
        self._refusal = grpc.unary_unary_rpc_method_handler(
            _unauthenticated, request_deserializer=None, response_serializer=None
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = handler_call_details.invocation_metadata or ()
        value = next((v for k, v in metadata if k == "authorization"), None)
        if self._auth.allows(value):
            return await continuation(handler_call_details)
        return self._refusal


async def _unauthenticated(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
    raise AssertionError("context.abort returned")  # pragma: no cover
