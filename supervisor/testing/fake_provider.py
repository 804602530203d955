"""A fake OpenAI- and Anthropic-compatible LLM provider on loopback.

Why it exists: the demo and the tests drive the *real* ``openai`` and
``anthropic`` SDKs (and the real instrumentations wrapped around them), so the
spans we normalize are the spans agents really emit. The fake answers with the
providers' documented success and error shapes, so each SDK raises exactly the
exception it raises in production (``RateLimitError``, ``APITimeoutError``,
``APIConnectionError``, ``InternalServerError`` for Anthropic's 529...).

Standard library only: a :class:`~supervisor.testing.loopback.LoopbackServer`.

    with FakeProvider() as provider:
        provider.script(Reply.rate_limited(retry_after_s=1.5), Reply.text("hi"))
        client = openai.OpenAI(base_url=provider.base_url, api_key="sk-fake", max_retries=0)

Endpoints: ``POST /v1/chat/completions`` (plain and ``stream: true`` SSE),
``POST /v1/messages`` (Anthropic Messages API, plain and streaming),
``GET /v1/models``. Scripted replies are consumed in order, then an optional
seeded :class:`FaultPlan` may inject faults, then the default reply answers.
Everything the server holds is bounded: the script queue, the request log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from supervisor.testing.loopback import LOOPBACK, LoopbackHTTPServer, LoopbackServer

__all__ = [
    "FakeProvider",
    "FaultPlan",
    "RecordedRequest",
    "Reply",
    "ToolCall",
]

#: Largest request body the fake reads; bigger requests get a 413.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Largest request body kept in the request log (larger ones are logged without a body).
MAX_LOGGED_BODY_BYTES = 256 * 1024
#: Longest a scripted delay may last (a fake must never hang a test run).
MAX_DELAY_S = 60.0

_STATUS_REASONS = {
    529: "Site Overloaded",
}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the fake model asks for.

    ``arguments`` is the JSON text sent to the client, verbatim, so a test can
    send arguments that are not valid JSON.
    """

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted answer: a success (status 200) or a fault (status >= 400).

    A fault carries both providers' error vocabularies: the OpenAI endpoint
    answers ``{"error": {"message", "type", "param", "code"}}`` and the
    Anthropic endpoint ``{"type": "error", "error": {"type", "message"}}``.
    ``body`` replaces the generated error body entirely when given.
    """

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    #: OpenAI vocabulary (``stop``, ``length``, ``tool_calls``, ``content_filter``);
    #: mapped to Anthropic's ``stop_reason`` on ``/v1/messages``. ``""`` = inferred.
    finish_reason: str = ""
    #: ``(input_tokens, output_tokens)``; estimated from the text when ``None``.
    usage: tuple[int, int] | None = None
    #: Response model; the request's model when ``""``.
    model: str = ""
    status: int = 200
    #: OpenAI ``error.type``.
    error_type: str = ""
    #: OpenAI ``error.code``.
    error_code: str = ""
    #: OpenAI ``error.param``.
    error_param: str = ""
    #: Anthropic ``error.type``.
    anthropic_error_type: str = ""
    error_message: str = ""
    #: Anthropic's wording of the error; ``error_message`` when ``""``.
    anthropic_message: str = ""
    body: Mapping[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    #: Wait this long before answering (to provoke client timeouts).
    delay_s: float = 0.0
    #: Close the connection without answering (to provoke connection errors).
    drop_connection: bool = False

    @property
    def is_fault(self) -> bool:
        """Whether this reply is an HTTP error or a broken connection."""
        return self.status >= 400 or self.drop_connection

    # -- successes ---------------------------------------------------------

    @classmethod
    def text(
        cls,
        content: str,
        finish_reason: str = "stop",
        usage: tuple[int, int] | None = None,
        model: str = "",
    ) -> Reply:
        """A plain text answer."""
        return cls(content=content, finish_reason=finish_reason, usage=usage, model=model)

    @classmethod
    def tool_call(
        cls,
        name: str,
        arguments: str | Mapping[str, Any] = "{}",
        *more: ToolCall,
        content: str = "",
        usage: tuple[int, int] | None = None,
    ) -> Reply:
        """An answer that calls ``name`` (and any ``more`` tool calls)."""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls = (ToolCall(name, args), *more)
        return cls(content=content, tool_calls=calls, finish_reason="tool_calls", usage=usage)

    @classmethod
    def truncated(cls, content: str = "The answer is cut sho") -> Reply:
        """A text answer cut by the token limit (``finish_reason=length``)."""
        return cls(content=content, finish_reason="length")

    # -- faults ------------------------------------------------------------

    @classmethod
    def fault(
        cls,
        status: int,
        message: str,
        *,
        error_type: str = "",
        error_code: str = "",
        anthropic_error_type: str = "",
        param: str = "",
        headers: Mapping[str, str] | None = None,
        anthropic_message: str = "",
    ) -> Reply:
        """Any HTTP error, in both providers' body shapes."""
        return cls(
            anthropic_message=anthropic_message,
            status=status,
            error_type=error_type,
            error_code=error_code,
            error_param=param,
            anthropic_error_type=anthropic_error_type or _anthropic_type_for(status),
            error_message=message,
            headers=tuple((headers or {}).items()),
        )

    @classmethod
    def rate_limited(cls, retry_after_s: float = 1.0, model: str = "gpt-4o-mini") -> Reply:
        """429 ``rate_limit_exceeded`` with ``retry-after`` headers and OpenAI's wording."""
        wait = f"{retry_after_s:g}s"
        return cls.fault(
            429,
            f"Rate limit reached for {model} in organization org-fake on requests per min "
            f"(RPM): Limit 3, Used 3, Requested 1. Please try again in {wait}. Visit "
            "https://platform.openai.com/account/rate-limits to learn more.",
            error_type="requests",
            error_code="rate_limit_exceeded",
            anthropic_error_type="rate_limit_error",
            anthropic_message="Number of request tokens has exceeded your per-minute rate "
            "limit (https://docs.anthropic.com/en/api/rate-limits); see the response headers "
            "for current usage. Please reduce the prompt length or the maximum tokens "
            "requested, or try again later.",
            headers={
                "retry-after": f"{retry_after_s:g}",
                "retry-after-ms": str(round(retry_after_s * 1000)),
                "x-ratelimit-reset-requests": wait,
            },
        )

    @classmethod
    def quota_exhausted(cls) -> Reply:
        """429 ``insufficient_quota``: retrying does not help."""
        return cls.fault(
            429,
            "You exceeded your current quota, please check your plan and billing details. "
            "For more information on this error, read the docs: "
            "https://platform.openai.com/docs/guides/error-codes/api-errors.",
            error_type="insufficient_quota",
            error_code="insufficient_quota",
            anthropic_error_type="invalid_request_error",
            anthropic_message="Your credit balance is too low to access the Anthropic API. "
            "Please go to Plans & Billing to upgrade or purchase credits.",
        )

    @classmethod
    def overloaded(cls, retry_after_s: float | None = None) -> Reply:
        """Anthropic's 529 ``overloaded_error``."""
        headers = {} if retry_after_s is None else {"retry-after": f"{retry_after_s:g}"}
        return cls.fault(
            529,
            "Overloaded",
            error_type="overloaded_error",
            anthropic_error_type="overloaded_error",
            headers=headers,
        )

    @classmethod
    def context_length_exceeded(cls, limit: int = 128000, used: int = 130571) -> Reply:
        """400 ``context_length_exceeded``."""
        return cls.fault(
            400,
            f"This model's maximum context length is {limit} tokens. However, your messages "
            f"resulted in {used} tokens. Please reduce the length of the messages.",
            error_type="invalid_request_error",
            error_code="context_length_exceeded",
            anthropic_error_type="invalid_request_error",
            anthropic_message=f"prompt is too long: {used} tokens > {limit} maximum",
            param="messages",
        )

    @classmethod
    def unauthorized(cls) -> Reply:
        """401 ``invalid_api_key`` / ``authentication_error``."""
        return cls.fault(
            401,
            "Incorrect API key provided: sk-fake***. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            error_type="invalid_request_error",
            error_code="invalid_api_key",
            anthropic_error_type="authentication_error",
            anthropic_message="invalid x-api-key",
        )

    @classmethod
    def permission_denied(cls) -> Reply:
        """403 ``permission_error``."""
        return cls.fault(
            403,
            "Your API key does not have permission to use the specified resource.",
            error_type="invalid_request_error",
            error_code="unsupported_country_region_territory",
            anthropic_error_type="permission_error",
        )

    @classmethod
    def not_found(cls, model: str = "gpt-9-imaginary") -> Reply:
        """404 ``model_not_found`` / ``not_found_error``."""
        return cls.fault(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            error_type="invalid_request_error",
            error_code="model_not_found",
            anthropic_error_type="not_found_error",
            anthropic_message=f"model: {model}",
        )

    @classmethod
    def content_filtered(cls, azure: bool = False) -> Reply:
        """400 ``content_policy_violation`` (OpenAI) or ``content_filter`` (Azure OpenAI)."""
        if azure:
            return cls.fault(
                400,
                "The response was filtered due to the prompt triggering Azure OpenAI's "
                "content management policy.",
                error_code="content_filter",
                anthropic_error_type="invalid_request_error",
                param="prompt",
            )
        return cls.fault(
            400,
            "Your request was rejected as a result of our safety system.",
            error_type="invalid_request_error",
            error_code="content_policy_violation",
            anthropic_error_type="invalid_request_error",
        )

    @classmethod
    def invalid_request(cls, message: str = "Invalid value for 'temperature'.") -> Reply:
        """400 ``invalid_request_error``."""
        return cls.fault(
            400,
            message,
            error_type="invalid_request_error",
            error_code="invalid_value",
            anthropic_error_type="invalid_request_error",
        )

    @classmethod
    def server_error(cls, status: int = 500) -> Reply:
        """A 5xx: ``server_error`` / ``api_error``."""
        message = (
            "The server is overloaded or not ready yet."
            if status == 503
            else "The server had an error while processing your request. Sorry about that!"
        )
        return cls.fault(
            status,
            message,
            error_type="server_error",
            anthropic_error_type="api_error",
            anthropic_message="Internal server error",
        )

    @classmethod
    def timeout(cls, delay_s: float = 5.0, content: str = "late answer") -> Reply:
        """A success that arrives after ``delay_s``: a client with a shorter timeout gives up."""
        return cls(content=content, finish_reason="stop", delay_s=delay_s)

    @classmethod
    def connection_dropped(cls) -> Reply:
        """The server closes the connection without answering."""
        return cls(drop_connection=True)


