"""The HTTP client of the sidecar's control API: ``/v1/decide`` and ``/v1/breakers``.

The client must never be what breaks the agent: when the sidecar is down,
slow or answers nonsense, :class:`SupervisorClient` answers from its
:class:`~supervisor.client.LocalPolicy` (``source="local"``) and logs one
warning per unreachable period. Only a refused token (401/403) raises,
because that is a configuration error that no amount of waiting fixes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import quote

import httpx

from supervisor.addresses import DEFAULT_API_URL
from supervisor.admission.admitter import PRIORITIES
from supervisor.admission.key import admission_key
from supervisor.api_access import CLIENT, ApiAccess, resolve_access
from supervisor.client._advice import (
    BREAKER_STATES,
    UNKNOWN_STATE,
    Advice,
    Question,
    UnreadableAnswer,
    advice_from_json,
)
from supervisor.client._auth import SidecarAuth
from supervisor.client._evidence import exception_type_name, retry_after_of, status_of
from supervisor.client._local import MAX_MESSAGE_CHARS, LocalPolicy
from supervisor.errors import ConfigError, SupervisorError

log = logging.getLogger("spanvisor.client")

#: Where the client asks when nothing names another address (see :mod:`supervisor.api_access`).
DEFAULT_BASE_URL = DEFAULT_API_URL


class SupervisorClientError(SupervisorError):
    """The client is misconfigured (its address or token cannot be used, or the sidecar
    refused its token); waiting will not help."""


def client_access(base_url: str | None, token: str | None) -> ApiAccess:
    """The address and token of a client made with these arguments (:func:`resolve_access`).

    Raises :class:`SupervisorClientError` for a setting that cannot be used.
    """
    try:
        return resolve_access(base_url, token, names=CLIENT)
    except ConfigError as exc:
        raise SupervisorClientError(str(exc)) from exc


def refused(access: ApiAccess, response: httpx.Response) -> SupervisorClientError:
    """The error for a 401/403: which sidecar refused which token, and what to check."""
    try:
        detail = response.json().get("error", "")
    except (ValueError, AttributeError):
        detail = response.text[:200]
    return SupervisorClientError(access.refused(response.status_code, str(detail)))


class SupervisorClient:
    """Asks the sidecar's control API; answers locally when it cannot.

    ``base_url`` and ``token``, when not given, are found as the CLI finds
    them (:mod:`supervisor.api_access`): ``SPANVISOR_API_URL``, the sidecar's
    ``SPANVISOR_API_HOST`` / ``SPANVISOR_API_PORT`` or settings file
    (``SPANVISOR_CONFIG``), else ``http://127.0.0.1:4320``; ``SPANVISOR_API_TOKEN``,
    else the sidecar's token file. :attr:`access` says which.

    Thread-safe; one per process is enough. Sync methods use an
    ``httpx.Client``; the ``a``-prefixed twins an ``httpx.AsyncClient`` bound to
    the event loop that first used it (call :meth:`aclose` in that loop).
    ``timeout_s`` bounds each phase of a request (connect, write, read).

    After a failed request the sidecar is not asked again for ``recheck_s``
    seconds, so an agent does not pay a timeout on every failure while the
    sidecar is down.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 0.5,
        service: str = "",
        local_policy: LocalPolicy | None = None,
        recheck_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        #: The address and token, and where each came from.
        self.access = client_access(base_url, token)
        self.base_url = self.access.url
        self._auth = SidecarAuth(self.access)
        self.timeout_s = timeout_s
        # The agent's spans name it by OTEL_SERVICE_NAME; its questions should too.
        self.service = service or os.environ.get("OTEL_SERVICE_NAME", "")
        self.local_policy = local_policy or LocalPolicy()
        self.recheck_s = recheck_s
        self.clock = clock
        self.sleep = sleep
        self.async_sleep = async_sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._recheck_at = 0.0
        self._http: httpx.Client | None = None
        self._ahttp: httpx.AsyncClient | None = None
        self._aloop: weakref.ref[asyncio.AbstractEventLoop] | None = None

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Close the sync connection pool (the async one needs :meth:`aclose`)."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    async def aclose(self) -> None:
        """Close both connection pools; call it in the loop the async methods ran in."""
        self.close()
        with self._lock:
            ahttp, self._ahttp, self._aloop = self._ahttp, None, None
        if ahttp is not None:
            await ahttp.aclose()

    def __enter__(self) -> SupervisorClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    async def __aenter__(self) -> SupervisorClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    def _options(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "headers": {"Accept": "application/json", "User-Agent": "spanvisor-client"},
            "auth": self._auth,
            "timeout": httpx.Timeout(self.timeout_s),
            # An agent's HTTP(S)_PROXY must not capture calls to a loopback sidecar.
            "trust_env": False,
            "follow_redirects": False,
        }

    def _sync_http(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(**self._options())
            return self._http

    def _async_http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._ahttp is None or self._aloop is None or self._aloop() is not loop:
                # A pool cannot move between loops; one left in a finished loop is dropped.
                self._ahttp = httpx.AsyncClient(**self._options())
                self._aloop = weakref.ref(loop)
            return self._ahttp

    # -- reachability -----------------------------------------------------------

    def _may_ask(self) -> bool:
        with self._lock:
            return self._down_since is None or self.clock() >= self._recheck_at

    def _answered(self) -> None:
        with self._lock:
            was_down, self._down_since = self._down_since is not None, None
        if was_down:
            log.info("spanvisor reachable again at %s; using its advice", self.base_url)

    def _unusable(self, why: str) -> None:
        now = self.clock()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
            self._recheck_at = now + self.recheck_s
        if first:
            log.warning(
                "spanvisor unreachable at %s (%s): %s; using the local policy",
                self.base_url,
                self.access.url_from,
                why,
            )

    def _read(self, response: httpx.Response) -> object:
        """The JSON of a 200; raise for a refused token; ``UnreadableAnswer`` for anything else."""
        if response.status_code in (401, 403):
            self._answered()
            raise refused(self.access, response)
        if response.status_code == 400:
            raise UnreadableAnswer(f"the sidecar rejected the request: {response.text[:200]}")
        if response.status_code != 200:
            raise UnreadableAnswer(f"HTTP {response.status_code}")
        try:
            return json.loads(response.content)
        except ValueError:
            raise UnreadableAnswer("the answer is not JSON") from None

    # -- decide -----------------------------------------------------------------

    def _question(
        self,
        dependency: str,
        *,
        exception: BaseException | None,
        exception_type: str,
        message: str,
        status_code: int | None,
        run_id: str,
        attempt: int,
    ) -> Question:
        if not dependency:
            raise ValueError("dependency must not be empty")
        if attempt < 1:
            raise ValueError("attempt is 1-based")
        retry_after = None
        if exception is not None:
            exception_type = exception_type or exception_type_name(type(exception))
            if not message:
                try:
                    message = str(exception)
                except Exception:  # a broken __str__ must not break the agent
                    message = ""
            status_code = status_code if status_code is not None else status_of(exception)
            retry_after = retry_after_of(exception)
        return Question(
            dependency=dependency,
            exception_type=exception_type,
            message=message[:MAX_MESSAGE_CHARS],
            status_code=status_code,
            service=self.service,
            run_id=run_id,
            attempt=attempt,
            retry_after_s=retry_after,
        )

    def _local(self, question: Question) -> Advice:
        return self.local_policy.advise(
            question.dependency,
            exception_type=question.exception_type,
            message=question.message,
            status_code=question.status_code,
            attempt=question.attempt,
            retry_after_s=question.retry_after_s,
        )

    def _advice(self, question: Question, response: httpx.Response) -> Advice:
        try:
            advice = advice_from_json(self._read(response), question.dependency)
        except UnreadableAnswer as exc:
            self._unusable(str(exc))
            return self._local(question)
        self._answered()
        return advice

    def decide(
        self,
        dependency: str,
        *,
        exception: BaseException | None = None,
        exception_type: str = "",
        message: str = "",
        status_code: int | None = None,
        run_id: str = "",
        attempt: int = 1,
    ) -> Advice:
        """What to do after failed ``attempt`` (1-based) of a call to ``dependency``.

        With ``exception``, its type, message and HTTP status fill whichever of
        ``exception_type``, ``message``, ``status_code`` are not given. Never
        raises for a sidecar that is down, slow or confused (the local policy
        answers); raises :class:`SupervisorClientError` when it refuses the token.
        """
        question = self._question(
            dependency,
            exception=exception,
            exception_type=exception_type,
            message=message,
            status_code=status_code,
            run_id=run_id,
            attempt=attempt,
        )
        if not self._may_ask():
            return self._local(question)
        try:
            response = self._sync_http().post("/v1/decide", json=question.to_json())
        except httpx.HTTPError as exc:  # refused, timed out, reset, malformed
            self._unusable(_describe(exc))
            return self._local(question)
        return self._advice(question, response)

    async def adecide(
        self,
        dependency: str,
        *,
        exception: BaseException | None = None,
        exception_type: str = "",
        message: str = "",
        status_code: int | None = None,
        run_id: str = "",
        attempt: int = 1,
    ) -> Advice:
        """The async twin of :meth:`decide`."""
        question = self._question(
            dependency,
            exception=exception,
            exception_type=exception_type,
            message=message,
            status_code=status_code,
            run_id=run_id,
            attempt=attempt,
        )
        if not self._may_ask():
            return self._local(question)
        try:
            response = await self._async_http().post("/v1/decide", json=question.to_json())
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return self._local(question)
        return self._advice(question, response)

    # -- admission ---------------------------------------------------------------

    def _admit_body(
        self, dependency: str, credential: str | None, priority: str, tokens: int
    ) -> dict[str, Any]:
        admission_key(dependency, credential)  # a secret or a malformed name: refused here
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        body: dict[str, Any] = {
            "dependency": dependency,
            "service": self.service,
            "priority": priority,
            "tokens": tokens,
        }
        if credential is not None:
            body["credential"] = credential
        return body

    def _wait_ms(self, response: httpx.Response) -> int:
        try:
            payload = self._read(response)
            if not isinstance(payload, dict) or not isinstance(payload.get("go"), bool):
                raise UnreadableAnswer("the answer has no go")
        except UnreadableAnswer as exc:
            self._unusable(str(exc))
            return 0
        self._answered()
        wait = payload.get("wait_ms", 0)
        return 0 if payload["go"] or not isinstance(wait, int) else max(0, wait)

    def admit(
        self,
        dependency: str,
        *,
        credential: str | None = None,
        priority: str = "normal",
        tokens: int = 0,
    ) -> int:
        """Milliseconds to wait before calling ``dependency`` (0: go now).

        A sidecar that cannot say answers 0: admission has no local fallback
        (the agent's own calls are not the fleet's).
        """
        body = self._admit_body(dependency, credential, priority, tokens)
        if not self._may_ask():
            return 0
        try:
            response = self._sync_http().post("/v1/admit", json=body)
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return 0
        return self._wait_ms(response)

    async def aadmit(
        self,
        dependency: str,
        *,
        credential: str | None = None,
        priority: str = "normal",
        tokens: int = 0,
    ) -> int:
        """The async twin of :meth:`admit`."""
        body = self._admit_body(dependency, credential, priority, tokens)
        if not self._may_ask():
            return 0
        try:
            response = await self._async_http().post("/v1/admit", json=body)
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return 0
        return self._wait_ms(response)

    # -- breakers ---------------------------------------------------------------

    def _breaker_path(self, dependency: str) -> str:
        if not dependency:
            raise ValueError("dependency must not be empty")
        return "/v1/breakers/" + quote(dependency, safe="")

    def _breaker(self, response: httpx.Response) -> str:
        try:
            payload = self._read(response)
            if not isinstance(payload, dict) or payload.get("state") not in BREAKER_STATES:
                raise UnreadableAnswer("the answer has no breaker state")
        except UnreadableAnswer as exc:
            self._unusable(str(exc))
            return UNKNOWN_STATE
        self._answered()
        return cast(str, payload["state"])

    def breaker_state(self, dependency: str) -> str:
        """closed / open / half_open / isolated; ``"unknown"`` when the sidecar cannot say."""
        path = self._breaker_path(dependency)
        if not self._may_ask():
            return UNKNOWN_STATE
        try:
            response = self._sync_http().get(path)
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return UNKNOWN_STATE
        return self._breaker(response)

    async def abreaker_state(self, dependency: str) -> str:
        """The async twin of :meth:`breaker_state`."""
        path = self._breaker_path(dependency)
        if not self._may_ask():
            return UNKNOWN_STATE
        try:
            response = await self._async_http().get(path)
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return UNKNOWN_STATE
        return self._breaker(response)


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


_shared: SupervisorClient | None = None
_shared_lock = threading.Lock()


def shared_client() -> SupervisorClient:
    """The process-wide client a :class:`Guard` uses when given none (defaults, env token)."""
    global _shared  # noqa: PLW0603 - one lazily made client per process is the point
    with _shared_lock:
        if _shared is None:
            _shared = SupervisorClient()
        return _shared
