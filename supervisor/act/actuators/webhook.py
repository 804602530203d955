"""The webhook actuator: one signed ``POST`` of a command to the agent.

The body is the command's JSON, signed as Standard Webhooks say
(:mod:`supervisor.act.signing`), so the agent can check that it comes from its
sidecar and drop a replay; ``Idempotency-Key`` lets it drop a command it has
already acted on, since the dispatcher may deliver one twice after a crash.

One attempt only: the answer becomes a :class:`DeliveryResult` and the
dispatcher decides what to do next. The receiver is not trusted: redirects are
not followed, at most 64 KiB of its answer is read, the whole exchange is
bounded in time, and what it says reaches our logs only as a short, cleaned
snippet.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import httpx
import orjson

from supervisor.act.actuators import MAX_CONCURRENT_ATTEMPTS, DeliveryResult, one_line
from supervisor.act.signing import ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, signature_headers
from supervisor.records import Command
from supervisor.retry_after import parse_retry_after

__all__ = ["RETRYABLE_STATUSES", "WebhookActuator", "parse_retry_after"]

log = logging.getLogger("spanvisor.actuators")

#: Answers that say "not now" rather than "never".
RETRYABLE_STATUSES: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
#: The longest wait a receiver may ask for: a bad header must not park a command for days.
MAX_RETRY_AFTER_S: Final = 3600.0
MAX_TIMEOUT_S: Final = 60.0
# Enough to read a normal answer to the end (so the connection can be reused);
# a longer one is cut and its connection dropped.
_MAX_RESPONSE_BYTES: Final = 64 * 1024
_SNIPPET_CHARS: Final = 200
# Deliveries may run concurrently; a few connections are plenty for one agent.
_MAX_CONNECTIONS: Final = MAX_CONCURRENT_ATTEMPTS
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# RFC 9110 token characters: anything else in a header name is refused.
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers this actuator sets itself; a static header must not override them
# (the body is signed, and read raw, so it must not be compressed).
_RESERVED_HEADERS: Final = frozenset(
    {
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "accept-encoding",
        "host",
        "connection",
        "user-agent",
        "idempotency-key",
        ID_HEADER,
        TIMESTAMP_HEADER,
        SIGNATURE_HEADER,
    }
)


def _user_agent() -> str:
    try:
        version = importlib.metadata.version("spanvisor")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    return f"spanvisor/{version}"


_USER_AGENT: Final = _user_agent()


class WebhookActuator:
    """Delivers a command as a signed JSON ``POST`` to ``url``; see the module docstring."""

    kind = "webhook"

    def __init__(
        self,
        *,
        url: str,
        secret: str,
        timeout_s: float = 5.0,
        headers: Mapping[str, str] = _NO_HEADERS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = _check_url(url)
        if not isinstance(secret, str) or not secret:
            raise ValueError("webhook secret must be a non-empty string")
        # Fails now, not at the first delivery, on a malformed whsec_ secret.
        signature_headers(secret, "check", b"")
        self._secret = secret
        self.timeout_s = _check_timeout(timeout_s)
        self._headers = _check_headers(headers)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._closed = False

    async def start(self) -> None:
        """Create the HTTP client (once)."""
        if self._client is not None or self._closed:
            return
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s),
            limits=httpx.Limits(
                max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_CONNECTIONS
            ),
            follow_redirects=False,
            # Agents often listen on loopback: an HTTP(S)_PROXY from the
            # environment must not route (or leak) commands elsewhere.
            trust_env=False,
            transport=self._transport,
        )

    async def close(self) -> None:
        """Close the client; later deliveries report a retryable failure."""
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def deliver(self, command: Command) -> DeliveryResult:
        """One ``POST``; never raises (cancellation apart)."""
        try:
            return await self._deliver(command)
        except Exception as exc:
            if self._closed:  # closed under an in-flight request: shutdown, not a bad command
                return DeliveryResult(False, True, _error_detail(exc, "actuator closed"))
            log.exception(
                "webhook delivery failed unexpectedly",
                extra={"command_id": command.id, "url": self.url},
            )
            return DeliveryResult(False, False, _error_detail(exc))

    async def _deliver(self, command: Command) -> DeliveryResult:
        client = self._client
        if client is None:
            state = "closed" if self._closed else "not started"
            return DeliveryResult(False, True, f"RuntimeError: webhook actuator {state}")
        try:
            # Sorted keys: the same command always gives the same signed bytes.
            body = orjson.dumps(command.to_json(), option=orjson.OPT_SORT_KEYS)
        except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
            return DeliveryResult(False, False, _error_detail(exc, "command is not JSON"))
        for name, value in (("id", command.id), ("idempotency_key", command.idempotency_key)):
            if not value or not _is_header_value(value):
                # Sent as headers: a value that cannot be one fails on every attempt.
                return DeliveryResult(
                    False,
                    False,
                    f"ValueError: command {name} {value!r:.80} is not a valid header value",
                )
        headers = {
            **self._headers,
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "User-Agent": _USER_AGENT,
            "Idempotency-Key": command.idempotency_key,
            **signature_headers(self._secret, command.id, body),
        }
        answer = _Answer()
        try:
            # httpx times each phase (connect, each read...); a receiver that
            # trickles bytes defeats that, so the whole exchange is bounded too.
            await asyncio.wait_for(self._post(client, body, headers, answer), self.timeout_s)
        except asyncio.TimeoutError:
            if answer.response is None:
                return DeliveryResult(
                    False, True, f"TimeoutError: no answer within {self.timeout_s:g}s"
                )
            answer.problem = f"body not read within {self.timeout_s:g}s"
        except httpx.HTTPError as exc:  # transport, protocol, decoding errors
            if answer.response is None:
                return DeliveryResult(False, True, _error_detail(exc))
            answer.problem = _error_detail(exc)
        return _result(answer)

    async def _post(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str], answer: _Answer
    ) -> None:
        async with client.stream("POST", self.url, content=body, headers=headers) as response:
            # The status decides the outcome: recorded before the body, which
            # may never come.
            answer.response = response
            size = 0
            async for chunk in response.aiter_raw():
                answer.chunks.append(chunk)
                size += len(chunk)
                if size >= _MAX_RESPONSE_BYTES:
                    break  # leaving the block drops the connection with the unread rest


class _Answer:
    """What arrived of a response before the exchange ended, one way or another."""

    __slots__ = ("chunks", "problem", "response")

    def __init__(self) -> None:
        self.response: httpx.Response | None = None
        self.chunks: list[bytes] = []
        self.problem = ""


def _result(answer: _Answer) -> DeliveryResult:
    response = answer.response
    assert response is not None
    status = response.status_code
    phrase = httpx.codes.get_reason_phrase(status)
    parts = [f"{status} {phrase}".rstrip()]
    if 300 <= status < 400 and "location" in response.headers:
        parts.append(f"to {response.headers['location']}")
    detail = one_line(" ".join(parts), _SNIPPET_CHARS)
    snippet = answer.problem or one_line(
        b"".join(answer.chunks)[: _SNIPPET_CHARS * 4].decode("utf-8", "replace"),
        _SNIPPET_CHARS,
    )
    if snippet:
        detail = f"{detail}: {snippet}"
    if 200 <= status < 300:
        return DeliveryResult(True, False, detail, status)
    if status in RETRYABLE_STATUSES:
        delay = parse_retry_after(response.headers.get("retry-after"))
        return DeliveryResult(False, True, detail, status, delay)
    return DeliveryResult(False, False, detail, status)


def _error_detail(exc: BaseException, context: str = "") -> str:
    message = one_line(str(exc), _SNIPPET_CHARS)
    text = ": ".join(part for part in (type(exc).__name__, context, message) if part)
    return text[: _SNIPPET_CHARS * 2]


def _is_header_value(value: str) -> bool:
    return all(char == "\t" or " " <= char <= "~" for char in value)


def _check_url(url: str) -> str:
    if not isinstance(url, str) or not url:
        raise ValueError("webhook url must be a non-empty string")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ValueError(f"webhook url {url!r} is not a valid URL: {exc}") from None
    if parsed.scheme not in {"http", "https"}:
        raise ValueError(f"webhook url must be http:// or https://, not {url!r}")
    if not parsed.host:
        raise ValueError(f"webhook url {url!r} has no host")
    return url


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"webhook timeout_s must be a number, not {timeout_s!r}")
    if not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"webhook timeout_s must be > 0 and <= {MAX_TIMEOUT_S:g}, not {timeout_s}")
    return float(timeout_s)


def _check_headers(headers: Mapping[str, str]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise ValueError(f"webhook header name {name!r} is not a valid HTTP token")
        if name.lower() in _RESERVED_HEADERS:
            raise ValueError(
                f"webhook header {name!r} is set by spanvisor and cannot be overridden"
            )
        if not isinstance(value, str) or not _is_header_value(value):
            raise ValueError(f"webhook header {name!r} must be printable ASCII (no CR, LF, NUL)")
        checked[name] = value
    return checked
