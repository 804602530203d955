"""Faults chosen by what is asked, in front of a :class:`FakeProvider`.

Why it exists: :class:`FakeProvider` answers its scripted replies in arrival
order, whatever the request. That is enough when the test makes the calls
itself, but not when a real agent process makes them at its own pace: the test
then needs faults tied to *what* is asked and *when* ("``gpt-4o`` is down for
its next four requests", "the call after step 0's tool result gets a 429",
"the next two calls to ``gpt-4.1-mini`` get a 503") and a model that answers
like one (calls the offered tool, then answers in text).

How: :class:`FaultSchedule` is a small HTTP server on loopback that the SDK
talks to instead of the provider. For each request it reads the body, picks a
reply from its rules (first live rule that matches), else from ``answer``,
scripts that one reply into the FakeProvider (:meth:`FakeProvider.script`) and
forwards the request there unchanged. Every answer, success or fault, is
therefore shaped by FakeProvider exactly as before (status, headers such as
``retry-after``, both providers' error bodies, SSE); only the choice is made
here. Requests are forwarded one at a time, so the reply scripted for a
request is the one it gets; a schedule owns its provider's script.

    with FaultSchedule(answer=tool_then_text("send_email", {"to": "ops@example.com"})) as fake:
        fake.burst(Reply.rate_limited(1.0), model="gpt-4o-mini")
        down = fake.outage("gpt-4o", requests=4)
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)

Standard library only, like FakeProvider. Everything held is bounded: the
served log keeps the last ``max_log`` requests.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from types import MappingProxyType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from supervisor.testing.fake_provider import FakeProvider, Reply
from supervisor.testing.loopback import LOOPBACK, LoopbackHTTPServer, LoopbackServer
from supervisor.testing.provider_http import MAX_BODY_BYTES, MAX_DELAY_S

__all__ = [
    "Answer",
    "Fault",
    "FaultSchedule",
    "Matcher",
    "ProviderRequest",
    "Served",
    "tool_then_text",
]

#: Paths where FakeProvider consumes one scripted reply per request.
_SCRIPTED_PATHS = frozenset({"/v1/chat/completions", "/v1/messages"})
#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the relay sets itself.
_NOT_RELAYED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "host",
        "server",
        "date",
    }
)
_EMPTY: Mapping[str, Any] = MappingProxyType({})
_Schedule = TypeVar("_Schedule", bound="FaultSchedule")


@dataclass(frozen=True, slots=True)
class ProviderRequest:
    """One request as the schedule's rules see it.

    ``body`` is the parsed JSON object (empty when the body is not one);
    ``at`` is ``time.monotonic()`` and ``wall`` is ``time.time()`` at arrival.
    """

    number: int
    method: str
    path: str
    model: str
    body: Mapping[str, Any]
    at: float
    wall: float

    @property
    def messages(self) -> list[Mapping[str, Any]]:
        """The conversation sent (OpenAI ``messages`` or Anthropic ``messages``)."""
        found = self.body.get("messages")
        if not isinstance(found, list):
            return []
        return [m for m in found if isinstance(m, Mapping)]

    @property
    def last_role(self) -> str:
        """Role of the last message; ``"tool"`` also for an Anthropic turn of tool results."""
        messages = self.messages
        if not messages:
            return ""
        last = messages[-1]
        role = str(last.get("role", ""))
        content = last.get("content")
        if (
            role == "user"
            and isinstance(content, list)
            and content
            and all(isinstance(p, Mapping) and p.get("type") == "tool_result" for p in content)
        ):
            return "tool"
        return role

    @property
    def last_user_text(self) -> str:
        """Text of the last user message that is not only tool results."""
        for message in reversed(self.messages):
            if message.get("role") != "user":
                continue
            text = _text_of(message.get("content"))
            if text:
                return text
        return ""

    def offers_tool(self, name: str) -> bool:
        """Whether the request offers a tool called ``name`` (either provider's shape)."""
        tools = self.body.get("tools")
        if not isinstance(tools, list):
            return False
        for tool in tools:
            if not isinstance(tool, Mapping):
                continue
            function = tool.get("function")
            offered = function.get("name") if isinstance(function, Mapping) else tool.get("name")
            if offered == name:
                return True
        return False


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            str(p.get("text", ""))
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text"
        ]
        return "\n".join(p for p in parts if p)
    return ""


#: Whether a rule applies to a request (besides its model).
Matcher = Callable[[ProviderRequest], bool]
#: The model's answer to a request no fault takes; ``None`` leaves it to the provider's default.
Answer = Callable[[ProviderRequest], Reply | None]


@dataclass(frozen=True, slots=True)
class Served:
    """One request and how it was answered (``status`` 0: the connection was dropped)."""

    request: ProviderRequest
    status: int
    #: Name of the fault rule that answered, ``""`` when none did.
    fault: str


