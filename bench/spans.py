"""Realistic agent spans, pre-encoded as OTLP ``ExportTraceServiceRequest`` bytes.

Benchmarks must push what agents really export, not toy spans: a throughput
figure measured on three-attribute spans says nothing about a sidecar that
reads 15 attributes and a few hundred bytes of prompt per span.

What a request holds (deterministic for a given seed):

* several whole traces, from two services exported side by side:
  ``research-agent`` instrumented with the OTel GenAI conventions
  (``gen_ai.*``, OpenAI or Anthropic) and ``support-agent`` instrumented with
  OpenInference (``openinference.span.kind`` AGENT / CHAIN / LLM / TOOL);
* per trace an agent root, then steps of LLM call → tool call, some tools with
  an HTTP client child span (``http.request.method``, ``url.full``...). An LLM
  span that leads to a tool call records it as its output (OpenInference
  always, as its instrumentation does; GenAI in the half of the agents that
  capture message content), and OpenInference LLM spans list the six offered
  tools (``llm.tools.N.tool.json_schema``);
* 10-20 attributes per span, up to 26 on LLM spans with the offered tools;
  prompts and outputs of a few hundred bytes;
* spans in end order (children before parents), as the SDK's batch processor
  exports them;
* exactly ``round(failure_rate * spans)`` *originating* failures overall (an
  ERROR span none of whose children is ERROR): ``openai.RateLimitError`` 429
  ``rate_limit_exceeded``, ``openai.InternalServerError`` 503,
  ``openai.APITimeoutError``, Anthropic 529 ``overloaded_error``, tools failing
  with ``TimeoutError`` or ``ConnectionRefusedError``, HTTP 503 and
  ``httpx.ReadTimeout``. A tool span whose HTTP child failed is ERROR too (it
  only propagates the child's error), as a real ``raise_for_status`` does.

Ids carry fixed markers in their low bytes so that :func:`with_fresh_ids` can
give a pre-encoded payload new trace and span ids with two ``bytes.replace``
calls: benchmarks send millions of distinct spans without re-encoding them.
"""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span, Status

AttrValue = str | int | float | bool | list[str]

# Low 8 bytes of every trace id and low 4 bytes of every span id. Not valid
# UTF-8 (0xf5.. never starts a UTF-8 sequence), so they cannot occur inside a
# string attribute; a chance match inside other random id bytes is ~2**-32.
TRACE_MARK = b"\xf5\x9e\x1c\x73\xd4\x28\xab\x06"
SPAN_MARK = b"\xf7\xa3\x5c\xe1"
# Tail of every session and conversation id, so that copies start new runs too
# (the sidecar keys a run by its session when the spans name one). Same length
# as what replaces it, ``~copy-`` and 8 hex digits: the encoding stays valid.
SESSION_MARK = b"~copy-00000000"
MAX_FRESH_INDEX = 2**31 - 1

_SPAN_KIND_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
_SPAN_KIND_CLIENT = Span.SpanKind.SPAN_KIND_CLIENT
_MS = 1_000_000


