"""The fake provider answers the real openai and anthropic SDKs as the real services do.

Each fault must surface as the exception the SDK raises in production, with
the provider's own error code, so the spans other tests normalize are real.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from supervisor.testing import FakeProvider, FaultPlan, Reply, ToolCall

MODEL = "gpt-4o-mini"
CLAUDE = "claude-haiku-4-5"
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture
def provider(server: FakeProvider) -> Iterator[FakeProvider]:
    server.reset()
    yield server
    assert server.pending == 0, "a test left scripted replies unconsumed"


@pytest.fixture
def oai(provider: FakeProvider) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=provider.base_url, api_key="sk-fake", max_retries=0, timeout=5.0
    ) as client:
        yield client


@pytest.fixture
def claude(provider: FakeProvider) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=provider.url, api_key="sk-ant-fake", max_retries=0, timeout=5.0
    ) as client:
        yield client


# -- OpenAI ------------------------------------------------------------------


def test_openai_text_reply_carries_content_usage_and_model(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.text("Sunny, 21C.", usage=(12, 4)))
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert (
        reply.choices[0].message.content,
        reply.choices[0].finish_reason,
        reply.model,
    ) == ("Sunny, 21C.", "stop", MODEL)
    assert reply.usage is not None
    assert (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
        reply.usage.total_tokens,
    ) == (12, 4, 16)
    [request] = provider.requests
    assert (
        request.method,
        request.path,
        request.body["model"],
    ) == ("POST", "/v1/chat/completions", MODEL)


def test_openai_default_reply_answers_when_the_script_is_empty(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content == "Hello from the fake provider."


def test_openai_tool_call_reply(provider: FakeProvider, oai: openai.OpenAI) -> None:
    provider.script(Reply.tool_call("get_weather", {"city": "Paris"}))
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    calls = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [
        (c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
        for c in calls
    ] == [("get_weather", {"city": "Paris"})]


def test_openai_stream_yields_chunks_and_a_final_usage_chunk(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.text("A fairly long streamed answer.", usage=(9, 7)))
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks if c.usage]
    assert (text, finish, usage) == ("A fairly long streamed answer.", ["stop"], [(9, 7)])


def test_openai_stream_without_include_usage_has_no_usage_chunk(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.text("short"))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert [c for c in chunks if c.usage] == []


def test_openai_stream_carries_tool_call_arguments_in_pieces(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.tool_call("get_weather", {"city": "Paris", "unit": "celsius"}))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    name = "".join(d.function.name or "" for d in deltas if d.function)
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert (name, json.loads(args)) == ("get_weather", {"city": "Paris", "unit": "celsius"})


def test_openai_models_endpoint_lists_models(oai: openai.OpenAI) -> None:
    assert MODEL in [m.id for m in oai.models.list()]


@pytest.mark.parametrize(
    ("reply", "exc_type", "status", "code"),
    [
        (Reply.rate_limited(retry_after_s=1.5), openai.RateLimitError, 429, "rate_limit_exceeded"),
        (Reply.quota_exhausted(), openai.RateLimitError, 429, "insufficient_quota"),
        (Reply.context_length_exceeded(), openai.BadRequestError, 400, "context_length_exceeded"),
        (Reply.unauthorized(), openai.AuthenticationError, 401, "invalid_api_key"),
        (
            Reply.permission_denied(),
            openai.PermissionDeniedError,
            403,
            "unsupported_country_region_territory",
        ),
        (Reply.not_found(), openai.NotFoundError, 404, "model_not_found"),
        (Reply.content_filtered(), openai.BadRequestError, 400, "content_policy_violation"),
        (Reply.content_filtered(azure=True), openai.BadRequestError, 400, "content_filter"),
        (Reply.server_error(503), openai.InternalServerError, 503, None),
        (Reply.server_error(500), openai.InternalServerError, 500, None),
        (Reply.overloaded(), openai.InternalServerError, 529, None),
    ],
)
def test_openai_faults_raise_the_sdk_exception_with_the_provider_code(
    provider: FakeProvider,
    oai: openai.OpenAI,
    reply: Reply,
    exc_type: type[openai.APIStatusError],
    status: int,
    code: str | None,
) -> None:
    provider.script(reply)
    with pytest.raises(exc_type) as caught:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert (status, code) == (caught.value.status_code, caught.value.code)
    assert str(caught.value).startswith(f"Error code: {status} - ")


def test_openai_rate_limit_carries_retry_headers(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.rate_limited(retry_after_s=1.5))
    with pytest.raises(openai.RateLimitError) as caught:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    headers = caught.value.response.headers
    assert (
        headers["retry-after"],
        headers["retry-after-ms"],
        headers["x-ratelimit-reset-requests"],
    ) == ("1.5", "1500", "1.5s")
    assert "Please try again in 1.5s." in caught.value.message


def test_openai_sdk_honours_retry_after_and_succeeds_on_retry(provider: FakeProvider) -> None:
    provider.script(Reply.rate_limited(retry_after_s=0.01), Reply.text("after retry"))
    with openai.OpenAI(base_url=provider.base_url, api_key="sk-fake", max_retries=1) as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert (reply.choices[0].message.content, len(provider.requests)) == ("after retry", 2)


def test_openai_delay_beyond_the_client_timeout_raises_api_timeout(
    provider: FakeProvider,
) -> None:
    provider.script(Reply.timeout(delay_s=10))
    with (
        openai.OpenAI(
            base_url=provider.base_url, api_key="sk-fake", max_retries=0, timeout=0.2
        ) as client,
        pytest.raises(openai.APITimeoutError),
    ):
        client.chat.completions.create(model=MODEL, messages=MESSAGES)


def test_openai_dropped_connection_raises_api_connection_error(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    provider.script(Reply.connection_dropped())
    with pytest.raises(openai.APIConnectionError) as caught:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert not isinstance(caught.value, openai.APITimeoutError)


# -- Anthropic ---------------------------------------------------------------


def test_anthropic_text_reply(provider: FakeProvider, claude: anthropic.Anthropic) -> None:
    provider.script(Reply.text("Bonjour.", usage=(11, 2)))
    message = claude.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
    block = message.content[0]
    assert (
        block.type,
        getattr(block, "text", None),
        message.stop_reason,
        message.usage.input_tokens,
        message.usage.output_tokens,
        message.model,
    ) == ("text", "Bonjour.", "end_turn", 11, 2, CLAUDE)
    assert provider.requests[0].path == "/v1/messages"


def test_anthropic_tool_use_and_finish_reason_mapping(
    provider: FakeProvider, claude: anthropic.Anthropic
) -> None:
    provider.script(
        Reply.tool_call("get_weather", {"city": "Paris"}, content="Let me check."),
        Reply.truncated("cut sho"),
    )
    message = claude.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert (message.stop_reason, uses) == ("tool_use", [("get_weather", {"city": "Paris"})])
    truncated = claude.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
    assert truncated.stop_reason == "max_tokens"


def test_anthropic_stream_assembles_text_and_tool_use(
    provider: FakeProvider, claude: anthropic.Anthropic
) -> None:
    provider.script(
        Reply(
            content="Checking the weather now.",
            tool_calls=(ToolCall("get_weather", '{"city": "Paris"}'),),
            finish_reason="tool_calls",
            usage=(5, 9),
        )
    )
    with claude.messages.stream(model=CLAUDE, max_tokens=64, messages=MESSAGES) as stream:
        message = stream.get_final_message()
    texts = [b.text for b in message.content if b.type == "text"]
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert (
        texts,
        uses,
        message.stop_reason,
        message.usage.output_tokens,
    ) == (["Checking the weather now."], [("get_weather", {"city": "Paris"})], "tool_use", 9)


@pytest.mark.parametrize(
    ("reply", "exc_type", "status", "error_type"),
    [
        (Reply.overloaded(), anthropic.OverloadedError, 529, "overloaded_error"),
        (Reply.rate_limited(), anthropic.RateLimitError, 429, "rate_limit_error"),
        (Reply.unauthorized(), anthropic.AuthenticationError, 401, "authentication_error"),
        (Reply.permission_denied(), anthropic.PermissionDeniedError, 403, "permission_error"),
        (Reply.not_found(CLAUDE), anthropic.NotFoundError, 404, "not_found_error"),
        (Reply.context_length_exceeded(), anthropic.BadRequestError, 400, "invalid_request_error"),
        (Reply.server_error(500), anthropic.InternalServerError, 500, "api_error"),
        # SDK 0.x raises ServiceUnavailableError for a 503, 1.x InternalServerError.
        (
            Reply.server_error(503),
            (anthropic.ServiceUnavailableError, anthropic.InternalServerError),
            503,
            "api_error",
        ),
    ],
)
def test_anthropic_faults_raise_the_sdk_exception_with_the_error_type(
    provider: FakeProvider,
    claude: anthropic.Anthropic,
    reply: Reply,
    exc_type: type[anthropic.APIStatusError] | tuple[type[anthropic.APIStatusError], ...],
    status: int,
    error_type: str,
) -> None:
    provider.script(reply)
    with pytest.raises(exc_type) as caught:
        claude.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
    body = caught.value.body
    assert isinstance(body, dict)
    assert (status, "error", error_type) == (
        caught.value.status_code,
        body["type"],
        body["error"]["type"],
    )
    # The message the classifier reads: the body (anthropic < 2.17), or the status and a
    # trailer naming the error's type (from 2.17).
    message = str(caught.value)
    assert message.startswith(f"Error code: {status} - {{'type': 'error', 'error': ") or (
        message.startswith(f"{status} ") and message.endswith(f", type: {error_type})")
    ), message


def test_anthropic_timeout_and_dropped_connection(provider: FakeProvider) -> None:
    provider.script(Reply.timeout(delay_s=10), Reply.connection_dropped())
    with anthropic.Anthropic(
        base_url=provider.url, api_key="sk-ant-fake", max_retries=0, timeout=0.2
    ) as client:
        with pytest.raises(anthropic.APITimeoutError):
            client.messages.create(model=CLAUDE, max_tokens=8, messages=MESSAGES)
        with pytest.raises(anthropic.APIConnectionError) as caught:
            client.messages.create(model=CLAUDE, max_tokens=8, messages=MESSAGES)
    assert not isinstance(caught.value, anthropic.APITimeoutError)


# -- scripting, fault plan, bounds -------------------------------------------


def _statuses(provider: FakeProvider, count: int) -> list[int]:
    with httpx.Client(base_url=provider.base_url, timeout=5.0) as client:
        return [
            client.post(
                "/chat/completions", json={"model": MODEL, "messages": MESSAGES}
            ).status_code
            for _ in range(count)
        ]


def test_fault_plan_is_reproducible_for_a_seed() -> None:
    plan = FaultPlan(rate=0.3, seed=7)
    with FakeProvider(fault_plan=plan) as first, FakeProvider(fault_plan=plan) as second:
        a, b = _statuses(first, 40), _statuses(second, 40)
    assert a == b
    assert 0 < sum(1 for s in a if s != 200) < 40


@pytest.mark.parametrize(("rate", "expected"), [(0.0, {200}), (1.0, {503})])
def test_fault_plan_rate_bounds(rate: float, expected: set[int]) -> None:
    plan = FaultPlan(rate=rate, seed=1, faults=(Reply.server_error(503),))
    with FakeProvider(fault_plan=plan) as provider:
        assert expected == set(_statuses(provider, 10))


def test_script_wins_over_the_fault_plan() -> None:
    plan = FaultPlan(rate=1.0, seed=1, faults=(Reply.server_error(503),))
    with FakeProvider(fault_plan=plan) as provider:
        provider.script(Reply.text("scripted"))
        assert _statuses(provider, 2) == [200, 503]


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_fault_plan_rejects_rates_outside_zero_one(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be within"):
        FaultPlan(rate=rate)


def test_script_and_request_log_are_bounded() -> None:
    with FakeProvider(max_script=2, max_requests=2) as provider:
        provider.script(Reply.text("a"), Reply.text("b"))
        with pytest.raises(ValueError, match="bounded to 2"):
            provider.script(Reply.text("c"))
        _statuses(provider, 3)
        assert (len(provider.requests), provider.requests_dropped) == (2, 1)


def test_unknown_paths_get_404(provider: FakeProvider) -> None:
    with httpx.Client(base_url=provider.url, timeout=5.0) as client:
        assert (
            client.post("/v1/nope", json={}).status_code,
            client.get("/v1/nope").status_code,
        ) == (404, 404)


def test_stop_is_idempotent_and_start_rebinds() -> None:
    provider = FakeProvider()
    provider.start()
    first_port = provider.port
    provider.stop()
    provider.stop()
    with pytest.raises(RuntimeError, match="not started"):
        _ = provider.port
    provider.start()
    try:
        assert provider.port > 0
        assert provider.base_url.endswith("/v1")
    finally:
        provider.stop()
    assert first_port > 0


@pytest.mark.parametrize(("length", "status"), [("999999999", 413), ("-5", 400), ("lots", 400)])
def test_bad_or_oversized_content_length_is_refused_without_reading(
    provider: FakeProvider, length: str, status: int
) -> None:
    with socket.create_connection(("127.0.0.1", provider.port), timeout=5.0) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
        sock.sendall(head.encode() + b"\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.split(b" ", 2)[1] == str(status).encode()
    assert provider.requests == []


def test_large_request_bodies_are_logged_by_size_only(
    provider: FakeProvider, oai: openai.OpenAI
) -> None:
    big: Any = [{"role": "user", "content": "x" * 300_000}]
    oai.chat.completions.create(model=MODEL, messages=big)
    [request] = provider.requests
    assert (request.body, request.size > 300_000) == (None, True)
