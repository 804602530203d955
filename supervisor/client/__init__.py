"""The agent side of spanvisor: ask the sidecar, inline, what to do about a failure.

An agent that catches an exception asks :meth:`SupervisorClient.decide` and
gets an :class:`Advice` (retry after N seconds, fall back to another
dependency, fail fast, escalate...). :func:`guard` wraps a call in that loop.
Webhook commands are checked with :func:`verify_webhook` and deduplicated
with :class:`SeenCommands`.

The client must never be what breaks the agent: when the sidecar is down,
slow or answers nonsense, it answers from a conservative :class:`LocalPolicy`
(``source="local"``) and logs one warning per unreachable period. Only a
refused token (401/403) raises, because that is a configuration error that
no amount of waiting fixes.

This module imports nothing heavy (httpx and the standard library), so an
agent pays little for importing it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import os
import random
import re
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, ParamSpec, TypeVar, cast
from urllib.parse import quote

import httpx

from supervisor.errors import SupervisorError
from supervisor.records import Action
from supervisor.signing import DEFAULT_TOLERANCE_S, SignatureError, verify

__all__ = [
    "Advice",
    "BreakerOpen",
    "FallbackAdvised",
    "Guard",
    "GuardedAttempt",
    "LocalPolicy",
    "SeenCommands",
    "SignatureError",
    "SupervisorClient",
    "SupervisorClientError",
    "exception_type_name",
    "guard",
    "verify_webhook",
]

log = logging.getLogger("spanvisor.client")

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_BASE_URL = "http://127.0.0.1:4320"
TOKEN_ENV = "SPANVISOR_API_TOKEN"  # noqa: S105 - the name of a variable
#: Breaker states in which a guarded call is not attempted.
OPEN_STATES = frozenset({"open", "isolated"})
_BREAKER_STATES = frozenset({"closed", "open", "half_open", "isolated"})
#: What :meth:`SupervisorClient.breaker_state` answers when the sidecar cannot.
UNKNOWN_STATE = "unknown"
#: Longest exception message sent; the sidecar scans only the head anyway.
MAX_MESSAGE_CHARS = 4096


class SupervisorClientError(SupervisorError):
    """The client is misconfigured (the sidecar refused its token); waiting will not help."""


class BreakerOpen(SupervisorError):
    """The breaker of ``dependency`` is open or isolated: the call was not attempted."""

    def __init__(self, dependency: str, state: str = "open") -> None:
        self.dependency = dependency
        self.state = state
        super().__init__(f"breaker for {dependency} is {state}: failing fast")


# -- advice ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Advice:
    """What to do about one failure: the sidecar's answer to ``/v1/decide``, or the local one."""

    action: Action
    #: Seconds to wait before retrying (0 for other actions).
    delay_s: float = 0.0
    reason: str = ""
    #: Name of the policy entry that decided.
    policy: str = ""
    #: ``transient`` / ``model`` / ``permanent`` / ``semantic``; ``""`` when unclassified.
    failure_class: str = ""
    kind: str = ""
    rule: str = ""
    params: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    #: The dependency to switch to, for ``fallback``.
    fallback_to: str | None = None
    #: The dependency the breaker hangs on (a rule may key it differently from the request).
    dependency: str = ""
    #: closed / open / half_open / isolated, or ``"unknown"`` (local advice).
    breaker_state: str = UNKNOWN_STATE
    #: Shadow mode: the decision is reported, not meant to be acted on.
    observe_only: bool = False
    source: Literal["sidecar", "local"] = "sidecar"


class _Garbage(ValueError):
    """A sidecar answer that cannot be understood."""