@dataclass
class _Spec:
    """A span under construction; encoded to protobuf once failures are applied."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    name: str
    kind: int
    start: int
    end: int
    role: str  # agent | chain | llm | tool | http
    service: str
    scope: str
    attrs: dict[str, AttrValue]
    flavor: str  # genai | openinference
    provider: str = ""
    error: tuple[str, str] | None = None  # (exception type, message); None: no exception event
    status_message: str = ""
    failed: bool = False
    children: list[_Spec] = field(default_factory=list)


_SCOPE_VERSIONS = {
    "opentelemetry.instrumentation.openai_v2": "2.1b0",
    "opentelemetry.instrumentation.anthropic": "0.40.2",
    "opentelemetry.instrumentation.httpx": "0.48b0",
    "research_agent": "1.4.2",
    "openinference.instrumentation.langchain": "0.1.29",
    "openinference.instrumentation.openai": "0.1.18",
}

_RESOURCES: dict[str, dict[str, AttrValue]] = {
    "research-agent": {
        "service.name": "research-agent",
        "service.version": "1.4.2",
        "service.instance.id": "research-agent-7c9f8b6d5-x2k4q",
        "deployment.environment.name": "production",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": "1.27.0",
        "host.name": "ip-10-0-3-17",
        "process.pid": 7,
        "process.runtime.name": "cpython",
        "process.runtime.version": "3.11.9",
    },
    "support-agent": {
        "service.name": "support-agent",
        "service.version": "0.9.0",
        "deployment.environment.name": "production",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": "1.27.0",
        "host.name": "support-agent-0",
        "openinference.project.name": "support",
    },
}

_QUESTIONS = (
    "Summarise the open incidents for the payments service over the last 24 hours and "
    "tell me which ones are likely caused by the new database migration.",
    "My order #A-48213 arrived damaged. Can I get a replacement shipped to the same address, "
    "and how long will it take?",
    "Compare the latency of our EU and US checkout endpoints this week and explain any "
    "regression you find, citing the relevant dashboards.",
    "Find recent papers on speculative decoding for small models and list the three most "
    "cited with a one-line summary each.",
    "The customer says they were charged twice for invoice INV-2291. Check the billing "
    "records and refund the duplicate charge if there is one.",
    "Draft a reply to the customer explaining why their API key was rotated and what they "
    "need to change in their deployment.",
)
_ANSWERS = (
    "There are 3 open incidents for payments. INC-1042 (elevated 5xx on /charge) started "
    "12 minutes after migration 0193 was applied and is very likely related; INC-1039 and "
    "INC-1045 predate it. I recommend rolling back 0193 on one replica to confirm.",
    "I have created replacement order #A-48990 for the damaged item. It ships from the "
    "Rotterdam warehouse today and should arrive within 2-3 business days. No return is "
    "needed; you will receive a tracking link by email.",
    "EU checkout p95 rose from 180 ms to 410 ms on Tuesday after the cache cluster was "
    "resized; US is unchanged at 170 ms. The cache hit ratio in EU dropped from 94% to 61%.",
    "1. Medusa (2024): multiple decoding heads, 2.2x speed-up. 2. EAGLE: feature-level "
    "drafting, 3x on 7B models. 3. Lookahead decoding: no draft model, Jacobi iterations.",
    "Invoice INV-2291 was charged twice on 3 March (ch_3Oq1 and ch_3Oq2). I refunded the "
    "duplicate charge ch_3Oq2 (EUR 149.00); it will appear on the statement in 5-10 days.",
)
_SYSTEM = (
    "You are a careful operations assistant. Use the tools provided to look up facts "
    "before answering. Never invent ticket numbers. Answer concisely."
)
_TOOLS = (
    ("search_tickets", "Search the ticketing system by free text and status."),
    ("get_order", "Fetch an order by id, with its items and shipping state."),
    ("query_metrics", "Run a PromQL query over a time range and return the series."),
    ("web_search", "Search the public web and return the top results with snippets."),
    ("issue_refund", "Refund a charge by id. Requires the charge id and an amount."),
    ("send_email", "Send an email to a customer from the support address."),
)
_TOOL_HOSTS = {
    "search_tickets": ("GET", "tickets.internal", 8080, "/api/v2/search"),
    "get_order": ("GET", "orders.internal", 8443, "/v1/orders/A-48213"),
    "query_metrics": ("GET", "prometheus.monitoring.svc", 9090, "/api/v1/query_range"),
    "web_search": ("GET", "api.tavily.com", 443, "/search"),
    "issue_refund": ("POST", "api.stripe.com", 443, "/v1/refunds"),
    "send_email": ("POST", "api.sendgrid.com", 443, "/v3/mail/send"),
}
_OPENAI_MODELS = (("gpt-4o", "gpt-4o-2024-08-06"), ("gpt-4o-mini", "gpt-4o-mini-2024-07-18"))
_ANTHROPIC_MODELS = (
    ("claude-sonnet-4-20250514", "claude-sonnet-4-20250514"),
    ("claude-3-5-haiku-20241022", "claude-3-5-haiku-20241022"),
)

_PY_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/app/.venv/lib/python3.11/site-packages/opentelemetry/trace/__init__.py", '
    "line 589, in use_span\n    yield span\n"
    '  File "/app/agent/steps.py", line 118, in {where}\n    result = {call}\n'
    '  File "/app/.venv/lib/python3.11/site-packages/{lib}", line {line}, in {func}\n'
    "    raise self._make_status_error_from_response(err.response) from None\n"
    "{etype}: {message}\n"
)


def _openai_rate_limit(model: str, rng: random.Random) -> tuple[str, str, str]:
    used = rng.randint(27_000, 29_990)
    wait = rng.uniform(0.3, 9.0)
    message = (
        f"Error code: 429 - {{'error': {{'message': 'Rate limit reached for {model} in "
        f"organization org-4kTjQ2sLr8WmN0pXc6bV on tokens per min (TPM): Limit 30000, "
        f"Used {used}, Requested {rng.randint(800, 4000)}. Please try again in {wait:.3f}s. "
        "Visit https://platform.openai.com/account/rate-limits to learn more.', "
        "'type': 'tokens', 'param': None, 'code': 'rate_limit_exceeded'}}"
    )
    return "openai.RateLimitError", "RateLimitError", message


def _llm_failure(spec: _Spec, rng: random.Random) -> tuple[str, str, str]:
    """(exception type, error.type, message) of a failed LLM call."""
    model = str(spec.attrs.get("gen_ai.request.model") or spec.attrs.get("llm.model_name"))
    roll = rng.random()
    if spec.provider == "anthropic":
        if roll < 0.5:
            etype = "anthropic.OverloadedError" if roll < 0.25 else "anthropic.InternalServerError"
            return (
                etype,
                etype.split(".", 1)[1],
                "Error code: 529 - {'type': 'error', 'error': {'type': 'overloaded_error', "
                "'message': 'Overloaded'}}",
            )
        if roll < 0.8:
            return (
                "anthropic.RateLimitError",
                "RateLimitError",
                "Error code: 429 - {'type': 'error', 'error': {'type': 'rate_limit_error', "
                "'message': 'This request would exceed the rate limit for your organization "
                "of 80,000 input tokens per minute.'}}",
            )
        return "anthropic.APITimeoutError", "APITimeoutError", "Request timed out."
    if roll < 0.5:
        return _openai_rate_limit(model, rng)
    if roll < 0.75:
        return (
            "openai.InternalServerError",
            "InternalServerError",
            "Error code: 503 - {'error': {'message': 'The engine is currently overloaded, "
            "please try again later', 'type': 'server_error', 'param': None, 'code': None}}",
        )
    return "openai.APITimeoutError", "APITimeoutError", "Request timed out."


def _stacktrace(etype: str, message: str, where: str, lib: str) -> str:
    return _PY_TRACE.format(
        where=where,
        call="await client.chat.completions.create(**params)",
        lib=lib,
        line=1059,
        func="_request",
        etype=etype,
        message=message,
    )


def _fail(spec: _Spec, rng: random.Random) -> None:
    """Turn a successful span into a realistic originating failure, in place."""
    spec.failed = True
    a = spec.attrs
    if spec.role == "llm":
        etype, short, message = _llm_failure(spec, rng)
        for key in (
            "gen_ai.response.model",
            "gen_ai.response.id",
            "gen_ai.response.finish_reasons",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "output.value",
            "output.mime_type",
            "llm.token_count.prompt",
            "llm.token_count.completion",
            "llm.token_count.total",
        ):
            a.pop(key, None)
        for key in [k for k in a if k.startswith(("llm.output_messages.", "gen_ai.output."))]:
            del a[key]
        if spec.flavor == "genai":
            a["error.type"] = short
        spec.error = (etype, message)
        spec.status_message = message if spec.flavor == "genai" else f"{short}: {message}"
        spec.end = spec.start + rng.randint(150, 900) * _MS
    elif spec.role == "tool":
        tool = str(a.get("gen_ai.tool.name") or a.get("tool.name"))
        for key in ("gen_ai.tool.call.result", "output.value", "output.mime_type"):
            a.pop(key, None)
        if rng.random() < 0.7:
            spec.error = ("TimeoutError", f"Tool '{tool}' timed out after 30.0 seconds")
            spec.end = spec.start + 30_000 * _MS + rng.randint(0, 40) * _MS
        else:
            spec.error = ("ConnectionRefusedError", "[Errno 111] Connection refused")
        if spec.flavor == "genai":
            a["error.type"] = spec.error[0]
        spec.status_message = f"{spec.error[0]}: {spec.error[1]}"
    elif spec.role == "http":
        a.pop("http.response.body.size", None)
        if rng.random() < 0.6:
            a["http.response.status_code"] = 503
            a["error.type"] = "503"
            spec.error = None  # httpx instrumentation: no exception for a 5xx answer
        else:
            a.pop("http.response.status_code", None)
            a["error.type"] = "httpx.ReadTimeout"
            spec.error = ("httpx.ReadTimeout", "The read operation timed out")
            spec.end = spec.start + 10_000 * _MS
    else:  # pragma: no cover - roots and chains are never picked
        raise ValueError(f"cannot fail a {spec.role} span")


def _propagate(tool: _Spec, http: _Spec) -> None:
    """A tool whose HTTP call failed raises too: ERROR, but not an originating failure."""
    tool.failed = True
    url = str(http.attrs["url.full"])
    if http.error is None:
        etype = "httpx.HTTPStatusError"
        message = (
            f"Server error '503 Service Unavailable' for url '{url}'\n"
            "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/"
            "Status/503"
        )
    else:
        etype, message = http.error
    tool.error = (etype, message)
    tool.status_message = f"{etype.rsplit('.', 1)[-1]}: {message}"
    for key in ("gen_ai.tool.call.result", "output.value", "output.mime_type"):
        tool.attrs.pop(key, None)
    if tool.flavor == "genai":
        tool.attrs["error.type"] = etype
    tool.end = max(tool.end, http.end + 2 * _MS)


class _TraceBuilder:
    """Builds one trace's spans, parents first."""

    def __init__(self, rng: random.Random, start_ns: int) -> None:
        self.rng = rng
        self.trace_id = rng.randbytes(8) + TRACE_MARK
        self.clock = start_ns
        self.spans: list[_Spec] = []

    def span_id(self) -> bytes:
        return self.rng.randbytes(4) + SPAN_MARK

    def add(self, spec: _Spec, parent: _Spec | None) -> _Spec:
        self.spans.append(spec)
        if parent is not None:
            parent.children.append(spec)
        return spec

    def new(
        self,
        parent: _Spec | None,
        name: str,
        kind: int,
        role: str,
        service: str,
        scope: str,
        flavor: str,
        duration_ms: int,
        attrs: dict[str, AttrValue],
        provider: str = "",
    ) -> _Spec:
        start = self.clock + self.rng.randint(1, 8) * _MS
        spec = _Spec(
            trace_id=self.trace_id,
            span_id=self.span_id(),
            parent_id=parent.span_id if parent is not None else b"",
            name=name,
            kind=kind,
            start=start,
            end=start + duration_ms * _MS,
            role=role,
            service=service,
            scope=scope,
            attrs=attrs,
            flavor=flavor,
            provider=provider,
        )
        self.clock = start
        return self.add(spec, parent)

    def finish(self) -> list[_Spec]:
        """Stretch parents over their children, as real spans are."""
        for spec in reversed(self.spans):
            for child in spec.children:
                spec.end = max(spec.end, child.end + self.rng.randint(1, 5) * _MS)
        return self.spans