def _anthropic_type_for(status: int) -> str:
    """Anthropic's documented ``error.type`` for an HTTP status."""
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        402: "billing_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        504: "timeout_error",
        529: "overloaded_error",
    }.get(status, "api_error")


def _default_faults() -> tuple[Reply, ...]:
    return (
        Reply.rate_limited(retry_after_s=0.5),
        Reply.server_error(503),
        Reply.overloaded(),
        Reply.server_error(500),
    )


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Seeded random fault injection for requests that no script answers.

    Each such request fails with probability ``rate``, with a fault drawn
    from ``faults``; the same seed gives the same sequence of outcomes.
    """

    rate: float = 0.05
    seed: int = 0
    faults: tuple[Reply, ...] = field(default_factory=_default_faults)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            msg = f"FaultPlan.rate must be within [0, 1], got {self.rate!r}"
            raise ValueError(msg)
        if not self.faults:
            msg = "FaultPlan.faults must name at least one fault reply"
            raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """What the fake received.

    ``body`` is the parsed JSON (or text), or ``None`` when the body was larger
    than ``MAX_LOGGED_BODY_BYTES``; ``size`` is its length in bytes.
    """

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    #: The reply it was answered with.
    reply: Reply
    size: int = 0


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _openai_finish(reply: Reply) -> str:
    if reply.finish_reason:
        return reply.finish_reason
    return "tool_calls" if reply.tool_calls else "stop"


_ANTHROPIC_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def _anthropic_stop(reply: Reply) -> str:
    finish = _openai_finish(reply)
    return _ANTHROPIC_STOP.get(finish, finish)


def _tool_input(arguments: str) -> Any:
    """Anthropic sends tool input as an object; keep invalid JSON as text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class _State:
    """Shared, lock-protected state of one fake server."""

    def __init__(
        self,
        default: Reply,
        fault_plan: FaultPlan | None,
        max_script: int,
        max_requests: int,
    ) -> None:
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.default = default
        self.fault_plan = fault_plan
        self.rng = random.Random(fault_plan.seed if fault_plan else 0)  # noqa: S311 - test faults, not crypto
        self.script: deque[Reply] = deque()
        self.max_script = max_script
        self.requests: deque[RecordedRequest] = deque(maxlen=max_requests)
        self.requests_dropped = 0
        self.ids = itertools.count(1)

    def next_reply(self) -> Reply:
        with self.lock:
            if self.script:
                return self.script.popleft()
            plan = self.fault_plan
            if plan is not None and self.rng.random() < plan.rate:
                return self.rng.choice(plan.faults)
            return self.default

    def record(self, request: RecordedRequest) -> None:
        with self.lock:
            if len(self.requests) == self.requests.maxlen:
                self.requests_dropped += 1
            self.requests.append(request)

    def next_id(self) -> int:
        with self.lock:
            return next(self.ids)


