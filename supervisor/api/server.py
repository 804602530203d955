"""The control API on port 4320 (FastAPI, so ``/openapi.json`` describes every route).

Every route but ``/healthz``, ``/readyz`` and ``/openapi.json`` needs
``Authorization: Bearer <token>``; the token comes from the settings or is
generated at start and written to a file only the user can read, and the
sidecar refuses to listen beyond loopback without one configured. Errors are
``{"error": "..."}`` with a 4xx status that says which kind; span content in
answers is JSON data, never interpreted. The routes only translate HTTP:
what they do is :class:`supervisor.api.control.Control`'s.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from supervisor.api.control import Control, ControlError
from supervisor.api.inline import Question
from supervisor.api.metrics import CONTENT_TYPE
from supervisor.api.store_outage import RETRY_AFTER_S
from supervisor.errors import ConfigError, StoreUnavailable
from supervisor.records import REMEDIATION_STATUSES, RUN_STATUSES
from supervisor.ui.app import ConsoleOptions, mount_console

__all__ = ["build_control_app", "ensure_token"]

_log = logging.getLogger("spanvisor.api")


def ensure_token(configured: str | None, token_file: Path) -> str:
    """The configured token, or a new random one written to ``token_file`` (0600).

    The file is never written through: the token goes to a new file created
    exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) beside it, which
    then replaces it, so no other user can read it at any moment, whatever was
    there before. A symbolic link at ``token_file`` is refused (a ConfigError):
    it may point where another user wants the token written. A regular file
    that others could read is replaced like any other (the token it holds is
    dead from this start on), and a warning says so.
    """
    if configured:
        return configured
    token = secrets.token_urlsafe(32)
    token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        found = os.lstat(token_file)
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise ConfigError(f"cannot check token_file {token_file}: {exc}") from None
    if found is not None:
        if stat.S_ISLNK(found.st_mode):
            raise ConfigError(
                f"token_file {token_file} is a symbolic link; refusing to write the API token"
                " through it: remove it, or set token_file to a path of its own"
            )
        if not stat.S_ISREG(found.st_mode):
            raise ConfigError(f"token_file {token_file} exists and is not a regular file")
        if found.st_mode & 0o077:
            _log.warning(
                "token_file %s was readable by others (mode %o); it is replaced by a new"
                " file of mode 600, and the token it held is no longer valid",
                token_file,
                stat.S_IMODE(found.st_mode),
            )
    temporary = token_file.with_name(f".{token_file.name}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temporary, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, token_file)  # replaces a link or file, never follows one
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ConfigError(f"cannot write the API token to {token_file}: {exc}") from None
    return token


class _Body(BaseModel):
    """A request body from an agent or an operator: read liberally.

    Fields it does not know are ignored, not refused: an agent's
    acknowledgement that also says ``"status": "accepted"`` must still count
    (refusing it hands the command out again and again). What it does know
    is checked strictly, and a body that is not a JSON object is refused
    with a 400 that says so. Configuration (settings, policy files) stays
    strict: a misspelt key there is a mistake to report.
    """

    model_config = ConfigDict(extra="ignore")


class DecideBody(_Body):
    """An agent's question: it caught this error calling this dependency; what now?"""

    dependency: str = Field(min_length=1, max_length=512, examples=["openai:gpt-4o"])
    exception_type: str = Field(default="", max_length=512, examples=["openai.RateLimitError"])
    message: str = Field(default="", max_length=65_536)
    status_code: int | None = Field(default=None, ge=100, le=599)
    service: str = Field(default="", max_length=256)
    run_id: str = Field(default="", max_length=256)
    attempt: int = Field(
        default=1, ge=1, le=1000, description="1-based number of the failed attempt."
    )


class AdmitBody(_Body):
    """An agent about to call a provider: may it go now?"""

    dependency: str = Field(min_length=1, max_length=512, examples=["openai:gpt-4o"])
    credential: str | None = Field(
        default=None,
        max_length=128,
        description="The API key's name or a hash of it, never the key (sk-... is refused).",
    )
    service: str = Field(
        default="",
        max_length=256,
        description="Shares a contended key with the other services by the policy's weights.",
    )
    priority: Literal["high", "normal", "low"] = Field(
        default="normal", description="Low waits while high is waiting."
    )
    tokens: int = Field(default=0, ge=0, le=10_000_000, description="Tokens the call will use.")