def _tool_args(tool: str, rng: random.Random) -> str:
    args: object = {
        "search_tickets": {"query": "payments 5xx", "status": "open", "limit": 20},
        "get_order": {"order_id": f"A-{rng.randint(10000, 99999)}"},
        "query_metrics": {
            "query": "histogram_quantile(0.95, sum(rate("
            'http_server_duration_bucket{service="checkout"}[5m])) by (le, region))',
            "range": "7d",
            "step": "1h",
        },
        "web_search": {"query": "speculative decoding small models survey", "max_results": 5},
        "issue_refund": {"charge_id": "ch_3Oq2", "amount": 14900, "currency": "eur"},
        "send_email": {"to": "customer@example.com", "template": "key_rotation"},
    }[tool]
    return json.dumps(args)


def _tool_schema(name: str, description: str) -> str:
    """An offered tool as OpenInference records it: the OpenAI tool definition."""
    properties = {k: {"type": "string"} for k in json.loads(_tool_args(name, random.Random(0)))}
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    function = {"name": name, "description": description, "parameters": parameters}
    return json.dumps({"type": "function", "function": function})


def _tool_result(rng: random.Random) -> str:
    return json.dumps(
        {"results": [{"id": f"R-{rng.randint(100, 999)}", "text": rng.choice(_ANSWERS)[:180]}]}
    )


