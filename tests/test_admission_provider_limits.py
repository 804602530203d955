"""What the provider's rate-limit headers and token counts teach admission.

Spans are made by the real OTel SDK, encoded as an exporter sends them and
judged by the pipeline with a run tracker, as the sidecar wires them: the
headers on the HTTP span an instrumentation that captures response headers
makes under the LLM span (``http.response.header.<name>``, a string array),
or on the LLM span itself where the agent records them (the plain name).
The header values are set on the spans here, as the provider sends them.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from policies import load_policy
from supervisor.admission import Admitter, Ceiling, admission_key
from supervisor.judge.pipeline import Pipeline
from supervisor.normalize.ratelimits import rate_limits_of
from supervisor.records import RateLimitHeaders
from supervisor.runs import RunTracker
from tests.test_shared_counts import Clock

OPENAI = admission_key("openai:gpt-4o")


class Agent:
    def __init__(self, admitter: Admitter) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource({"service.name": "agent"}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("test")
        policy = load_policy()
        runs = RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models)
        runs.llm_calls = admitter.llm_call
        self.pipeline = Pipeline(policy, runs=runs)

    def call(
        self,
        model: str = "gpt-4o",
        *,
        system: str = "openai",
        tokens: tuple[int, int] = (900, 100),
        http: dict[str, Any] | None = None,
        own: dict[str, Any] | None = None,
    ) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": system,
            "gen_ai.request.model": model,
            "gen_ai.usage.input_tokens": tokens[0],
            "gen_ai.usage.output_tokens": tokens[1],
            **(own or {}),
        }
        with self.tracer.start_as_current_span(
            f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes
        ):
            if http is not None:
                with self.tracer.start_as_current_span(
                    "POST",
                    kind=SpanKind.CLIENT,
                    attributes={
                        "http.request.method": "POST",
                        "url.full": "https://api.openai.com/v1/chat/completions",
                        "http.response.status_code": 200,
                        **http,
                    },
                ):
                    pass
        payload = encode_spans(self.exporter.get_finished_spans()).SerializeToString()
        self.exporter.clear()
        self.pipeline.process_payload(payload, received_ns=time.time_ns())


def header(value: str) -> tuple[str, ...]:
    return (value,)  # captured headers are string arrays


def test_published_limits_lower_the_ceiling_never_raise_it() -> None:
    admitter = Admitter(Ceiling(rpm=500, tpm=1_000_000), clock=Clock(time.time()))
    agent = Agent(admitter)
    agent.call(
        http={
            "http.response.header.x-ratelimit-limit-requests": header("300"),
            "http.response.header.x-ratelimit-limit-tokens": header("2000000"),
            "http.response.header.x-ratelimit-remaining-requests": header("299"),
            "http.response.header.x-ratelimit-reset-requests": header("200ms"),
        }
    )
    limit = admitter.stats().models[0]
    assert (limit.model, limit.provider_rpm, limit.provider_tpm) == ("openai:gpt-4o", 300, 2e6)
    assert (limit.rpm, limit.tpm) == (300, 1_000_000)  # tokens: the configured one is lower
    assert admitter.admit(OPENAI).go


def test_an_exhausted_limit_pauses_the_model_until_its_reset() -> None:
    clock = Clock(time.time())
    admitter = Admitter(Ceiling(rpm=500), clock=clock)
    agent = Agent(admitter)
    reset = datetime.now(timezone.utc) + timedelta(seconds=30)
    agent.call(  # the agent recorded Anthropic's headers on its own span
        "claude-sonnet-4",
        system="anthropic",
        own={
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z"),
        },
    )
    found = admitter.admit(admission_key("anthropic:claude-sonnet-4"))
    assert not found.go and found.why == "paused"
    assert 28_000 <= found.wait_ms <= 30_000
    assert admitter.stats().models[0].provider_rpm == 50


def test_an_admission_without_tokens_takes_the_models_usual_call() -> None:
    clock = Clock(time.time())
    admitter = Admitter(Ceiling(rpm=1000, tpm=6000), clock=clock)
    agent = Agent(admitter)
    for _ in range(3):
        agent.call(tokens=(1800, 200))  # 2000 tokens a call
    assert admitter.stats().models[0].avg_tokens == 2000
    assert [admitter.admit(OPENAI).go for _ in range(4)] == [True, True, True, False]
    unlimited = Admitter(Ceiling(rpm=1000), clock=clock)  # no tpm: tokens are not counted
    Agent(unlimited).call(tokens=(1800, 200))
    assert all(unlimited.admit(OPENAI).go for _ in range(10))


@pytest.mark.parametrize(
    "attrs",
    [
        {"x-ratelimit-limit-requests": "-5"},
        {"x-ratelimit-limit-requests": "1e9"},
        {"x-ratelimit-limit-requests": "9" * 40},
        {"x-ratelimit-limit-requests": ("",)},
        {"x-ratelimit-limit-requests": ()},
        {"x-ratelimit-limit-requests": True},
        {"x-ratelimit-limit-requests": "٣٠٠"},  # digits, but not ASCII
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "soon"},
        {"x-ratelimit-remaining-requests": "0"},
        {
            "anthropic-ratelimit-tokens-remaining": "0",
            "anthropic-ratelimit-tokens-reset": "x" * 10**5,
        },
    ],
)
def test_garbage_reads_as_nothing(attrs: dict[str, Any]) -> None:
    assert rate_limits_of(attrs, time.time()) is None


def test_what_each_header_says() -> None:
    now = 1_700_000_000.0
    found = rate_limits_of(
        {
            "http.response.header.x-ratelimit-limit-requests": ("5000",),
            "http.response.header.x-ratelimit-remaining-tokens": ("0",),
            "http.response.header.x-ratelimit-reset-tokens": ("6m0s",),
            "x-ratelimit-remaining-requests": 0,
            "x-ratelimit-reset-requests": "1s",
            "anthropic-ratelimit-input-tokens-limit": "80000",
        },
        now,
    )
    assert found == RateLimitHeaders(5000, 80000, 360.0)


def test_headers_captured_by_the_httpx_instrumentation_reach_the_admitter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real openai SDK, instrumented by openai-v2 and by httpx (the SDK calls through
    httpx2) with response headers captured, gets a 429 from the fake provider carrying
    OpenAI's rate-limit headers (the fake sends a reply's headers on faults only)."""
    import openai
    from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    from supervisor.normalize import normalize_request
    from supervisor.records import Role
    from supervisor.testing import FakeProvider, Reply

    monkeypatch.setenv(
        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_RESPONSE", "x-ratelimit-.*"
    )
    clock = Clock(time.time())
    admitter = Admitter(Ceiling(rpm=500), clock=clock)
    agent = Agent(admitter)
    provider = TracerProvider(resource=Resource({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(agent.exporter))
    instrumentors: list[Any] = [HTTPX2ClientInstrumentor(), OpenAIInstrumentor()]  # type: ignore[no-untyped-call]
    for instrumentor in instrumentors:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        instrumentor.instrument(tracer_provider=provider)
    try:
        with FakeProvider() as fake:
            fake.script(
                Reply.fault(
                    429,
                    "Rate limit reached for requests",
                    error_type="requests",
                    error_code="rate_limit_exceeded",
                    headers={
                        "x-ratelimit-limit-requests": "60",
                        "x-ratelimit-remaining-requests": "0",
                        "x-ratelimit-reset-requests": "20s",
                    },
                )
            )
            client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
                )
    finally:
        for instrumentor in instrumentors:
            instrumentor.uninstrument()
    spans = agent.exporter.get_finished_spans()
    records = normalize_request(encode_spans(spans))
    [http] = [r for r in records if r.role is Role.HTTP]
    # opentelemetry-util-http writes a header's dashes as underscores.
    assert http.attributes["http.response.header.x_ratelimit_limit_requests"] == ("60",)
    assert http.rate_limits == RateLimitHeaders(60, None, 20.0)
    assert http.error is not None and http.error.retry_after_s == 20.0  # its reset, read too

    agent.pipeline.process_payload(
        encode_spans(spans).SerializeToString(), received_ns=time.time_ns()
    )
    found = admitter.admit(admission_key("openai:gpt-4o-mini"))
    assert not found.go and found.why == "paused" and 19_000 <= found.wait_ms <= 20_000
    limit = admitter.stats().models[0]
    assert (limit.model, limit.provider_rpm, limit.rpm) == ("openai:gpt-4o-mini", 60, 60)