def _advice_from_json(payload: object, dependency: str) -> Advice:
    if not isinstance(payload, dict):
        raise _Garbage("the answer is not a JSON object")
    try:
        action = Action(payload.get("action"))
    except ValueError:
        raise _Garbage(f"unknown action {payload.get('action')!r}") from None
    delay = payload.get("delay_s")
    if delay is None:
        delay = 0.0
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < math.inf:
        raise _Garbage(f"delay_s {delay!r} is not a non-negative number")
    params = payload.get("params")
    breaker = payload.get("breaker")
    breaker = breaker if isinstance(breaker, dict) else {}
    fallback_to = payload.get("fallback_to")
    return Advice(
        action=action,
        delay_s=float(delay),
        reason=_str(payload.get("reason")),
        policy=_str(payload.get("policy")),
        failure_class=_str(payload.get("class")),
        kind=_str(payload.get("kind")),
        rule=_str(payload.get("rule")),
        params=MappingProxyType(dict(params) if isinstance(params, dict) else {}),
        fallback_to=fallback_to if isinstance(fallback_to, str) and fallback_to else None,
        dependency=_str(breaker.get("dependency")) or dependency,
        breaker_state=_state(breaker.get("state")),
        observe_only=payload.get("observe_only") is True,
        source="sidecar",
    )


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _state(value: object) -> str:
    return value if isinstance(value, str) and value in _BREAKER_STATES else UNKNOWN_STATE


# -- the local policy ----------------------------------------------------------

_HINT = re.compile(
    r"(?:try again|retry|retrying)\s+(?:in|after)\s*:?\s*|\bretry[-_ ]after\s*[:=]?\s*",
    re.IGNORECASE,
)
_DURATION = re.compile(
    r"\s*(\d{1,9}(?:\.\d{1,9})?)\s*(ms|milliseconds?|h|hours?|m(?!s)|mins?|minutes?|s|secs?|seconds?)?"
    r"(?![A-Za-z])",
    re.IGNORECASE,
)
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}
#: Quota and billing errors come as 429 too, but waiting does not refill an account.
_QUOTA = re.compile(
    r"insufficient_quota|exceeded your (?:current )?quota|billing|credit balance", re.IGNORECASE
)
_TRANSIENT_TEXT = (
    (re.compile(r"rate.?limit|too many requests|throttl", re.IGNORECASE), "rate_limit"),
    (re.compile(r"\btimed?[ -]?out\b|deadline exceeded", re.IGNORECASE), "timeout"),
    (
        re.compile(r"connection (?:reset|refused|aborted|error)|broken pipe", re.IGNORECASE),
        "connection",
    ),
    (
        re.compile(r"temporarily unavailable|service unavailable|overloaded", re.IGNORECASE),
        "unavailable",
    ),
)
#: Substrings of an exception's class name (lowercase) that mark it transient.
_TRANSIENT_NAMES = (
    ("ratelimit", "rate_limit"),
    ("toomanyrequests", "rate_limit"),
    ("throttl", "rate_limit"),
    ("timeout", "timeout"),
    ("timedout", "timeout"),
    ("deadlineexceeded", "timeout"),
    ("connect", "connection"),
    ("brokenpipe", "connection"),
    ("protocolerror", "connection"),
    ("serverdisconnected", "connection"),
    ("serviceunavailable", "unavailable"),
    ("internalservererror", "unavailable"),
    ("overloaded", "unavailable"),
    ("badgateway", "unavailable"),
)


def _hint_from_text(text: str) -> float | None:
    """A delay the provider asks for in its own words ("Please try again in 1.5s", "20ms")."""
    head = text[:MAX_MESSAGE_CHARS]
    for hint in _HINT.finditer(head):
        total, found, pos = 0.0, False, hint.end()
        limit = min(len(head), pos + 64)
        while pos < limit:
            part = _DURATION.match(head, pos, limit)
            if part is None or part.end() == pos:
                break
            unit = (part.group(2) or "s").lower()
            factor = 0.001 if unit.startswith(("ms", "mil")) else _UNIT_S[unit[0]]
            total += float(part.group(1)) * factor
            found, pos = True, part.end()
            if part.group(2) is None:
                break
        if found:
            return total
    return None