def _http_child(b: _TraceBuilder, tool: _Spec, tool_name: str, service: str, flavor: str) -> _Spec:
    method, host, port, path = _TOOL_HOSTS[tool_name]
    rng = b.rng
    scheme = "https" if port == 443 else "http"
    url = f"{scheme}://{host}{'' if port == 443 else f':{port}'}{path}"
    attrs: dict[str, AttrValue] = {
        "http.request.method": method,
        "url.full": url,
        "url.scheme": scheme,
        "url.path": path,
        "server.address": host,
        "server.port": port,
        "network.protocol.name": "http",
        "network.protocol.version": "1.1",
        "network.peer.address": f"10.0.{rng.randint(0, 9)}.{rng.randint(2, 250)}",
        "user_agent.original": "python-httpx/0.27.2",
        "http.response.status_code": 200,
        "http.response.body.size": rng.randint(300, 40_000),
    }
    return b.new(
        tool,
        method,
        _SPAN_KIND_CLIENT,
        "http",
        service,
        "opentelemetry.instrumentation.httpx",
        flavor,
        rng.randint(20, 900),
        attrs,
    )


def _genai_trace(b: _TraceBuilder) -> None:
    rng = b.rng
    service = "research-agent"
    provider = "anthropic" if rng.random() < 0.3 else "openai"
    models = _ANTHROPIC_MODELS if provider == "anthropic" else _OPENAI_MODELS
    model, response_model = rng.choice(models)
    provider_key = "gen_ai.provider.name" if rng.random() < 0.5 else "gen_ai.system"
    host = "api.anthropic.com" if provider == "anthropic" else "api.openai.com"
    conversation = f"conv_{rng.randbytes(8).hex()}{SESSION_MARK.decode()}"
    llm_scope = "opentelemetry.instrumentation." + (
        "anthropic" if provider == "anthropic" else "openai_v2"
    )
    root = b.new(
        None,
        "invoke_agent research_assistant",
        _SPAN_KIND_INTERNAL,
        "agent",
        service,
        "research_agent",
        "genai",
        rng.randint(2000, 20_000),
        {
            "gen_ai.operation.name": "invoke_agent",
            provider_key: provider,
            "gen_ai.agent.name": "research_assistant",
            "gen_ai.agent.id": "asst_8Jd2kLq0",
            "gen_ai.agent.description": "Answers operational questions using internal tools.",
            "gen_ai.conversation.id": conversation,
            "gen_ai.request.model": model,
            "enduser.id": f"user-{rng.randint(1000, 9999)}",
            "session.id": conversation,
            "app.request.id": rng.randbytes(6).hex(),
        },
    )
    # Half the agents capture message content (the semconv's opt-in message attributes).
    capture = rng.random() < 0.5
    question = rng.choice(_QUESTIONS)
    steps = rng.randint(2, 5)
    for step in range(steps):
        last = step == steps - 1
        calls_tool = not last and rng.random() >= 0.3
        tool_name, description = rng.choice(_TOOLS)
        args = _tool_args(tool_name, rng)
        call_id = f"call_{rng.randbytes(12).hex()}"
        finish = ("tool_calls" if provider == "openai" else "tool_use") if calls_tool else "stop"
        if rng.random() < 0.02:
            finish = "length" if provider == "openai" else "max_tokens"
        in_tokens = rng.randint(400, 12_000)
        out_tokens = rng.randint(20, 900)
        content: dict[str, AttrValue] = {}
        if capture:
            part: dict[str, object] = {"type": "text", "content": rng.choice(_ANSWERS)}
            if calls_tool:
                part = {"type": "tool_call", "id": call_id, "name": tool_name, "arguments": args}
            content = {
                "gen_ai.input.messages": json.dumps(
                    [
                        {"role": "system", "parts": [{"type": "text", "content": _SYSTEM}]},
                        {"role": "user", "parts": [{"type": "text", "content": question}]},
                    ]
                ),
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [part], "finish_reason": finish}]
                ),
            }
        b.new(
            root,
            f"chat {model}",
            _SPAN_KIND_CLIENT,
            "llm",
            service,
            llm_scope,
            "genai",
            rng.randint(400, 8000),
            {
                "gen_ai.operation.name": "chat",
                provider_key: provider,
                "gen_ai.request.model": model,
                "gen_ai.request.temperature": 0.2,
                "gen_ai.request.max_tokens": 1024,
                "gen_ai.request.top_p": 1.0,
                "gen_ai.response.model": response_model,
                "gen_ai.response.id": (
                    f"msg_{rng.randbytes(12).hex()}"
                    if provider == "anthropic"
                    else f"chatcmpl-{rng.randbytes(14).hex()}"
                ),
                "gen_ai.response.finish_reasons": [finish],
                "gen_ai.usage.input_tokens": in_tokens,
                "gen_ai.usage.output_tokens": out_tokens,
                "gen_ai.conversation.id": conversation,
                "server.address": host,
                "server.port": 443,
                **content,
            },
            provider,
        )
        if not calls_tool:
            continue
        tool = b.new(
            root,
            f"execute_tool {tool_name}",
            _SPAN_KIND_INTERNAL,
            "tool",
            service,
            "research_agent",
            "genai",
            rng.randint(30, 2500),
            {
                "gen_ai.operation.name": "execute_tool",
                provider_key: provider,
                "gen_ai.tool.name": tool_name,
                "gen_ai.tool.description": description,
                "gen_ai.tool.type": "function",
                "gen_ai.tool.call.id": call_id,
                "gen_ai.tool.call.arguments": args,
                "gen_ai.tool.call.result": _tool_result(rng),
                "gen_ai.conversation.id": conversation,
                "code.function.name": f"tools.{tool_name}",
                "thread.id": rng.randint(1, 64),
            },
        )
        if rng.random() < 0.5:
            _http_child(b, tool, tool_name, service, "genai")


