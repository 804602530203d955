"""Breakers per provider, model and credential: one exhausted API key opens only its own.

Spans come from the real openai SDK, instrumented by the real openai-v2
instrumentation, against the FakeProvider; the agent names the credential a
call used with ``spanvisor.credential`` (a span processor copies it from the
baggage, as an agent would), never the key itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry import baggage, context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from policies import BreakerState, Governor, load_policy
from supervisor.judge.pipeline import Pipeline
from supervisor.normalize import credential as credentials
from supervisor.records import Action, breaker_key
from supervisor.testing import FakeProvider, Reply

MODEL = "gpt-4o-mini"
DEP = f"openai:{MODEL}"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
POLICY = """\
version: 1
breakers:
  default: {fail_max: 3, reset_timeout_s: 30}
  dependencies:
    "openai:gpt-4o-mini": {fail_max: 2, reset_timeout_s: 60}
"""


class CredentialFromBaggage(SpanProcessor):
    """What an agent adds: the credential's name of the call, on its spans."""

    def on_start(self, span: Span, parent_context: context.Context | None = None) -> None:
        name = baggage.get_baggage("spanvisor.credential", parent_context)
        if isinstance(name, str):
            span.set_attribute("spanvisor.credential", name)

    def on_end(self, span: ReadableSpan) -> None:
        pass


@contextlib.contextmanager
def instrumented() -> Iterator[InMemorySpanExporter]:
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(CredentialFromBaggage())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = OpenAIInstrumentor()  # type: ignore[no-untyped-call]
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


def call(client: openai.OpenAI, credential: str | None) -> None:
    token = None
    if credential is not None:
        token = context.attach(baggage.set_baggage("spanvisor.credential", credential))
    try:
        with contextlib.suppress(openai.APIError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
    finally:
        if token is not None:
            context.detach(token)


def test_one_credential_failing_opens_its_breaker_only() -> None:
    policy = load_policy(text=POLICY)
    governor = Governor(policy, clock=lambda: 100.0)
    pipeline = Pipeline(policy, governor=governor)
    refused_before = credentials.refused()
    with FakeProvider() as fake, instrumented() as exporter:
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
        with client:
            # team-a's key is failing: three 503s; team-b's works, then one 401 (its own).
            fake.script(*[Reply.server_error(503)] * 3)
            for _ in range(3):
                call(client, "team-a")
            call(client, "team-b")
            fake.script(Reply.unauthorized())
            call(client, "team-b")
            call(client, "sk-proj-abcdef123456")  # a secret: ignored, counted
            call(client, None)
        spans = exporter.get_finished_spans()
        outcomes = pipeline.process(encode_spans(spans), received_ns=1)

    assert len(spans) == 7
    by_key = {o.failure.breaker_key: o for o in outcomes}
    assert sorted(by_key) == [f"{DEP}@team-a", f"{DEP}@team-b"]
    # The 503s of team-a opened the breaker of team-a's key, with the model's settings
    # (fail_max 2, reset 60 s: the `openai:gpt-4o-mini` entry applies to its keys).
    assert governor.breaker_state(f"{DEP}@team-a") is BreakerState.OPEN
    paused = by_key[f"{DEP}@team-a"].decision
    assert paused.action is Action.FAIL_FAST
    assert paused.params["breaker_reopens_in_s"] == 60.0
    assert f"breaker of {DEP}@team-a is open" in paused.reason
    # team-b's key and the model without a credential are untouched (a 401 says nothing
    # of the dependency's health).
    assert governor.breaker_state(f"{DEP}@team-b") is BreakerState.CLOSED
    assert governor.breaker_state(DEP) is BreakerState.CLOSED
    assert by_key[f"{DEP}@team-b"].failure.kind == "auth"
    # The secret never became a key, nor reached a record.
    assert credentials.refused() == refused_before + 1
    assert all("sk-proj" not in b.dependency for b in governor.board.snapshot())
    assert {b.dependency for b in governor.board.snapshot()} <= {
        f"{DEP}@team-a",
        f"{DEP}@team-b",
        DEP,
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("team-a", "team-a"),
        ("3f2a9c", "3f2a9c"),
        ("sk-abc123", ""),
        ("sk-ant-api03-x", ""),
        ("AIzaSyA", ""),
        ("two words", ""),
        (42, ""),
        (None, ""),
        ("", ""),
    ],
)
def test_a_credential_is_a_name_never_a_secret(value: Any, expected: str) -> None:
    before = credentials.refused()
    assert credentials.credential_of(value) == expected
    refused = value not in (None, "") and not expected
    assert credentials.refused() == before + (1 if refused else 0)


def test_the_breaker_key_names_the_credential_only_when_there_is_one() -> None:
    assert breaker_key(DEP, "team-a") == f"{DEP}@team-a"
    assert breaker_key(DEP, "") == DEP
    assert breaker_key("", "team-a") == ""


def test_a_glob_and_an_exact_entry_both_apply_to_a_credentials_breaker() -> None:
    limits = load_policy(text=POLICY).limits
    assert limits.breaker_for(f"{DEP}@team-a").fail_max == 2
    assert limits.breaker_for("openai:gpt-4o@team-a").fail_max == 3  # the default
    globbed = load_policy(text='version: 1\nbreakers: {dependencies: {"openai:*": {fail_max: 9}}}')
    assert globbed.limits.breaker_for("openai:gpt-4o@team-a").fail_max == 9
