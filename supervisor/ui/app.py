"""The console as an app of its own, mounted at ``/ui`` by the control API.

Its own app so that its answers are pages, not the JSON API's errors, and so
that every answer under ``/ui`` (pages, static files, errors, redirects)
carries the security headers: a strict Content-Security-Policy (scripts and
styles from the console's own files only, no inline ones), no sniffing, no
referrer, no caching.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from supervisor.api.control import Control, ControlError
from supervisor.errors import StoreUnavailable
from supervisor.ui.forms import FormTooLarge
from supervisor.ui.pages import environment
from supervisor.ui.routes import Console, NeedLogin, Refused, render, router
from supervisor.ui.sessions import Sessions

__all__ = ["HEADERS", "ConsoleOptions", "build_console", "mount_console"]

STATIC = Path(__file__).parent / "static"

#: On every answer under /ui.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self';"
    " img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none';"
    " base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class ConsoleOptions:
    """The console's settings (``ui_trace_url``, ``ui_session_ttl_s``)."""

    trace_url: str | None = None
    session_ttl_s: float = 8 * 3600.0
    #: The session cookie is sent over HTTPS only (a browser counts loopback as secure).
    secure_cookie: bool = True
    clock: Callable[[], float] = time.time


def mount_console(app: FastAPI, *, token: str, control: Control, options: ConsoleOptions) -> None:
    """Serve the console at ``/ui`` of ``app`` (``/ui`` itself leads to the runs)."""
    console = build_console(
        token=token,
        control=control,
        trace_url=options.trace_url,
        session_ttl_s=options.session_ttl_s,
        clock=options.clock,
        secure_cookie=options.secure_cookie,
    )

    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> Response:
        return RedirectResponse("/ui/runs", status_code=303, headers=HEADERS)

    app.mount("/ui", console)


def build_console(
    *,
    token: str,
    control: Control,
    trace_url: str | None = None,
    session_ttl_s: float = 8 * 3600.0,
    clock: Callable[[], float] = time.time,
    secure_cookie: bool = True,
) -> FastAPI:
    """The console's app (mount it at ``/ui``); it keeps only the logins."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.console = Console(
        control=control,
        token=token,
        sessions=Sessions(session_ttl_s, clock=clock),
        templates=environment(clock),
        trace_url=trace_url,
        secure_cookie=secure_cookie,
    )

    @app.middleware("http")
    async def headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        answer = await call_next(request)
        answer.headers.update(HEADERS)
        return answer

    @app.exception_handler(NeedLogin)
    async def need_login(_: Request, __: Exception) -> Response:
        return RedirectResponse("/ui/login", status_code=303)

    def page(status: int, message: str, request: Request) -> Response:
        return render(request, "error.html", None, status, code=status, message=message)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Exception) -> Response:
        status = exc.status if isinstance(exc, Refused) else 400
        answer = page(status, str(exc), request)
        if status == 401:
            answer.headers["WWW-Authenticate"] = 'Bearer realm="spanvisor"'
        return answer

    @app.exception_handler(ControlError)
    async def control_error(request: Request, exc: Exception) -> Response:
        status = exc.status if isinstance(exc, ControlError) else 400
        return page(status, str(exc), request)

    @app.exception_handler(StoreUnavailable)
    async def store_down(request: Request, exc: Exception) -> Response:
        if isinstance(exc, StoreUnavailable):
            control.outage.failed(exc)
        return page(503, f"{exc}; try again later.", request)

    @app.exception_handler(FormTooLarge)
    async def too_large(request: Request, _: Exception) -> Response:
        return page(413, "That form is too large.", request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, _: Exception) -> Response:
        return page(400, "That request's parameters are not valid.", request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 400
        return page(status, "No such page." if status == 404 else str(exc), request)

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