def _openinference_trace(b: _TraceBuilder) -> None:
    rng = b.rng
    service = "support-agent"
    model, _ = rng.choice(_OPENAI_MODELS)
    session = f"sess-{rng.randbytes(6).hex()}{SESSION_MARK.decode()}"
    question = rng.choice(_QUESTIONS)
    metadata = json.dumps({"tenant": f"t{rng.randint(1, 40)}", "channel": "chat", "ab": "v2"})
    lc_scope = "openinference.instrumentation.langchain"
    root = b.new(
        None,
        "support_agent",
        _SPAN_KIND_INTERNAL,
        "agent",
        service,
        lc_scope,
        "openinference",
        rng.randint(2000, 20_000),
        {
            "openinference.span.kind": "AGENT",
            "agent.name": "support_agent",
            "input.value": question,
            "input.mime_type": "text/plain",
            "output.value": rng.choice(_ANSWERS),
            "output.mime_type": "text/plain",
            "session.id": session,
            "user.id": f"user-{rng.randint(1000, 9999)}",
            "metadata": metadata,
            "tag.tags": ["support", "tier-1"],
        },
    )
    steps = rng.randint(2, 4)
    for step in range(steps):
        last = step == steps - 1
        parent = root
        if rng.random() < 0.5:
            parent = b.new(
                root,
                "plan_step",
                _SPAN_KIND_INTERNAL,
                "chain",
                service,
                lc_scope,
                "openinference",
                rng.randint(500, 9000),
                {
                    "openinference.span.kind": "CHAIN",
                    "input.value": json.dumps({"input": question, "step": step}),
                    "input.mime_type": "application/json",
                    "output.value": json.dumps({"output": rng.choice(_ANSWERS)[:200]}),
                    "output.mime_type": "application/json",
                    "session.id": session,
                    "metadata": metadata,
                    "langchain.run.id": rng.randbytes(16).hex(),
                    "langchain.run.type": "chain",
                    "tag.tags": ["plan"],
                },
            )
        prompt = rng.randint(500, 9000)
        completion = rng.randint(20, 700)
        answer = rng.choice(_ANSWERS)
        messages = [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": question},
        ]
        calls_tool = not last and rng.random() >= 0.25
        tool_name, description = rng.choice(_TOOLS)
        args = _tool_args(tool_name, rng)
        call_id = f"call_{rng.randbytes(12).hex()}"
        reply: dict[str, object] = {"role": "assistant", "content": answer}
        output: dict[str, AttrValue] = {"llm.output_messages.0.message.content": answer}
        if calls_tool:
            function = {"name": tool_name, "arguments": args}
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
            call = "llm.output_messages.0.message.tool_calls.0.tool_call."
            output = {
                call + "id": call_id,
                call + "function.name": tool_name,
                call + "function.arguments": args,
            }
        offered = {
            f"llm.tools.{i}.tool.json_schema": _tool_schema(name, text)
            for i, (name, text) in enumerate(_TOOLS)
        }
        b.new(
            parent,
            "ChatCompletion",
            _SPAN_KIND_INTERNAL,
            "llm",
            service,
            "openinference.instrumentation.openai",
            "openinference",
            rng.randint(400, 8000),
            {
                "openinference.span.kind": "LLM",
                "llm.system": "openai",
                "llm.provider": "openai",
                "llm.model_name": model,
                "llm.invocation_parameters": json.dumps({"temperature": 0.2, "max_tokens": 1024}),
                "input.value": json.dumps({"messages": messages, "model": model}),
                "input.mime_type": "application/json",
                "output.value": json.dumps(
                    {"id": f"chatcmpl-{rng.randbytes(14).hex()}", "choices": [{"message": reply}]}
                ),
                "output.mime_type": "application/json",
                "llm.token_count.prompt": prompt,
                "llm.token_count.completion": completion,
                "llm.token_count.total": prompt + completion,
                "llm.input_messages.0.message.role": "system",
                "llm.input_messages.0.message.content": _SYSTEM,
                "llm.input_messages.1.message.role": "user",
                "llm.output_messages.0.message.role": "assistant",
                **output,
                **offered,
                "session.id": session,
            },
            "openai",
        )
        if not calls_tool:
            continue
        tool = b.new(
            parent,
            tool_name,
            _SPAN_KIND_INTERNAL,
            "tool",
            service,
            lc_scope,
            "openinference",
            rng.randint(30, 2500),
            {
                "openinference.span.kind": "TOOL",
                "tool.name": tool_name,
                "tool.description": description,
                "tool.parameters": json.dumps(
                    {
                        "type": "object",
                        "properties": {k: {"type": "string"} for k in json.loads(args)},
                    }
                ),
                "input.value": args,
                "input.mime_type": "application/json",
                "output.value": _tool_result(rng),
                "output.mime_type": "application/json",
                "tool_call.id": call_id,
                "tool_call.function.name": tool_name,
                "session.id": session,
                "metadata": metadata,
            },
        )
        if rng.random() < 0.5:
            _http_child(b, tool, tool_name, service, "openinference")