class AnswerBody(_Body):
    by: str = Field(default="api", max_length=200, description="Who answers, for the record.")
    note: str = Field(default="", max_length=2000)


class RedeliverBody(_Body):
    by: str = Field(default="api", max_length=200, description="Who re-delivers, for the record.")


class AckBody(_Body):
    service: str = Field(min_length=1, max_length=256)


#: The ``cursor`` of every list route: the previous page's ``next_cursor``, as it came.
Cursor = Annotated[
    str | None,
    Query(
        max_length=512,
        description="The previous page's next_cursor (with the same filters); none: the first"
        " page. Every list answers next_cursor: null on its last page.",
    ),
]


class _Unauthorized(Exception):
    pass


def _problem(error: Mapping[str, Any]) -> str:
    """One validation error for people: the field's path, or what of the request is wrong."""
    loc = [str(p) for p in error.get("loc", ())]
    msg = str(error.get("msg", ""))
    if error.get("type") == "json_invalid":  # its loc is a character's offset
        return "the request body is not valid JSON"
    field = ".".join(p for p in loc if p != "body")
    if field:
        return f"{field}: {msg}"
    if loc == ["body"] and error.get("type") == "missing":
        return "the request needs a JSON body"
    return f"the request body: {msg}" if loc[:1] == ["body"] else msg


def _health(control: Control, *, degraded_status: int) -> JSONResponse:
    """``/healthz`` and ``/readyz``: 503 while starting; degraded (a failing store, one
    found down) answered with ``degraded_status``."""
    if not control.ready():
        return JSONResponse({"status": "starting"}, status_code=503)
    degraded = control.health()
    if degraded:
        return JSONResponse(
            {"status": "degraded", "degraded": degraded}, status_code=degraded_status
        )
    return JSONResponse({"status": "ok"})


