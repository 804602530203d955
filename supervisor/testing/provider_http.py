"""The fake provider's HTTP side: its endpoints, each reply in OpenAI's or Anthropic's format.

Plain or streamed (SSE), successes and faults, as the SDKs expect them.
Everything a request can make the server hold is bounded: the body it reads
(:data:`MAX_BODY_BYTES`), the body it logs, the delay it waits.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from supervisor.testing.loopback import LoopbackHTTPServer
from supervisor.testing.provider_limits import Limited, RateLimiter, go_duration, request_tokens
from supervisor.testing.provider_replies import FaultPlan, Reply

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


class ProviderState:
    """Shared, lock-protected state of one fake server."""

    def __init__(
        self,
        default: Reply,
        fault_plan: FaultPlan | None,
        max_script: int,
        max_requests: int,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.lock = threading.Lock()
        #: The published limit per API key, on the OpenAI endpoint (``None``: no limit).
        self.limiter = limiter
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


class ProviderHandler(BaseHTTPRequestHandler):
    """One request; the server's ``context`` (the fake's state) says how to answer."""

    server: LoopbackHTTPServer[ProviderState]
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this, Nagle plus the
    # peer's delayed ACK add ~40 ms to every keep-alive request.
    disable_nagle_algorithm = True
    #: OpenAI's ``x-ratelimit-*`` headers for this request's key, sent with its answer.
    _limit_headers: tuple[tuple[str, str], ...] = ()

    # Silence the default stderr access log: tests stay quiet.
    def log_message(self, format: str, *args: Any) -> None:
        return

    def send_response_only(self, code: int, message: str | None = None) -> None:
        super().send_response_only(code, message or _STATUS_REASONS.get(code))

    # -- routing -----------------------------------------------------------

    def do_GET(self) -> None:
        self._limit_headers = ()  # a keep-alive connection reuses the handler
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
        self._limit_headers = ()
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
        params = body if isinstance(body, dict) else {}
        limiter = self.server.context.limiter
        if limiter is not None and path == "/v1/chat/completions":
            limited = limiter.take(self._api_key(), request_tokens(params))
            self._limit_headers = limited.headers
            if limited.refused:
                self._refuse(limited, params, raw)
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
        anthropic = path == "/v1/messages"
        if reply.status >= 400:
            self._send_fault(reply, anthropic)
        elif anthropic:
            self._answer_anthropic(reply, params)
        else:
            self._answer_openai(reply, params)

    # -- the published limit -----------------------------------------------

    def _api_key(self) -> str:
        auth = self.headers.get("authorization") or ""
        return auth.removeprefix("Bearer ").strip()

    def _refuse(self, limited: Limited, params: Mapping[str, Any], raw: bytes) -> None:
        """OpenAI's 429 for a request over the key's limit, with its wording and headers."""
        model = str(params.get("model") or "gpt-4o-mini")
        wait = round(limited.retry_after_s, 6)  # 100.0000001 ms is 100 ms, not 101
        per = "requests per min (RPM)" if limited.by == "requests" else "tokens per min (TPM)"
        reply = Reply.fault(
            429,
            f"Rate limit reached for {model} in organization org-fake on {per}: "
            f"Limit {limited.limit}, Used {limited.used}, Requested {limited.requested}. "
            f"Please try again in {go_duration(wait)}. Visit "
            "https://platform.openai.com/account/rate-limits to learn more.",
            error_type=limited.by,
            error_code="rate_limit_exceeded",
            headers={
                "retry-after": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
            },
        )
        self.server.context.record(
            RecordedRequest(
                "POST",
                "/v1/chat/completions",
                dict(self.headers.items()),
                params if len(raw) <= MAX_LOGGED_BODY_BYTES else None,
                reply,
                len(raw),
            )
        )
        self._send_fault(reply, anthropic=False)

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
        for name, value in (*headers, *self._limit_headers):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        for name, value in self._limit_headers:
            self.send_header(name, value)
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
            if reply.stream_breaks:
                error = self._openai_error_body(
                    reply.error_message, reply.error_type, reply.error_code, reply.error_param
                )
                self._sse(error)
                return
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