def _set_value(target: AnyValue, value: AttrValue) -> None:
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    else:
        for item in value:
            target.array_value.values.add().string_value = item


def _add_attrs(out: Iterable[KeyValue], attrs: dict[str, AttrValue]) -> None:
    for key, value in attrs.items():
        kv = out.add()  # type: ignore[attr-defined]
        kv.key = key
        _set_value(kv.value, value)


def _encode_span(spec: _Spec, out: Span) -> None:
    out.trace_id = spec.trace_id
    out.span_id = spec.span_id
    if spec.parent_id:
        out.parent_span_id = spec.parent_id
    out.name = spec.name
    out.kind = spec.kind  # type: ignore[assignment]
    out.start_time_unix_nano = spec.start
    out.end_time_unix_nano = spec.end
    out.flags = 0x101  # sampled; parent known to be local (has-is-remote set, is-remote clear)
    _add_attrs(out.attributes, spec.attrs)
    if spec.failed:
        out.status.code = Status.StatusCode.STATUS_CODE_ERROR
        out.status.message = spec.status_message
        if spec.error is not None:
            etype, message = spec.error
            event = out.events.add()
            event.name = "exception"
            event.time_unix_nano = spec.end - 1000
            lib = (
                "openai/_base_client.py"
                if etype.startswith("openai.")
                else "httpx/_transports/default.py"
            )
            _add_attrs(
                event.attributes,
                {
                    "exception.type": etype,
                    "exception.message": message,
                    "exception.stacktrace": _stacktrace(etype, message, spec.name, lib),
                    "exception.escaped": "False",
                },
            )
    elif spec.role in ("llm", "tool", "http") or spec.kind == _SPAN_KIND_CLIENT:
        out.status.code = Status.StatusCode.STATUS_CODE_UNSET
    else:
        out.status.code = Status.StatusCode.STATUS_CODE_OK