def _transient_kind(exception_type: str, message: str, status_code: int | None) -> str:
    """The kind of a transient-looking failure, or ``""``."""
    if status_code is not None:
        if status_code == 429:
            return "rate_limit"
        if status_code in (408, 504):
            return "timeout"
        if 500 <= status_code <= 599:
            return "unavailable"
        if 400 <= status_code <= 499:
            return ""  # the request itself is wrong: the same request fails again
    name = exception_type.rsplit(".", 1)[-1].lower()
    for needle, kind in _TRANSIENT_NAMES:
        if needle in name:
            return kind
    for pattern, kind in _TRANSIENT_TEXT:
        if pattern.search(message[:MAX_MESSAGE_CHARS]):
            return kind
    return ""


@dataclass(frozen=True, slots=True)
class LocalPolicy:
    """What the client advises on its own when the sidecar cannot be asked.

    Conservative on purpose: it retries only what looks transient (408, 429,
    5xx, timeouts, connection errors) with exponential backoff and full
    jitter, a few times; everything else fails fast. It knows no fallback
    chains and no breakers: those live in the sidecar.
    """

    base_s: float = 1.0
    cap_s: float = 30.0
    #: Attempts in all, the first included: attempt ``max_attempts`` failing is the last.
    max_attempts: int = 3
    #: A server-requested delay is a floor for the wait, obeyed up to this cap.
    max_hint_s: float = 60.0
    #: Uniform [0, 1) source for the jitter; injectable so tests are exact.
    rng: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def advise(
        self,
        dependency: str,
        *,
        exception_type: str = "",
        message: str = "",
        status_code: int | None = None,
        attempt: int = 1,
        retry_after_s: float | None = None,
    ) -> Advice:
        """Advice for failed ``attempt`` (1-based) of a call to ``dependency``."""
        local = functools.partial(Advice, dependency=dependency, source="local")
        if _QUOTA.search(message[:MAX_MESSAGE_CHARS]):
            return local(
                Action.FAIL_FAST,
                reason=f"permanent/quota_exhausted on {dependency}: fail fast (local policy)",
                policy="local.fail_fast",
                failure_class="permanent",
                kind="quota_exhausted",
                rule="local.quota",
            )
        kind = _transient_kind(exception_type, message, status_code)
        if not kind:
            return local(
                Action.FAIL_FAST,
                reason=f"not transient-looking on {dependency}: fail fast (local policy)",
                policy="local.fail_fast",
            )
        if attempt >= self.max_attempts:
            return local(
                Action.FAIL_FAST,
                reason=(
                    f"transient/{kind} on {dependency}: attempts exhausted "
                    f"({attempt}/{self.max_attempts} failed, local policy)"
                ),
                policy="local.retry_transient",
                failure_class="transient",
                kind=kind,
                rule=f"local.{kind}",
            )
        ceiling = min(self.cap_s, self.base_s * 2.0 ** (max(attempt, 1) - 1))
        delay = self.rng() * ceiling
        hint = retry_after_s if retry_after_s is not None else _hint_from_text(message)
        if hint is not None and hint >= 0:
            delay = max(delay, min(hint, self.max_hint_s))
        return local(
            Action.RETRY,
            delay_s=delay,
            reason=(
                f"transient/{kind} on {dependency}: retry in {delay:.3g}s "
                f"(attempt {attempt}/{self.max_attempts} failed, local policy)"
            ),
            policy="local.retry_transient",
            failure_class="transient",
            kind=kind,
            rule=f"local.{kind}",
            params=MappingProxyType(
                {"attempt": attempt, "max_attempts": self.max_attempts, "delay_s": delay}
            ),
        )


# -- what an exception says -----------------------------------------------------


def exception_type_name(exc_type: type[BaseException]) -> str:
    """``module.QualName`` as classification rules expect it (``openai.RateLimitError``).

    As the OpenTelemetry SDK records it (builtins bare), except that a class
    living in a private submodule (``openai._exceptions``) is named after the
    shortest public package that re-exports it, or else after the public part
    of its module path.
    """
    qualname = exc_type.__qualname__
    module = exc_type.__module__ or ""
    if module in ("builtins", ""):
        return qualname
    parts = module.split(".")
    if not any(part.startswith("_") for part in parts[1:]):
        return f"{module}.{qualname}"
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if _resolve(sys.modules.get(prefix), qualname) is exc_type:
            return f"{prefix}.{qualname}"
    public: list[str] = []
    for part in parts:
        if part.startswith("_") and public:
            break
        public.append(part)
    return f"{'.'.join(public)}.{qualname}"


