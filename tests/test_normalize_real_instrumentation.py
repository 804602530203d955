"""Normalization of spans written by the real instrumentations, around the real SDKs.

Each instrumentation gets its own TracerProvider and in-memory exporter; the
real ``openai`` / ``anthropic`` client talks to :class:`FakeProvider`; the
captured spans go through the OTLP encoder and :func:`normalize_request`,
exactly as they would reach the sidecar.

What each instrumentation actually writes (openai 3.57, anthropic 2.14):

* ``openinference-instrumentation-openai`` 0.1.66: span ``ChatCompletion``
  (INTERNAL), ``openinference.span.kind=LLM``, ``llm.system=openai``,
  ``llm.model_name``, ``llm.token_count.prompt/completion/total``,
  ``llm.finish_reason``, ``llm.output_messages.0.message.content`` /
  ``...tool_calls.M.tool_call.function.name/arguments``,
  ``llm.tools.N.tool.json_schema``, ``input.value``/``output.value``. On
  failure: status ERROR ``"RateLimitError: Error code: 429 - <message>"``, an
  ``exception`` event (``openai.RateLimitError``), no model but
  ``llm.invocation_parameters='{"model": ...}'``.
* ``opentelemetry-instrumentation-openai-v2`` 2.4b0 (with util-genai 1.1b0):
  span ``chat gpt-4o-mini`` (CLIENT), ``gen_ai.operation.name``,
  ``gen_ai.provider.name``, ``gen_ai.request/response.model``,
  ``gen_ai.usage.input/output_tokens``, ``gen_ai.response.finish_reasons``;
  messages as ``gen_ai.input/output.messages`` JSON only with
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY``; no tool
  definitions. On failure: status ERROR with the bare SDK message,
  ``error.type="<class 'openai.RateLimitError'>"``, no exception event.
* ``opentelemetry-instrumentation-openai`` (OpenLLMetry) 0.62.4: span
  ``openai.chat`` (CLIENT) with the GenAI names too, plus
  ``gen_ai.tool.definitions`` and finish reason ``tool_call`` (singular). On
  failure: status ERROR with the bare message, ``error.type=RateLimitError``
  and an ``exception`` event.
* ``openinference-instrumentation-anthropic`` 3.1: span ``messages.create``,
  ``llm.provider=anthropic``, ``llm.request/response.model_name``, text in
  ``llm.output_messages.0.message.contents.K.message_content.text``,
  ``llm.finish_reason`` (``end_turn``/``max_tokens``/``tool_use``). Failures:
  status ERROR with the SDK message, which carries the whole error body
  (``Error code: 529 - {'type': 'error', 'error': {'type': 'overloaded_error', ...}}``).

openai-python >= 2 keeps only the body's message in the exception text, so
the OpenAI provider codes below come from the providers' documented wording.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from pydantic.warnings import PydanticDeprecatedSince20

from supervisor.normalize import normalize_request
from supervisor.records import ErrorEvidence, Role, SpanRecord
from supervisor.testing import FakeProvider, Reply
from tests.screening import assert_early_reads_agree

MODEL = "gpt-4o-mini"
CLAUDE = "claude-haiku-4-5"
SERVICE = "weather-agent"
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
OPENAI_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ANTHROPIC_TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def _tracer_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _records(exporter: InMemorySpanExporter) -> list[SpanRecord]:
    spans = exporter.get_finished_spans()
    exporter.clear()
    request = encode_spans(spans)
    assert_early_reads_agree(request.SerializeToString())  # the pipeline would judge each failure
    return normalize_request(request)


@contextlib.contextmanager
def _instrumented(name: str) -> Iterator[InMemorySpanExporter]:
    """Instrument openai with one instrumentation; always uninstrument (they are singletons)."""
    tracer_provider, exporter = _tracer_provider()
    with pytest.MonkeyPatch.context() as patch:
        instrumentor: Any
        if name == "openinference":
            from openinference.instrumentation.openai import OpenAIInstrumentor

            instrumentor = OpenAIInstrumentor()
        elif name == "openai_v2":
            from opentelemetry.instrumentation.openai_v2 import (
                OpenAIInstrumentor as OpenAIV2Instrumentor,
            )

            # Message content goes on the span only when asked for.
            patch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
            instrumentor = OpenAIV2Instrumentor()  # type: ignore[no-untyped-call]
        else:
            from opentelemetry.instrumentation.openai import (
                OpenAIInstrumentor as TraceloopInstrumentor,
            )

            instrumentor = TraceloopInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()  # left instrumented elsewhere: start clean
        with warnings.catch_warnings():
            # OpenLLMetry 0.62 imports a module with a pydantic v1-style Config class.
            warnings.simplefilter("ignore", PydanticDeprecatedSince20)
            instrumentor.instrument(tracer_provider=tracer_provider)
        try:
            yield exporter
        finally:
            instrumentor.uninstrument()
            tracer_provider.shutdown()


@dataclass
class Captured:
    """The record of each scenario, for one instrumentation."""

    name: str
    records: dict[str, SpanRecord] = field(default_factory=dict)

    def llm(self, scenario: str) -> SpanRecord:
        return self.records[scenario]

    def error(self, scenario: str) -> ErrorEvidence:
        evidence = self.records[scenario].error
        assert evidence is not None, f"{self.name}/{scenario}: no error evidence"
        return evidence


#: scenario → (scripted reply, create() keyword arguments, client timeout)
OPENAI_SCENARIOS: dict[str, tuple[Reply, dict[str, Any], float]] = {
    "ok": (Reply.text("Paris is sunny, 21C.", usage=(12, 6)), {}, 5.0),
    "stream": (
        Reply.text("Streamed: sunny.", usage=(9, 4)),
        {"stream": True, "stream_options": {"include_usage": True}},
        5.0,
    ),
    "unknown_tool": (
        Reply.tool_call("get_wether", {"city": "Paris"}),
        {"tools": OPENAI_TOOLS},
        5.0,
    ),
    "bad_arguments": (Reply.tool_call("get_weather", "{city: Paris"), {"tools": OPENAI_TOOLS}, 5.0),
    "good_tool": (Reply.tool_call("get_weather", {"city": "Paris"}), {"tools": OPENAI_TOOLS}, 5.0),
    "length": (Reply.truncated("Paris is sunny and the"), {}, 5.0),
    "rate_limit": (Reply.rate_limited(retry_after_s=1.5), {}, 5.0),
    "quota": (Reply.quota_exhausted(), {}, 5.0),
    "auth": (Reply.unauthorized(), {}, 5.0),
    "not_found": (Reply.not_found(), {}, 5.0),
    "context": (Reply.context_length_exceeded(), {}, 5.0),
    "unavailable": (Reply.server_error(503), {}, 5.0),
    "timeout": (Reply.timeout(delay_s=10), {}, 0.2),
    "connection": (Reply.connection_dropped(), {}, 5.0),
    "stream_broken": (
        Reply.stream_broken("Paris is sunny today, with a light breeze."),
        {"stream": True, "stream_options": {"include_usage": True}},
        5.0,
    ),
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture(scope="module", params=["openinference", "openai_v2", "openllmetry"])
def captured(request: pytest.FixtureRequest, fake: FakeProvider) -> Captured:
    result = Captured(request.param)
    clients: dict[float, openai.OpenAI] = {}
    with _instrumented(request.param) as exporter, contextlib.ExitStack() as stack:
        for scenario, (reply, kwargs, timeout) in OPENAI_SCENARIOS.items():
            if timeout not in clients:
                clients[timeout] = stack.enter_context(
                    openai.OpenAI(
                        base_url=fake.base_url, api_key="sk-fake", max_retries=0, timeout=timeout
                    )
                )
            fake.script(reply)
            with contextlib.suppress(openai.OpenAIError):
                response = clients[timeout].chat.completions.create(
                    model=MODEL, messages=MESSAGES, **kwargs
                )
                if kwargs.get("stream"):
                    for _ in response:
                        pass
            [record] = [r for r in _records(exporter) if r.role is Role.LLM]
            result.records[scenario] = record
    assert fake.pending == 0
    return result


# -- successes ---------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["ok", "stream"])
def test_success_is_an_llm_call_with_dependency_tokens_and_text(
    captured: Captured, scenario: str
) -> None:
    record = captured.llm(scenario)
    expected_tokens = (12, 6) if scenario == "ok" else (9, 4)
    expected_text = "Paris is sunny, 21C." if scenario == "ok" else "Streamed: sunny."
    assert (
        record.role,
        record.dependency,
        record.provider,
        record.model,
        record.service,
    ) == (Role.LLM, "openai:gpt-4o-mini", "openai", MODEL, SERVICE)
    assert (expected_tokens, expected_text, None) == (
        (record.input_tokens, record.output_tokens),
        record.output_text,
        record.error,
    )
    assert len(record.trace_id) == 32
    assert len(record.span_id) == 16


def test_conventions_are_named(captured: Captured) -> None:
    expected = {
        "openinference": ("openinference",),
        "openai_v2": ("gen_ai",),
        "openllmetry": ("gen_ai",),
    }
    assert expected[captured.name] == captured.llm("ok").conventions


def test_a_valid_tool_call_is_not_a_failure(captured: Captured) -> None:
    assert None is captured.llm("good_tool").error


def test_tool_call_to_an_unoffered_tool_is_invalid(captured: Captured) -> None:
    # openai-v2 records no tool definitions, so what was offered is unknown there.
    expected = () if captured.name == "openai_v2" else ("unknown_tool:get_wether",)
    record = captured.llm("unknown_tool")
    actual = record.error.invalid_tool_calls if record.error is not None else ()
    assert expected == actual


def test_tool_call_with_arguments_that_are_not_json_is_invalid(captured: Captured) -> None:
    assert captured.error("bad_arguments").invalid_tool_calls == ("bad_arguments:get_weather",)


def test_finish_reason_length_is_evidence(captured: Captured) -> None:
    record = captured.llm("length")
    assert (
        captured.error("length").finish_reasons,
        captured.error("length").status_error,
        record.output_text,
    ) == (("length",), False, "Paris is sunny and the")


# -- faults ------------------------------------------------------------------

#: scenario → (http_status, provider_code, exception_type, retry_after_s)
FAULTS: dict[str, tuple[int | None, str, str, float | None]] = {
    "rate_limit": (429, "rate_limit_exceeded", "openai.RateLimitError", 1.5),
    "quota": (429, "insufficient_quota", "openai.RateLimitError", None),
    "auth": (401, "invalid_api_key", "openai.AuthenticationError", None),
    "not_found": (404, "model_not_found", "openai.NotFoundError", None),
    "context": (400, "context_length_exceeded", "openai.BadRequestError", None),
    "unavailable": (503, "", "openai.InternalServerError", None),
    "timeout": (None, "", "openai.APITimeoutError", None),
    "connection": (None, "", "openai.APIConnectionError", None),
}


@pytest.mark.parametrize("scenario", list(FAULTS))
def test_fault_evidence(captured: Captured, scenario: str) -> None:
    record = captured.llm(scenario)
    evidence = captured.error(scenario)
    assert FAULTS[scenario] == (
        evidence.http_status,
        evidence.provider_code,
        evidence.exception_type,
        evidence.retry_after_s,
    )
    assert (
        evidence.status_error,
        record.dependency,
        record.role,
    ) == (True, "openai:gpt-4o-mini", Role.LLM)
    assert evidence.text()
    assert not evidence.stream_began  # no answer had begun: a fallback may be taken


def test_a_stream_that_broke_after_its_first_chunk_says_the_stream_began(
    captured: Captured,
) -> None:
    """OpenInference records a first-token event, OTel GenAI the chunks and finish reason error.

    OpenLLMetry 0.62 ends the span of a broken stream without an error: no failure to judge.
    """
    record = captured.llm("stream_broken")
    if captured.name == "openllmetry":
        assert record.error is None
        return
    evidence = captured.error("stream_broken")
    assert evidence.stream_began
    assert record.output_text.startswith("Paris")


def test_a_streamed_answer_that_failed_on_its_finish_reason_alone_is_not_a_broken_stream(
    captured: Captured,
) -> None:
    evidence = captured.records["length"].error
    assert evidence is not None and not evidence.stream_began


# -- anthropic ---------------------------------------------------------------

ANTHROPIC_SCENARIOS: dict[str, tuple[Reply, dict[str, Any], float]] = {
    "ok": (Reply.text("Il fait beau.", usage=(8, 5)), {}, 5.0),
    "unknown_tool": (
        Reply.tool_call("get_wether", {"city": "Paris"}),
        {"tools": ANTHROPIC_TOOLS},
        5.0,
    ),
    "max_tokens": (Reply.truncated("Il fait"), {}, 5.0),
    "overloaded": (Reply.overloaded(), {}, 5.0),
    "rate_limit": (Reply.rate_limited(), {}, 5.0),
    "auth": (Reply.unauthorized(), {}, 5.0),
    "timeout": (Reply.timeout(delay_s=10), {}, 0.2),
}


@pytest.fixture(scope="module")
def anthropic_records(fake: FakeProvider) -> dict[str, SpanRecord]:
    from openinference.instrumentation.anthropic import AnthropicInstrumentor

    tracer_provider, exporter = _tracer_provider()
    instrumentor = AnthropicInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=tracer_provider)
    out: dict[str, SpanRecord] = {}
    try:
        for scenario, (reply, kwargs, timeout) in ANTHROPIC_SCENARIOS.items():
            fake.script(reply)
            with (
                anthropic.Anthropic(
                    base_url=fake.url, api_key="sk-ant-fake", max_retries=0, timeout=timeout
                ) as client,
                contextlib.suppress(anthropic.AnthropicError),
            ):
                client.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES, **kwargs)
            [record] = [r for r in _records(exporter) if r.role is Role.LLM]
            out[scenario] = record
    finally:
        instrumentor.uninstrument()
        tracer_provider.shutdown()
    return out


def test_anthropic_success(anthropic_records: dict[str, SpanRecord]) -> None:
    record = anthropic_records["ok"]
    assert (
        record.dependency,
        (record.input_tokens, record.output_tokens),
        record.output_text,
        record.error,
    ) == ("anthropic:" + CLAUDE, (8, 5), "Il fait beau.", None)


def test_anthropic_unknown_tool_and_max_tokens(anthropic_records: dict[str, SpanRecord]) -> None:
    unknown = anthropic_records["unknown_tool"].error
    truncated = anthropic_records["max_tokens"].error
    assert unknown is not None
    assert truncated is not None
    assert (
        unknown.invalid_tool_calls,
        truncated.finish_reasons,
    ) == (("unknown_tool:get_wether",), ("max_tokens",))


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("overloaded", (529, "overloaded_error", "anthropic.OverloadedError")),
        ("rate_limit", (429, "rate_limit_error", "anthropic.RateLimitError")),
        ("auth", (401, "authentication_error", "anthropic.AuthenticationError")),
        ("timeout", (None, "", "anthropic.APITimeoutError")),
    ],
)
def test_anthropic_fault_evidence(
    anthropic_records: dict[str, SpanRecord],
    scenario: str,
    expected: tuple[int | None, str, str],
) -> None:
    record = anthropic_records[scenario]
    evidence = record.error
    assert evidence is not None
    assert expected == (evidence.http_status, evidence.provider_code, evidence.exception_type)
    assert (record.dependency, evidence.status_error) == ("anthropic:" + CLAUDE, True)


def test_anthropic_exception_recorded_by_hand_on_a_genai_span(fake: FakeProvider) -> None:
    """No instrumentation: the agent wraps the call itself and the SDK records the exception."""
    tracer_provider, exporter = _tracer_provider()
    tracer = tracer_provider.get_tracer("agent")
    fake.script(Reply.overloaded(retry_after_s=3))
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": CLAUDE,
    }
    with (
        anthropic.Anthropic(base_url=fake.url, api_key="sk-ant-fake", max_retries=0) as client,
        contextlib.suppress(anthropic.OverloadedError),
        tracer.start_as_current_span(f"chat {CLAUDE}", attributes=attributes),
    ):
        client.messages.create(model=CLAUDE, max_tokens=64, messages=MESSAGES)
    [record] = _records(exporter)
    tracer_provider.shutdown()
    evidence = record.error
    assert evidence is not None
    assert (
        evidence.http_status,
        evidence.provider_code,
        evidence.exception_type,
        evidence.status_error,
    ) == (529, "overloaded_error", "anthropic.OverloadedError", True)
    assert (record.dependency, record.role) == ("anthropic:" + CLAUDE, Role.LLM)


# -- tool spans made by hand -------------------------------------------------


def _tool_record(
    attributes: dict[str, Any], *, raise_exc: BaseException | None = None, name: str = "tool"
) -> SpanRecord:
    tracer_provider, exporter = _tracer_provider()
    tracer = tracer_provider.get_tracer("agent")
    with contextlib.suppress(Exception), tracer.start_as_current_span(name, attributes=attributes):
        if raise_exc is not None:
            raise raise_exc
    [record] = _records(exporter)
    tracer_provider.shutdown()
    return record


def test_openinference_tool_span() -> None:
    record = _tool_record(
        {
            "openinference.span.kind": "TOOL",
            "tool.name": "get_weather",
            "input.value": '{"city": "Paris"}',
            "input.mime_type": "application/json",
            "output.value": "Sunny, 21C",
            "session.id": "session-42",
        }
    )
    canonical = _tool_record(
        {
            "openinference.span.kind": "TOOL",
            "tool.name": "get_weather",
            "input.value": '{ "city":"Paris" }',
        }
    )
    assert (
        record.role,
        record.dependency,
        record.output_text,
        record.session_id,
        record.run_id,
        record.error,
    ) == (Role.TOOL, "tool:get_weather", "Sunny, 21C", "session-42", "session-42", None)
    assert len(record.tool_args_digest) == 16
    assert record.tool_args_digest == canonical.tool_args_digest


def test_openinference_tool_span_that_swallowed_an_error() -> None:
    record = _tool_record(
        {
            "openinference.span.kind": "TOOL",
            "tool.name": "get_weather",
            "input.value": '{"city": "Atlantis"}',
            "output.value": (
                "Error: ValueError('unknown city: Atlantis')\n Please fix your mistakes."
            ),
        }
    )
    evidence = record.error
    assert evidence is not None
    assert (
        evidence.swallowed,
        evidence.status_error,
        evidence.exception_type,
        evidence.exception_message,
        record.dependency,
    ) == (True, False, "ValueError", "unknown city: Atlantis", "tool:get_weather")


def test_genai_execute_tool_span() -> None:
    record = _tool_record(
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "get_weather",
            "gen_ai.tool.call.arguments": '{"city":"Paris"}',
            "gen_ai.tool.call.result": "Sunny, 21C",
            "gen_ai.conversation.id": "conv-1",
        },
        name="execute_tool get_weather",
    )
    assert (
        record.role,
        record.dependency,
        record.tool_name,
        record.output_text,
        record.session_id,
        record.error,
    ) == (Role.TOOL, "tool:get_weather", "get_weather", "Sunny, 21C", "conv-1", None)


def test_genai_execute_tool_span_that_swallowed_a_traceback() -> None:
    result = (
        "Traceback (most recent call last):\n"
        '  File "tools.py", line 12, in get_weather\n'
        "    return CITIES[city]\n"
        "KeyError: 'Atlantis'\n"
    )
    record = _tool_record(
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "get_weather",
            "gen_ai.tool.call.arguments": '{"city":"Atlantis"}',
            "gen_ai.tool.call.result": result,
        }
    )
    evidence = record.error
    assert evidence is not None
    assert (
        evidence.swallowed,
        evidence.exception_type,
        evidence.exception_message,
    ) == (True, "KeyError", "'Atlantis'")


def test_genai_execute_tool_span_that_raised() -> None:
    record = _tool_record(
        {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather"},
        raise_exc=TimeoutError("weather service did not answer in 5s"),
    )
    evidence = record.error
    assert evidence is not None
    assert (
        evidence.status_error,
        evidence.swallowed,
        evidence.exception_type,
        evidence.exception_message,
    ) == (True, False, "TimeoutError", "weather service did not answer in 5s")


def test_status_description_set_by_hand_without_event() -> None:
    tracer_provider, exporter = _tracer_provider()
    with tracer_provider.get_tracer("agent").start_as_current_span(
        "chat", attributes={"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai"}
    ) as span:
        span.set_status(Status(StatusCode.ERROR, "RateLimitError: Error code: 429 - slow down"))
    [record] = _records(exporter)
    tracer_provider.shutdown()
    evidence = record.error
    assert evidence is not None
    assert (
        evidence.exception_type,
        evidence.exception_message,
        evidence.http_status,
        record.dependency,
    ) == ("RateLimitError", "Error code: 429 - slow down", 429, "openai:unknown")