class Fault:
    """One fault rule: the requests it takes, the reply they get, and its window.

    A request is taken when the rule is live and the request matches (``model``
    if given, and ``when`` if given). The rule's window opens when it is added,
    or at the first matching request (``start="first_request"``), and closes
    when ``requests`` requests were taken, when ``duration_s`` has passed since
    it opened, or when :meth:`end` is called, whichever comes first. All state
    is read and changed under the schedule's lock.
    """

    def __init__(
        self,
        name: str,
        reply: Reply,
        *,
        model: str | None,
        when: Matcher | None,
        requests: int | None,
        duration_s: float | None,
        start: Literal["now", "first_request"],
        lock: threading.Lock,
    ) -> None:
        if requests is not None and requests < 1:
            raise ValueError(f"requests must be at least 1, got {requests}")
        if duration_s is not None and not 0 < duration_s <= 3600:
            raise ValueError(f"duration_s must be in (0, 3600], got {duration_s}")
        self.name = name
        self.reply = reply
        self.model = model
        self.when = when
        self.requests = requests
        self.duration_s = duration_s
        self._lock = lock
        self._hits = 0
        self._started_at: float | None = time.monotonic() if start == "now" else None
        self._ended_at: float | None = None
        self._first_hit: float | None = None
        self._last_hit: float | None = None

    # -- what a test reads -------------------------------------------------

    @property
    def hits(self) -> int:
        """Requests this rule answered."""
        with self._lock:
            return self._hits

    @property
    def started_at(self) -> float | None:
        """``time.monotonic()`` when the window opened (None: not yet)."""
        with self._lock:
            return self._started_at

    @property
    def ended_at(self) -> float | None:
        """``time.monotonic()`` when the window closed (None: still open or not opened)."""
        with self._lock:
            return self._closed_at(time.monotonic())

    @property
    def last_hit_at(self) -> float | None:
        """``time.monotonic()`` of the last request this rule answered."""
        with self._lock:
            return self._last_hit

    @property
    def live(self) -> bool:
        """Whether the rule may still take a request."""
        with self._lock:
            return self._closed_at(time.monotonic()) is None

    def end(self) -> None:
        """Close the window now (an outage ends when the test says so)."""
        with self._lock:
            if self._closed_at(time.monotonic()) is None:
                self._ended_at = time.monotonic()

    # -- what the schedule calls, holding the lock --------------------------

    def _closed_at(self, now: float) -> float | None:
        if self._ended_at is not None:
            return self._ended_at
        if self.requests is not None and self._hits >= self.requests:
            return self._last_hit
        if self.duration_s is not None and self._started_at is not None:
            closes = self._started_at + self.duration_s
            if now >= closes:
                return closes
        return None

    def _take(self, request: ProviderRequest) -> Reply | None:
        if self.model is not None and request.model != self.model:
            return None
        if self._closed_at(request.at) is not None:
            return None
        if self.when is not None and not self.when(request):
            return None
        if self._started_at is None:
            self._started_at = request.at
        self._hits += 1
        self._last_hit = request.at
        return self.reply

    def __repr__(self) -> str:
        return f"Fault({self.name!r}, status={self.reply.status}, model={self.model!r})"


def tool_then_text(
    tool: str,
    arguments: Mapping[str, Any] | Callable[[ProviderRequest], Mapping[str, Any]] = _EMPTY,
    text: str | Callable[[ProviderRequest], str] = "Done.",
) -> Answer:
    """A model that calls ``tool`` once per user turn when it is offered, then answers in text.

    That is the shape of a tool-using agent's step: the model asks for the
    tool, the agent runs it and sends the result, the model answers. The
    arguments and the text may depend on the request (e.g. on the user's words).
    """

    def answer(request: ProviderRequest) -> Reply:
        if request.offers_tool(tool) and request.last_role == "user":
            args = arguments(request) if callable(arguments) else arguments
            return Reply.tool_call(tool, dict(args))
        return Reply.text(text(request) if callable(text) else text)

    return answer


