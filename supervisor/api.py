"""The control API on port 4320: health, recent failures, counters.

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``; the
token comes from the settings or is generated at start and written to a
file only the user can read. Span content in responses is data: it is
returned as JSON strings, never interpreted.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Handler = Callable[[Request], Awaitable[Response]]


def ensure_token(configured: str | None, token_file: Path) -> str:
    """The configured token, or a new random one written to ``token_file`` (0600)."""
    if configured:
        return configured
    token = secrets.token_urlsafe(32)
    token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def build_control_app(
    *,
    token: str,
    failures: Callable[[int], list[dict[str, Any]]],
    stats: Callable[[], dict[str, Any]],
    ready: Callable[[], bool],
) -> Starlette:
    """The control API over callables, so it holds no state of its own."""
    expected = f"Bearer {token}".encode()

    def authenticated(handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse(
                    {"error": "missing or wrong bearer token"},
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer realm="spanvisor"'},
                )
            return await handler(request)

        return guarded

    async def healthz(_: Request) -> Response:
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    async def list_failures(request: Request) -> Response:
        raw = request.query_params.get("limit", "100")
        try:
            limit = int(raw)
        except ValueError:
            return JSONResponse(
                {"error": f"limit must be an integer, got {raw!r}"}, status_code=400
            )
        if not 1 <= limit <= 10_000:
            return JSONResponse({"error": "limit must be between 1 and 10000"}, status_code=400)
        return JSONResponse({"failures": failures(limit)})

    async def get_stats(_: Request) -> Response:
        return JSONResponse(stats())

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/failures", authenticated(list_failures), methods=["GET"]),
            Route("/v1/stats", authenticated(get_stats), methods=["GET"]),
        ]
    )