def _resolve(namespace: object, qualname: str) -> object:
    try:  # a module's lazy __getattr__ may import, and fail
        for name in qualname.split("."):
            if namespace is None:
                return None
            namespace = getattr(namespace, name, None)
    except Exception:
        return None
    return namespace


def _status_of(exc: BaseException) -> int | None:
    """``exc.status_code`` (openai, anthropic) or ``exc.response.status_code`` (httpx, requests)."""
    for path in (("status_code",), ("response", "status_code")):
        value: object = exc
        try:  # properties of foreign exceptions may raise
            for name in path:
                value = getattr(value, name, None)
        except Exception:  # noqa: S112 - any failure means "no status here"
            continue
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _retry_after_of(exc: BaseException) -> float | None:
    """A ``Retry-After`` (seconds) or ``retry-after-ms`` header of the exception's response."""
    try:
        headers = getattr(getattr(exc, "response", None), "headers", None)
        if headers is None:
            return None
        millis = headers.get("retry-after-ms")
        if millis is not None:
            return float(millis) / 1000.0
        seconds = headers.get("retry-after")
        return float(seconds) if seconds is not None else None
    except Exception:  # an HTTP date, an odd headers object: leave it to the message
        return None


@dataclass(frozen=True, slots=True)
class _Query:
    dependency: str
    exception_type: str
    message: str
    status_code: int | None
    service: str
    run_id: str
    attempt: int
    retry_after_s: float | None

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"dependency": self.dependency, "attempt": self.attempt}
        for key in ("exception_type", "message", "service", "run_id"):
            if value := getattr(self, key):
                body[key] = value
        if self.status_code is not None:
            body["status_code"] = self.status_code
        return body


# -- the client -------------------------------------------------------------------


def _default_token() -> str | None:
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    try:
        token = (Path.home() / ".spanvisor" / "api-token").read_text(encoding="utf-8").strip()
    except (OSError, RuntimeError, UnicodeDecodeError):  # no file, no home, not text
        return None
    return token or None