class _FrontHandler(BaseHTTPRequestHandler):
    """Reads a request, lets the schedule choose and forward, relays the answer."""

    server: LoopbackHTTPServer[FaultSchedule]
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; see FakeProvider's handler.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self._handle(b"")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the unread body makes the connection unusable
            status = 413 if length > MAX_BODY_BYTES else 400
            self._answer(status, [("content-type", "application/json")], b'{"error": {}}')
            return
        self._handle(self.rfile.read(length) if length else b"")

    def _handle(self, raw: bytes) -> None:
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _NOT_RELAYED]
        answer = self.server.context._exchange(self.command, self.path, headers, raw)
        if answer is None:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        status, reply_headers, body = answer
        self._answer(status, reply_headers, body)

    def _answer(self, status: int, headers: Sequence[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _NOT_RELAYED:
                self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class FaultSchedule(LoopbackServer["FaultSchedule"]):
    """An OpenAI/Anthropic-compatible endpoint whose faults follow rules; see the module.

    Lifecycle: :meth:`start` (or ``with``) binds a free loopback port and starts
    the provider when the schedule made it; rules may be added at any time
    (:meth:`burst`, :meth:`outage`); :meth:`stop` stops both. Thread-safe.
    """

    def __init__(
        self,
        provider: FakeProvider | None = None,
        *,
        answer: Answer | None = None,
        host: str = LOOPBACK,
        port: int = 0,
        max_log: int = 4096,
    ) -> None:
        super().__init__(_FrontHandler, self, host=host, port=port, name="FaultSchedule")
        self._owns_provider = provider is None
        self.provider = provider if provider is not None else FakeProvider()
        self.answer = answer
        #: Guards the rules, the log and the provider's script; held for a whole exchange.
        self._lock = threading.Lock()
        self._rules: list[Fault] = []
        self._served: deque[Served] = deque(maxlen=max_log)
        self._numbers = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------

    def start(self: _Schedule, timeout: float = 5.0) -> _Schedule:
        """Start the provider (when the schedule made it), then bind and serve; idempotent."""
        self.provider.start(timeout)
        try:
            return super().start(timeout)
        except BaseException:
            if self._owns_provider:
                self.provider.stop(timeout)
            raise

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; stop the provider too when the schedule made it."""
        if self._owns_provider:
            self.provider.stop(timeout)  # first: cuts short a delayed reply being forwarded
        super().stop(timeout)

    # -- addresses -----------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` (the openai SDK's base URL, ``OPENAI_BASE_URL``)."""
        return f"{self.url}/v1"

    # -- rules ---------------------------------------------------------------

    def burst(
        self,
        reply: Reply,
        count: int = 1,
        *,
        model: str | None = None,
        when: Matcher | None = None,
        name: str = "",
    ) -> Fault:
        """The next ``count`` matching requests get ``reply`` (a burst of 503s, one 401...)."""
        return self._add(
            Fault(
                name or f"burst-{reply.status}",
                reply,
                model=model,
                when=when,
                requests=count,
                duration_s=None,
                start="now",
                lock=self._lock,
            )
        )

    def outage(
        self,
        model: str,
        *,
        reply: Reply | None = None,
        duration_s: float | None = None,
        requests: int | None = None,
        start: Literal["now", "first_request"] = "first_request",
        when: Matcher | None = None,
        name: str = "",
    ) -> Fault:
        """``model`` answers ``reply`` (a 503 by default) to every request in a window.

        The window opens at the model's first request (or now) and closes after
        ``duration_s``, after ``requests`` failed requests, or at
        :meth:`Fault.end`, whichever comes first.
        """
        return self._add(
            Fault(
                name or f"outage-{model}",
                reply if reply is not None else Reply.server_error(503),
                model=model,
                when=when,
                requests=requests,
                duration_s=duration_s,
                start=start,
                lock=self._lock,
            )
        )

    def _add(self, fault: Fault) -> Fault:
        with self._lock:
            self._rules.append(fault)
        return fault

    def clear(self) -> None:
        """Forget every rule (the served log stays)."""
        with self._lock:
            self._rules.clear()

    @property
    def served(self) -> list[Served]:
        """The most recent requests and their answers, oldest first (bounded)."""
        with self._lock:
            return list(self._served)

    # -- the exchange ----------------------------------------------------------

    def _choose(self, request: ProviderRequest) -> tuple[Reply | None, str]:
        """Called with the lock held: the first live matching rule, else ``answer``."""
        for fault in self._rules:
            reply = fault._take(request)
            if reply is not None:
                return reply, fault.name
        if self.answer is not None:
            return self.answer(request), ""
        return None, ""

    def _exchange(
        self, method: str, target: str, headers: list[tuple[str, str]], raw: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes] | None:
        """Choose a reply, script it, forward, and return the provider's answer (None: dropped)."""
        path = target.split("?", 1)[0].rstrip("/")
        try:
            parsed: object = json.loads(raw) if raw else {}
        except ValueError:
            parsed = {}
        body: Mapping[str, Any] = parsed if isinstance(parsed, dict) else {}
        with self._lock:
            request = ProviderRequest(
                number=next(self._numbers),
                method=method,
                path=path,
                model=str(body.get("model") or ""),
                body=body,
                at=time.monotonic(),
                wall=time.time(),
            )
            reply, fault = None, ""
            if path in _SCRIPTED_PATHS:
                try:
                    reply, fault = self._choose(request)
                except Exception as exc:  # a test's matcher or answer is broken: say so
                    reply = Reply.fault(500, f"fault schedule rule raised {exc!r}")
                    fault = "schedule-error"
            if reply is not None and method == "POST":
                self.provider.script(reply)
            answer = self._forward(method, target, headers, raw)
            self._served.append(Served(request, answer[0] if answer else 0, fault))
        return answer

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], raw: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes] | None:
        where = urlsplit(self.provider.url)
        connection = http.client.HTTPConnection(
            where.hostname or "127.0.0.1", where.port, timeout=MAX_DELAY_S + 5.0
        )
        try:
            connection.request(method, target, body=raw or None, headers=dict(headers))
            response = connection.getresponse()
            data = response.read()  # SSE included: the provider closes the stream when done
            return response.status, response.getheaders(), data
        except (OSError, http.client.HTTPException):
            return None  # the provider dropped the connection: the client sees the same
        finally:
            connection.close()