def _encode_request(specs: Sequence[_Spec]) -> bytes:
    request = ExportTraceServiceRequest()
    groups: dict[str, dict[str, list[_Spec]]] = {}
    for spec in sorted(specs, key=lambda s: s.end):
        groups.setdefault(spec.service, {}).setdefault(spec.scope, []).append(spec)
    for service, scopes in groups.items():
        rs: ResourceSpans = request.resource_spans.add()
        _add_attrs(rs.resource.attributes, _RESOURCES[service])
        rs.schema_url = "https://opentelemetry.io/schemas/1.27.0"
        for scope, members in scopes.items():
            ss = rs.scope_spans.add()
            ss.scope.name = scope
            ss.scope.version = _SCOPE_VERSIONS[scope]
            for spec in members:
                _encode_span(spec, ss.spans.add())
    return request.SerializeToString()


def _request_specs(rng: random.Random, n_spans: int, start_ns: int) -> list[_Spec]:
    """Whole traces until ``n_spans``; the last one is cut after a parent-first prefix."""
    specs: list[_Spec] = []
    clock = start_ns
    flip = rng.random() < 0.5
    while len(specs) < n_spans:
        builder = _TraceBuilder(rng, clock)
        (_genai_trace if flip else _openinference_trace)(builder)
        flip = not flip
        trace = builder.finish()[: n_spans - len(specs)]
        kept = {s.span_id for s in trace}
        for spec in trace:
            spec.children = [c for c in spec.children if c.span_id in kept]
        specs.extend(trace)
        clock += rng.randint(5, 400) * _MS
    return specs