class SupervisorClient:
    """Asks the sidecar's control API; answers locally when it cannot.

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
        base_url: str = DEFAULT_BASE_URL,
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
        self.base_url = base_url.rstrip("/")
        self._token = token or _default_token()
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
        headers = {"Accept": "application/json", "User-Agent": "spanvisor-client"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return {
            "base_url": self.base_url,
            "headers": headers,
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
                "spanvisor unreachable at %s (%s); using the local policy", self.base_url, why
            )

    def _refused(self, response: httpx.Response) -> SupervisorClientError:
        how = "sent no API token" if not self._token else "sent an API token it refused"
        return SupervisorClientError(
            f"spanvisor at {self.base_url} answered {response.status_code}: the client {how}. "
            f"Pass token=, set {TOKEN_ENV}, or check ~/.spanvisor/api-token "
            "(the sidecar writes its token there)"
        )

    def _read(self, response: httpx.Response) -> object:
        """The JSON of a 200; raise for a refused token; ``_Garbage`` for anything else."""
        if response.status_code in (401, 403):
            self._answered()
            raise self._refused(response)
        if response.status_code == 400:
            raise _Garbage(f"the sidecar rejected the request: {response.text[:200]}")
        if response.status_code != 200:
            raise _Garbage(f"HTTP {response.status_code}")
        try:
            return json.loads(response.content)
        except ValueError:
            raise _Garbage("the answer is not JSON") from None

    # -- decide -----------------------------------------------------------------

    def _query(
        self,
        dependency: str,
        *,
        exception: BaseException | None,
        exception_type: str,
        message: str,
        status_code: int | None,
        run_id: str,
        attempt: int,
    ) -> _Query:
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
            status_code = status_code if status_code is not None else _status_of(exception)
            retry_after = _retry_after_of(exception)
        return _Query(
            dependency=dependency,
            exception_type=exception_type,
            message=message[:MAX_MESSAGE_CHARS],
            status_code=status_code,
            service=self.service,
            run_id=run_id,
            attempt=attempt,
            retry_after_s=retry_after,
        )

    def _local(self, query: _Query) -> Advice:
        return self.local_policy.advise(
            query.dependency,
            exception_type=query.exception_type,
            message=query.message,
            status_code=query.status_code,
            attempt=query.attempt,
            retry_after_s=query.retry_after_s,
        )

    def _advice(self, query: _Query, response: httpx.Response) -> Advice:
        try:
            advice = _advice_from_json(self._read(response), query.dependency)
        except _Garbage as exc:
            self._unusable(str(exc))
            return self._local(query)
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
        query = self._query(
            dependency,
            exception=exception,
            exception_type=exception_type,
            message=message,
            status_code=status_code,
            run_id=run_id,
            attempt=attempt,
        )
        if not self._may_ask():
            return self._local(query)
        try:
            response = self._sync_http().post("/v1/decide", json=query.to_json())
        except httpx.HTTPError as exc:  # refused, timed out, reset, malformed
            self._unusable(_describe(exc))
            return self._local(query)
        return self._advice(query, response)

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
        query = self._query(
            dependency,
            exception=exception,
            exception_type=exception_type,
            message=message,
            status_code=status_code,
            run_id=run_id,
            attempt=attempt,
        )
        if not self._may_ask():
            return self._local(query)
        try:
            response = await self._async_http().post("/v1/decide", json=query.to_json())
        except httpx.HTTPError as exc:
            self._unusable(_describe(exc))
            return self._local(query)
        return self._advice(query, response)

    # -- breakers ---------------------------------------------------------------

    def _breaker_path(self, dependency: str) -> str:
        if not dependency:
            raise ValueError("dependency must not be empty")
        return "/v1/breakers/" + quote(dependency, safe="")

    def _breaker(self, response: httpx.Response) -> str:
        try:
            payload = self._read(response)
            if not isinstance(payload, dict) or payload.get("state") not in _BREAKER_STATES:
                raise _Garbage("the answer has no breaker state")
        except _Garbage as exc:
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


def _shared_client() -> SupervisorClient:
    """The process-wide client a :class:`Guard` uses when given none (defaults, env token)."""
    global _shared  # noqa: PLW0603 - one lazily made client per process is the point
    with _shared_lock:
        if _shared is None:
            _shared = SupervisorClient()
        return _shared


# -- guard -------------------------------------------------------------------------


def _add_note(exc: BaseException, advice: Advice, extra: str = "") -> None:
    shadow = " (observe only)" if advice.observe_only else ""
    note = (
        f"spanvisor ({advice.source}{shadow}): {advice.action.value}: "
        f"{advice.reason or advice.policy}{extra}"
    )
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)


@dataclass(frozen=True, slots=True)
class _Step:
    """What the guard does after a failed attempt."""

    kind: Literal["retry", "fallback", "raise"]
    delay_s: float = 0.0
    to: str = ""


class Guard:
    """Runs a call to one dependency under the sidecar's advice. Make one with :func:`guard`."""

    def __init__(
        self,
        dependency: str,
        *,
        client: SupervisorClient | None = None,
        fallback: Callable[[str], Any] | None = None,
        max_attempts: int = 5,
        run_id: str = "",
    ) -> None:
        if not dependency:
            raise ValueError("dependency must not be empty")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.dependency = dependency
        self.fallback = fallback
        self.max_attempts = max_attempts
        self.run_id = run_id
        self._client = client

    @property
    def client(self) -> SupervisorClient:
        return self._client if self._client is not None else _shared_client()

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorate a sync or async function."""
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[P, Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def awrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                return await self.acall(afn, *args, **kwargs)

            return cast(Callable[P, R], awrapper)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return self.call(fn, *args, **kwargs)

        return wrapper

    def _step(self, exc: Exception, advice: Advice, attempt: int) -> _Step:
        if not advice.observe_only:
            if advice.action is Action.RETRY and attempt < self.max_attempts:
                return _Step("retry", delay_s=advice.delay_s)
            if advice.action is Action.FALLBACK and self.fallback is not None:
                return _Step("fallback", to=advice.fallback_to or self.dependency)
        spent = (
            f"; the guard's {self.max_attempts} attempts are spent"
            if advice.action is Action.RETRY and not advice.observe_only
            else ""
        )
        _add_note(exc, advice, spent)
        return _Step("raise")

    def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call ``fn(*args, **kwargs)`` under the guard (sync; blocks while waiting to retry)."""
        client = self.client
        state = client.breaker_state(self.dependency)
        if state in OPEN_STATES:
            if self.fallback is not None:
                return cast(R, self.fallback(self.dependency))
            raise BreakerOpen(self.dependency, state)
        attempt = 1
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                advice = client.decide(
                    self.dependency, exception=exc, run_id=self.run_id, attempt=attempt
                )
                step = self._step(exc, advice, attempt)
                if step.kind == "raise":
                    raise
                if step.kind == "fallback":
                    assert self.fallback is not None
                    return cast(R, self.fallback(step.to))
                client.sleep(step.delay_s)
            attempt += 1

    async def acall(self, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Await ``fn(*args, **kwargs)`` under the guard; the fallback may be sync or async."""
        client = self.client
        state = await client.abreaker_state(self.dependency)
        if state in OPEN_STATES:
            if self.fallback is not None:
                return cast(R, await _maybe_await(self.fallback(self.dependency)))
            raise BreakerOpen(self.dependency, state)
        attempt = 1
        while True:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                advice = await client.adecide(
                    self.dependency, exception=exc, run_id=self.run_id, attempt=attempt
                )
                step = self._step(exc, advice, attempt)
                if step.kind == "raise":
                    raise
                if step.kind == "fallback":
                    assert self.fallback is not None
                    return cast(R, await _maybe_await(self.fallback(step.to)))
                await client.async_sleep(step.delay_s)
            attempt += 1

    def attempts(self) -> Iterator[GuardedAttempt]:
        """Attempts for a ``with`` block, as tenacity's ``for attempt in Retrying()``::

            try:
                for attempt in guard("openai:gpt-4o").attempts():
                    with attempt:
                        answer = ask("gpt-4o", prompt)
            except FallbackAdvised as advised:
                answer = ask(advised.to.split(":", 1)[1], prompt)

        Before the first attempt an open or isolated breaker raises
        :class:`BreakerOpen`. An exception in the block is passed to
        :meth:`SupervisorClient.decide`: ``retry`` sleeps the advised delay and
        the loop goes on (at most ``max_attempts`` attempts); ``fallback``
        raises :class:`FallbackAdvised` naming the alternative; anything else
        lets the exception out, with the advice as a note.
        """
        client = self.client
        state = client.breaker_state(self.dependency)
        if state in OPEN_STATES:
            raise BreakerOpen(self.dependency, state)
        for number in range(1, self.max_attempts + 1):
            attempt = GuardedAttempt(self, client, number)
            yield attempt
            if attempt.done:
                return


class FallbackAdvised(SupervisorError):
    """The sidecar advises calling ``to`` instead of ``dependency`` (see :meth:`Guard.attempts`)."""

    def __init__(self, dependency: str, to: str) -> None:
        super().__init__(f"spanvisor advises falling back from {dependency} to {to}")
        self.dependency = dependency
        self.to = to


class GuardedAttempt:
    """One attempt of :meth:`Guard.attempts`: a context manager that judges its exception."""

    def __init__(self, guard: Guard, client: SupervisorClient, number: int) -> None:
        self._guard = guard
        self._client = client
        self.number = number
        #: No more attempts follow: the block succeeded or its error went out.
        self.done = False

    def __enter__(self) -> GuardedAttempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        self.done = True
        if exc is None or not isinstance(exc, Exception):
            return False  # success, or KeyboardInterrupt and the like: not ours to judge
        guard = self._guard
        advice = self._client.decide(
            guard.dependency, exception=exc, run_id=guard.run_id, attempt=self.number
        )
        if not advice.observe_only and advice.action is Action.FALLBACK:
            raise FallbackAdvised(guard.dependency, advice.fallback_to or guard.dependency) from exc
        step = guard._step(exc, advice, self.number)
        if step.kind == "retry":
            self._client.sleep(step.delay_s)
            self.done = False
            return True  # swallowed: the loop makes the next attempt
        return False


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def guard(
    dependency: str,
    *,
    client: SupervisorClient | None = None,
    fallback: Callable[[str], Any] | None = None,
    max_attempts: int = 5,
    run_id: str = "",
) -> Guard:
    """Run calls to ``dependency`` under the sidecar's advice.

    Two ways to use it (a ``with`` block cannot re-run its body, so there is none)::

        @guard("openai:gpt-4o", fallback=lambda to: ask(model=to.split(":", 1)[1]))
        def ask(prompt: str) -> str: ...          # or `async def`

        answer = guard("tool:search").call(search, "query")        # sync
        answer = await guard("tool:search").acall(asearch, "query")  # async

    The decorator tells async functions by ``inspect.iscoroutinefunction``;
    wrap any other callable that returns an awaitable with ``acall``.

    What a guarded call does:

    1. It asks for the breaker of ``dependency``. Open or isolated: it calls
       ``fallback(dependency)`` and returns its result, or without a fallback
       raises :class:`BreakerOpen`; the function is not called. A sidecar that
       cannot say (``"unknown"``) does not stop the call.
    2. It calls the function. Success returns its result. An ``Exception``
       (never ``KeyboardInterrupt``, ``CancelledError``...) is passed to
       :meth:`SupervisorClient.decide` with ``attempt`` = the number of the
       failed attempt, and the advice is followed:

       - ``retry``: sleep ``delay_s`` (the client's ``sleep`` / ``async_sleep``)
         and call again, unless ``max_attempts`` calls were made: then re-raise.
       - ``fallback``: return ``fallback(advice.fallback_to or dependency)``
         (awaited when it returns an awaitable); without a fallback, re-raise.
         What the fallback raises propagates, unguarded.
       - ``fail_fast``, ``escalate``, ``remediate``, ``none``: re-raise.
       - observe-only advice (shadow mode) is never acted on: re-raise.

    Whatever is re-raised is the last exception of the function itself, with
    its traceback, and on Python 3.11+ a note giving the advice. ``client``
    defaults to one shared client built from the environment.
    """
    return Guard(
        dependency, client=client, fallback=fallback, max_attempts=max_attempts, run_id=run_id
    )


# -- webhooks -------------------------------------------------------------------------


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, Any]:
    """The command a signed webhook carries (see ``Command.to_json``), once its signature holds.

    Raises :class:`SignatureError` for a missing, wrong or stale signature and
    ``ValueError`` for a body that is not a JSON object. Pair it with
    :class:`SeenCommands` on ``idempotency_key`` to drop redeliveries.
    """
    verify(secret, headers, body, tolerance_s=tolerance_s)
    try:
        command = json.loads(body)
    except ValueError as exc:  # also UnicodeDecodeError
        raise ValueError(f"the webhook body is not JSON: {exc}") from exc
    if not isinstance(command, dict):
        raise ValueError("the webhook body is not a JSON object")
    return command


class SeenCommands:
    """The idempotency keys of the last ``capacity`` commands, to drop a redelivered one.

    Thread-safe; bounded (least recently seen keys are forgotten first).
    """

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, key: str) -> bool:
        """True the first time ``key`` is seen (remember it), False for a repeat."""
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return False
            self._keys[key] = None
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