class _Handler(BaseHTTPRequestHandler):
    """One request; the server's ``context`` (the fake's state) says how to answer."""

    server: LoopbackHTTPServer[_State]
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this, Nagle plus the
    # peer's delayed ACK add ~40 ms to every keep-alive request.
    disable_nagle_algorithm = True

    # Silence the default stderr access log: tests stay quiet.
    def log_message(self, format: str, *args: Any) -> None:
        return

    def send_response_only(self, code: int, message: str | None = None) -> None:
        super().send_response_only(code, message or _STATUS_REASONS.get(code))

    # -- routing -----------------------------------------------------------

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0].rstrip("/") == "/v1/models":
            models = [
                {"id": m, "object": "model", "created": 1700000000, "owned_by": "fake"}
                for m in ("gpt-4o-mini", "gpt-4o", "claude-haiku-4-5")
            ]
            self._send_json(200, {"object": "list", "data": models})
        else:
            self._send_json(
                404, self._openai_error_body("Not found", "invalid_request_error", "", "")
            )

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the unread body makes the connection unusable
            status = 413 if length > MAX_BODY_BYTES else 400
            message = "Request too large" if status == 413 else "Bad content-length"
            self._send_json(
                status, self._openai_error_body(message, "invalid_request_error", "", "")
            )
            return
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else {}
        except ValueError:
            body = raw.decode("utf-8", "replace")
        if path not in ("/v1/chat/completions", "/v1/messages"):
            self._send_json(
                404, self._openai_error_body("Not found", "invalid_request_error", "", "")
            )
            return
        reply = self.server.context.next_reply()
        self.server.context.record(
            RecordedRequest(
                "POST",
                path,
                dict(self.headers.items()),
                body if len(raw) <= MAX_LOGGED_BODY_BYTES else None,
                reply,
                len(raw),
            )
        )
        if reply.delay_s > 0 and self.server.context.stopping.wait(min(reply.delay_s, MAX_DELAY_S)):
            return  # stopping: abandon the reply
        if reply.drop_connection:
            self._drop()
            return
        params = body if isinstance(body, dict) else {}
        anthropic = path == "/v1/messages"
        if reply.status >= 400:
            self._send_fault(reply, anthropic)
        elif anthropic:
            self._answer_anthropic(reply, params)
        else:
            self._answer_openai(reply, params)

    # -- plumbing ----------------------------------------------------------

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _send_json(
        self, status: int, payload: Any, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, data: Any, event: str = "") -> None:
        prefix = f"event: {event}\n" if event else ""
        text = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"{prefix}data: {text}\n\n".encode())
        self.wfile.flush()

    @staticmethod
    def _openai_error_body(message: str, etype: str, code: str, param: str) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": etype or None,
                "param": param or None,
                "code": code or None,
            }
        }

    def _send_fault(self, reply: Reply, anthropic: bool) -> None:
        request_id = f"req_fake{self.server.context.next_id():06d}"
        if reply.body is not None:
            payload: Any = dict(reply.body)
        elif anthropic:
            payload = {
                "type": "error",
                "error": {
                    "type": reply.anthropic_error_type,
                    "message": reply.anthropic_message or reply.error_message,
                },
                "request_id": request_id,
            }
        else:
            payload = self._openai_error_body(
                reply.error_message, reply.error_type, reply.error_code, reply.error_param
            )
        id_header = ("request-id" if anthropic else "x-request-id", request_id)
        headers = (id_header, *reply.headers)
        self._send_json(reply.status, payload, headers)

    # -- OpenAI chat completions -------------------------------------------

    def _usage(self, reply: Reply, params: Mapping[str, Any]) -> tuple[int, int]:
        if reply.usage is not None:
            return reply.usage
        prompt = json.dumps(params.get("messages", ""), default=str)
        out = reply.content + "".join(c.name + c.arguments for c in reply.tool_calls)
        return _estimate_tokens(prompt), _estimate_tokens(out)

    def _answer_openai(self, reply: Reply, params: Mapping[str, Any]) -> None:
        n = self.server.context.next_id()
        model = reply.model or str(params.get("model") or "gpt-4o-mini")
        prompt_tokens, completion_tokens = self._usage(reply, params)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        calls = [
            {
                "id": c.id or f"call_fake{n:04d}{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(reply.tool_calls)
        ]
        base = {
            "id": f"chatcmpl-fake{n:06d}",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "fp_fake",
        }
        if params.get("stream"):
            self._stream_openai(reply, params, base, calls, usage)
            return
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.content or None,
            "refusal": None,
        }
        if calls:
            message["tool_calls"] = calls
        payload = {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": _openai_finish(reply),
                }
            ],
            "usage": usage,
        }
        self._send_json(200, payload, (("x-request-id", f"req_fake{n:06d}"),))

    def _stream_openai(
        self,
        reply: Reply,
        params: Mapping[str, Any],
        base: Mapping[str, Any],
        calls: list[dict[str, Any]],
        usage: Mapping[str, int],
    ) -> None:
        chunk = {**base, "object": "chat.completion.chunk"}

        def choice(delta: Mapping[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                **chunk,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        self._start_sse()
        self._sse(choice({"role": "assistant", "content": ""}))
        for piece in _pieces(reply.content):
            self._sse(choice({"content": piece}))
        for i, call in enumerate(calls):
            fn = call["function"]
            head = {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            self._sse(choice({"tool_calls": [{"index": i, **head}]}))
            for piece in _pieces(fn["arguments"]):
                self._sse(choice({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        self._sse(choice({}, _openai_finish(reply)))
        options = params.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            self._sse({**chunk, "choices": [], "usage": dict(usage)})
        self._sse("[DONE]")

    # -- Anthropic messages ------------------------------------------------

    def _answer_anthropic(self, reply: Reply, params: Mapping[str, Any]) -> None:
        n = self.server.context.next_id()
        model = reply.model or str(params.get("model") or "claude-haiku-4-5")
        input_tokens, output_tokens = self._usage(reply, params)
        content: list[dict[str, Any]] = []
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        for i, c in enumerate(reply.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": c.id or f"toolu_fake{n:04d}{i}",
                    "name": c.name,
                    "input": _tool_input(c.arguments),
                }
            )
        message = {
            "id": f"msg_fake{n:06d}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": _anthropic_stop(reply),
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }
        if params.get("stream"):
            self._stream_anthropic(message, reply)
            return
        self._send_json(200, message, (("request-id", f"req_fake{n:06d}"),))

    def _stream_anthropic(self, message: Mapping[str, Any], reply: Reply) -> None:
        usage = message["usage"]
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 1},
        }
        self._start_sse()
        self._sse({"type": "message_start", "message": start}, "message_start")
        for index, block in enumerate(message["content"]):
            if block["type"] == "text":
                head: dict[str, Any] = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
            else:
                head = {**block, "input": {}}
                raw = reply.tool_calls[index - (1 if reply.content else 0)].arguments
                deltas = [{"type": "input_json_delta", "partial_json": p} for p in _pieces(raw)]
            self._sse(
                {"type": "content_block_start", "index": index, "content_block": head},
                "content_block_start",
            )
            for delta in deltas:
                self._sse(
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    "content_block_delta",
                )
            self._sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        self._sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
            "message_delta",
        )
        self._sse({"type": "message_stop"}, "message_stop")


def _pieces(text: str, size: int = 8) -> Iterator[str]:
    """Split text into stream chunks (at most 1024 chunks)."""
    size = max(size, len(text) // 1024 + 1)
    for i in range(0, len(text), size):
        yield text[i : i + size]


class FakeProvider(LoopbackServer[_State]):
    """An OpenAI/Anthropic-compatible server on loopback, scripted by the test.

    Thread-safe: the server answers each request on its own daemon thread, and
    the test may :meth:`script` replies at any time. Lifecycle (``start``,
    ``stop``, ``with``, ``port``, ``url``) as :class:`LoopbackServer`'s.
    """

    def __init__(
        self,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        default: Reply | None = None,
        fault_plan: FaultPlan | None = None,
        max_script: int = 1024,
        max_requests: int = 1024,
    ) -> None:
        self._state = _State(
            default if default is not None else Reply.text("Hello from the fake provider."),
            fault_plan,
            max_script,
            max_requests,
        )
        super().__init__(_Handler, self._state, host=host, port=port, name="FakeProvider")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, cutting short any delayed reply; see :meth:`LoopbackServer.stop`."""
        self._state.stopping.set()
        try:
            super().stop(timeout)
        finally:
            self._state.stopping.clear()  # a restarted provider delays its replies again

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, the openai SDK's ``base_url`` (``url``: the anthropic SDK's)."""
        return f"{self.url}/v1"

    # -- scripting ---------------------------------------------------------

    def script(self, *replies: Reply) -> None:
        """Queue replies, answered in order before the fault plan and the default."""
        with self._state.lock:
            if len(self._state.script) + len(replies) > self._state.max_script:
                msg = f"FakeProvider script is bounded to {self._state.max_script} replies"
                raise ValueError(msg)
            self._state.script.extend(replies)

    def reset(self) -> None:
        """Forget scripted replies not yet consumed and the request log."""
        with self._state.lock:
            self._state.script.clear()
            self._state.requests.clear()
            self._state.requests_dropped = 0

    def set_default(self, reply: Reply) -> None:
        """Change the reply given when the script is empty."""
        with self._state.lock:
            self._state.default = reply

    @property
    def pending(self) -> int:
        """Scripted replies not yet consumed."""
        with self._state.lock:
            return len(self._state.script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """The most recent requests received (bounded; see :attr:`requests_dropped`)."""
        with self._state.lock:
            return list(self._state.requests)

    @property
    def requests_dropped(self) -> int:
        """How many old requests fell out of the bounded log."""
        with self._state.lock:
            return self._state.requests_dropped