def _store_down(control: Control) -> Callable[[Request, Exception], Awaitable[Response]]:
    """503 with the store named and a Retry-After; the outage is logged once, not per request."""

    async def answer(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StoreUnavailable)
        control.outage.failed(exc)
        return JSONResponse(
            {
                "error": f"{exc}; try again later",
                "store": exc.where,
                "retry_after_s": RETRY_AFTER_S,
            },
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    return answer


def build_control_app(
    *, token: str, control: Control, console: ConsoleOptions | None = None
) -> FastAPI:
    """The control API over ``control``; it holds no state of its own but the
    console's logins (the console is served at ``/ui`` when ``console`` is given)."""
    expected = f"Bearer {token}".encode()

    async def authenticated(request: Request) -> None:  # async: no thread-pool hop per call
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise _Unauthorized

    app = FastAPI(
        title="spanvisor control API",
        version="1",
        description="Incidents, commands, approvals, breakers, remediations, runs and inline"
        " decisions of a running spanvisor sidecar. Bearer-token authentication on every"
        " route but /healthz, /readyz and /openapi.json.",
        docs_url=None,
        redoc_url=None,
    )
    auth = [Depends(authenticated)]

    @app.exception_handler(_Unauthorized)
    async def unauthorized(_: Request, __: Exception) -> JSONResponse:
        return JSONResponse(
            {"error": "missing or wrong bearer token"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="spanvisor"'},
        )

    @app.exception_handler(ControlError)
    async def refused(_: Request, exc: Exception) -> JSONResponse:
        status = exc.status if isinstance(exc, ControlError) else 400
        return JSONResponse({"error": str(exc)}, status_code=status)

    # The fleet's PostgreSQL does not answer: nothing is wrong with the request.
    app.add_exception_handler(StoreUnavailable, _store_down(control))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        problems = "; ".join(_problem(e) for e in errors)
        return JSONResponse({"error": problems or "invalid request"}, status_code=400)

    @app.get("/healthz", summary="Liveness: 200 while it serves, even degraded")
    async def healthz() -> JSONResponse:
        # A full disk is not cured by a restart: liveness stays 200 and says degraded.
        return _health(control, degraded_status=200)

    @app.get("/readyz", summary="Readiness: 503 while starting, stopping or degraded")
    async def readyz() -> JSONResponse:
        return _health(control, degraded_status=503)

    @app.get("/v1/stats", dependencies=auth, summary="Counters of every stage")
    async def stats() -> dict[str, Any]:
        return control.all_stats()

    @app.get(
        "/metrics",
        dependencies=auth,
        response_class=Response,
        summary="Counters of every stage, in the Prometheus text format",
    )
    async def metrics() -> Response:  # on the loop: the stages' counters are read where kept
        return Response(control.metrics(), media_type=CONTENT_TYPE)

    @app.get("/v1/threads", dependencies=auth, summary="CPU time of each thread (Linux)")
    async def threads() -> dict[str, Any]:
        return control.threads()

    @app.get(
        "/v1/failures",
        dependencies=auth,
        summary="Recent failures (in memory, newest last; next_cursor: older ones)",
    )
    async def failures(
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100, cursor: Cursor = None
    ) -> dict[str, Any]:
        return control.failure_page(limit, cursor)

    @app.get(
        "/v1/incidents",
        dependencies=auth,
        summary="Stored incidents and their decisions, newest first",
    )
    async def incidents(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: Cursor = None
    ) -> dict[str, Any]:
        return await control.stored(control.incidents, limit, cursor)

    @app.get("/v1/incidents/{key}", dependencies=auth, summary="One incident")
    async def incident(key: str) -> dict[str, Any]:
        return await control.stored(control.incident, key)

    @app.get(
        "/v1/commands",
        dependencies=auth,
        summary="Pull: lease the service's due commands (long poll)",
        description="Commands handed out here must be acknowledged (POST"
        " /v1/commands/{id}/ack); an unacknowledged one is handed out again after the"
        " service's visibility timeout.",
    )
    async def pull(
        service: Annotated[str, Query(min_length=1, max_length=256)],
        wait: Annotated[float, Query(ge=0, le=30)] = 0.0,
        limit: Annotated[int, Query(ge=1, le=100)] = 10,
    ) -> dict[str, Any]:
        return {"commands": await control.pull(service, wait_s=wait, limit=limit)}

    @app.post(
        "/v1/commands/{command_id}/ack",
        dependencies=auth,
        summary="Acknowledge a command",
        description='The body names the service the command was leased to: {"service": "..."}.',
    )
    async def ack(command_id: str, body: AckBody | None = None) -> dict[str, Any]:
        if body is None:
            raise ControlError(
                'an ack needs a JSON body naming the service: {"service": "<service>"}'
            )
        return await control.stored(control.ack, command_id, body.service)

    @app.get("/v1/commands/log", dependencies=auth, summary="Commands of every channel")
    async def command_log(
        status: str | None = None,
        service: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Cursor = None,
    ) -> dict[str, Any]:
        return await control.stored(
            control.commands, status=status, service=service, limit=limit, cursor=cursor
        )

    @app.get("/v1/dead-letters", dependencies=auth, summary="Commands that could not be delivered")
    async def dead_letters(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: Cursor = None
    ) -> dict[str, Any]:
        return await control.stored(control.dead_letters, limit, cursor)

    @app.post(
        "/v1/dead-letters/{command_id}/redeliver",
        dependencies=auth,
        summary="Send a dead letter again",
        description="Puts the command back to pending (the same id and Idempotency-Key,"
        " attempts from 0, who and when recorded) and sends it at once. 404: unknown;"
        " 409: not a dead letter, or its service has no delivery channel.",
    )
    async def redeliver(command_id: str, body: RedeliverBody | None = None) -> dict[str, Any]:
        return await control.redeliver(command_id, by=(body or RedeliverBody()).by)

    @app.get("/v1/approvals", dependencies=auth, summary="Approval requests, newest first")
    async def approvals(
        status: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Cursor = None,
    ) -> dict[str, Any]:
        return await control.stored(control.approvals, status, limit, cursor)

    @app.get("/v1/approvals/{approval_id}", dependencies=auth, summary="One approval request")
    async def approval(approval_id: str) -> dict[str, Any]:
        return await control.stored(control.approval, approval_id)

    @app.post("/v1/approvals/{approval_id}/approve", dependencies=auth, summary="Approve")
    async def approve(approval_id: str, body: AnswerBody | None = None) -> dict[str, Any]:
        answer = body or AnswerBody()
        return await control.answer(approval_id, approved=True, by=answer.by, note=answer.note)

    @app.post("/v1/approvals/{approval_id}/deny", dependencies=auth, summary="Deny")
    async def deny(approval_id: str, body: AnswerBody | None = None) -> dict[str, Any]:
        answer = body or AnswerBody()
        return await control.answer(approval_id, approved=False, by=answer.by, note=answer.note)

    @app.get("/v1/breakers", dependencies=auth, summary="Tracked circuit breakers, by dependency")
    async def breakers(
        limit: Annotated[int, Query(ge=1, le=1000)] = 1000, cursor: Cursor = None
    ) -> dict[str, Any]:
        return control.breakers(limit, cursor)

    @app.post(
        "/v1/breakers/{dependency:path}/isolate",
        dependencies=auth,
        summary="Force a breaker open until closed",
    )
    async def isolate(dependency: str) -> dict[str, Any]:
        return control.isolate(dependency)

    @app.post("/v1/breakers/{dependency:path}/close", dependencies=auth, summary="Close a breaker")
    async def close(dependency: str) -> dict[str, Any]:
        return control.close_breaker(dependency)

    @app.get(
        "/v1/breakers/{dependency:path}",
        dependencies=auth,
        summary="One breaker (closed when none is tracked)",
    )
    async def breaker(dependency: str) -> dict[str, Any]:
        return control.breaker(dependency)

    @app.get(
        "/v1/remediations",
        dependencies=auth,
        summary="Remediations, newest first",
        description="`running` is false, and the list empty, when the remediation runner"
        " is not up; `state` says why in a word (idle: none decided yet, the runner starts"
        " at the first; unused: no `remediate` action in the policy; off: no database;"
        " starting; failed) and `why` in a sentence. `status` is a workflow state: "
        + ", ".join(REMEDIATION_STATUSES)
        + ".",
    )
    async def remediations(
        status: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
        cursor: Cursor = None,
    ) -> dict[str, Any]:
        return await control.remediation_list(status=status, limit=limit, cursor=cursor)

    @app.get(
        "/v1/remediations/{remediation_id}",
        dependencies=auth,
        summary="One remediation: its request and its recorded steps",
    )
    async def remediation(remediation_id: str) -> dict[str, Any]:
        return await control.remediation(remediation_id)

    @app.post(
        "/v1/remediations/{remediation_id}/cancel",
        dependencies=auth,
        summary="Cancel a running remediation",
        description="404 when unknown, 409 when it is already finished or remediations"
        " are not running.",
    )
    async def cancel_remediation(remediation_id: str) -> dict[str, Any]:
        return await control.cancel_remediation(remediation_id)

    @app.get(
        "/v1/runs",
        dependencies=auth,
        summary="Runs' progress, most recently active first",
        description="Each run (a trace, or the session it names): its status ("
        + ", ".join(RUN_STATUSES)
        + "), spans, LLM and tool calls, errors, tokens, current step, rate and idle"
        " time. `status` and `service` filter every tracked run."
        " `tracking` is false, and the list empty, when the sidecar tracks no runs."
        " With `database_url`, the fleet's runs (`fleet` true), each with the sidecar that"
        " `tracked_by` it, up to 2 s behind.",
    )
    async def runs(
        status: Annotated[str | None, Query(max_length=16)] = None,
        service: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Cursor = None,
    ) -> dict[str, Any]:
        # The tracker on the loop (it is the loop's, and bounded); a fleet's table off it.
        return await control.run_list(status=status, service=service, limit=limit, cursor=cursor)

    @app.post("/v1/policy/reload", dependencies=auth, summary="Reload the policy file")
    async def reload() -> dict[str, Any]:
        return control.reload()

    @app.post("/v1/decide", dependencies=auth, summary="Decide inline for an agent that asks")
    async def decide(body: DecideBody) -> dict[str, Any]:
        return control.decide(Question(**body.model_dump()))

    @app.post(
        "/v1/admit",
        dependencies=auth,
        summary="May a call go now? (admission control)",
        description='`{"go": true}`, or `{"go": false, "wait_ms": N, "why": ...}`'
        " (why: limit, priority, share or paused). The fleet shares each key's limit in Redis;"
        " services share a contended key by the policy's weights.",
    )
    def admit(body: AdmitBody) -> dict[str, Any]:
        # A plain def: FastAPI runs it on its thread pool, so the Redis round trip (up
        # to the link's timeout when Redis hangs) never holds the event loop.
        return control.admit(
            body.dependency,
            credential=body.credential,
            priority=body.priority,
            tokens=body.tokens,
            service=body.service,
        )

    if console is not None:
        mount_console(app, token=token, control=control, options=console)
    return app