def _inject_failures(specs: list[_Spec], k: int, rng: random.Random) -> None:
    """Make exactly ``k`` originating failures (fewer only if too few spans can fail)."""
    eligible = [
        s for s in specs if s.role in ("llm", "http") or (s.role == "tool" and not s.children)
    ]
    by_id = {s.span_id: s for s in specs}
    for spec in rng.sample(eligible, min(k, len(eligible))):
        _fail(spec, rng)
        if spec.role == "http":
            parent = by_id.get(spec.parent_id)
            if parent is not None and parent.role == "tool":
                _propagate(parent, spec)


def make_requests(
    n_requests: int,
    spans_per_request: int,
    failure_rate: float = 0.05,
    seed: int = 1,
    start_ns: int | None = None,
) -> list[bytes]:
    """Pre-encoded ``ExportTraceServiceRequest`` payloads of ``spans_per_request`` spans each.

    Over all requests there are exactly ``round(failure_rate * n_requests *
    spans_per_request)`` originating failures (spread evenly). Timestamps start
    a minute before ``start_ns`` (default: now).
    """
    if n_requests < 0 or spans_per_request < 1:
        raise ValueError("n_requests must be >= 0 and spans_per_request >= 1")
    if not 0.0 <= failure_rate <= 1.0:
        raise ValueError("failure_rate must be between 0 and 1")
    rng = random.Random(seed)
    clock = (time.time_ns() if start_ns is None else start_ns) - 60_000 * _MS
    payloads: list[bytes] = []
    failures_so_far = 0
    for i in range(n_requests):
        specs = _request_specs(rng, spans_per_request, clock)
        target = round(failure_rate * (i + 1) * spans_per_request)
        _inject_failures(specs, target - failures_so_far, rng)
        failures_so_far = target
        payloads.append(_encode_request(specs))
        clock += rng.randint(50, 500) * _MS
    return payloads


def with_fresh_ids(payload: bytes, index: int) -> bytes:
    """The same payload with every trace, span and session id made distinct for ``index``.

    Copies with different ``index`` share no trace id, span id or session with
    each other or with the original: each copy's traces are new runs, as in
    production, not more turns of the same conversations (which would repeat
    the same tool calls in them, and look like loops). Sizes and everything
    else are unchanged.
    """
    if not 0 <= index <= MAX_FRESH_INDEX:
        raise ValueError(f"index must be between 0 and {MAX_FRESH_INDEX}")
    trace_suffix = b"\x01" + index.to_bytes(7, "big")
    span_suffix = (index + 1).to_bytes(4, "big")
    session_suffix = f"~copy-{index:08x}".encode()
    return (
        payload.replace(TRACE_MARK, trace_suffix)
        .replace(SPAN_MARK, span_suffix)
        .replace(SESSION_MARK, session_suffix)
    )


def span_count(payload: bytes) -> int:
    """Spans in one encoded request."""
    request = ExportTraceServiceRequest.FromString(payload)
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _hex_ids(node: object) -> None:
    """OTLP/JSON spells ids in hex, where protobuf's JSON mapping uses base64."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)


def to_json_lines(payloads: Iterable[bytes]) -> str:
    """OTLP/JSON, one request per line: the OTel Collector file exporter's format."""
    lines = []
    for payload in payloads:
        as_dict = MessageToDict(
            ExportTraceServiceRequest.FromString(payload), use_integers_for_enums=True
        )
        _hex_ids(as_dict)
        lines.append(json.dumps(as_dict, separators=(",", ":")))
    return "".join(line + "\n" for line in lines)
