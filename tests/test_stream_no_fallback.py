"""No fallback once a streamed answer has begun: its chunks already reached the agent."""

from __future__ import annotations

import contextlib

import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from policies import load_policy
from policies._governor import Governor
from supervisor.judge.pipeline import Pipeline
from supervisor.normalize.streaming import stream_began
from supervisor.records import Action, ErrorEvidence, Failure, FailureClass, Role
from supervisor.testing import FakeProvider, Reply
from tests.test_normalize_real_instrumentation import MESSAGES, MODEL, _instrumented

BEGAN = ErrorEvidence(status_error=True, exception_type="openai.APIError", stream_began=True)
NOT_BEGUN = ErrorEvidence(status_error=True, exception_type="openai.APIError")


# -- what says a stream began ----------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "tokens", "text", "finish", "began"),
    [
        ({"gen_ai.response.time_to_first_chunk": 0.4}, None, "", (), True),
        ({"gen_ai.response.time_to_first_token": 0.0}, None, "", (), False),
        ({"llm.is_streaming": True}, 12, "", (), True),
        ({"gen_ai.request.stream": "true"}, None, "Paris", (), True),
        ({"llm.is_streaming": True}, 0, "", (), False),  # the stream broke before any chunk
        ({}, 7, "Paris is", ("length",), False),  # a whole answer that failed on its finish
        ({}, None, "Paris is", ("error",), True),  # OTel GenAI: chunks, then the stream broke
        ({}, None, "", ("error",), False),
    ],
)
def test_stream_began_from_attributes(
    attrs: dict[str, object], tokens: int | None, text: str, finish: tuple[str, ...], began: bool
) -> None:
    assert stream_began(attrs, tokens, text, finish) is began  # type: ignore[arg-type]


# -- the policy's decision --------------------------------------------------------------

POLICY = """\
version: 1
rules:
  # openai-python keeps only the message of an error event sent mid-stream.
  - name: stream.server_error
    match: {message: "server had an error"}
    class: transient
    kind: unavailable
policies:
  - name: fb
    match: {dependency: "openai:*"}
    action: fallback
    chain: {"openai:*": ["openai:gpt-4o-mini", "anthropic:claude"]}
  - name: rt
    match: {dependency: "openai:*"}
    action: retry
    max_attempts: 3
    wait: {type: fixed, seconds: 1}
"""

NO_RETRY = """\
version: 1
builtin: false
policies:
  - name: fb
    match: {dependency: "openai:*"}
    action: fallback
    chain: {"openai:*": ["openai:gpt-4o-mini", "anthropic:claude"]}
"""


def failure(evidence: ErrorEvidence) -> Failure:
    return Failure(
        trace_id="a" * 32,
        span_id="b" * 16,
        parent_span_id="",
        service="agent",
        span_name="ChatCompletion",
        run_id="r1",
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind="unavailable",
        dependency="openai:gpt-4o-mini",
        rule="r",
        message="APIError",
        evidence=evidence,
        received_ns=0,
    )


def test_a_stream_not_begun_falls_back() -> None:
    decision = load_policy(text=POLICY).decide(failure(NOT_BEGUN), attempt=1)
    assert (decision.action, decision.params["to"]) == (Action.FALLBACK, "anthropic:claude")


def test_a_stream_that_began_is_retried_when_the_policy_retries_it() -> None:
    decision = load_policy(text=POLICY).decide(failure(BEGAN), attempt=1)
    assert decision.action is Action.RETRY
    assert decision.policy == "rt"
    assert "streamed response had begun: no fallback" in decision.reason


def test_a_stream_that_began_is_escalated_when_no_retry_is_left() -> None:
    policy = load_policy(text=POLICY)
    assert policy.decide(failure(BEGAN), attempt=4).action is Action.ESCALATE  # 3 attempts
    decision = load_policy(text=NO_RETRY).decide(failure(BEGAN), attempt=1)
    assert decision.action is Action.ESCALATE
    assert decision.policy == "fb"
    assert "streamed response had begun" in decision.reason
    assert decision.params["on_timeout"] == "abort"


def test_an_open_breaker_does_not_fall_back_either() -> None:
    policy = load_policy(text=POLICY)
    governor = Governor(policy, clock=lambda: 100.0)
    governor.observe_calls([(i, "openai:gpt-4o-mini", False) for i in range(5)])
    began = failure(BEGAN)
    decision = governor.review(began, policy.decide(began, attempt=1))
    assert decision.action is Action.FAIL_FAST  # paused until the breaker half-opens
    assert "breaker_reopens_in_s" in decision.params
    assert "streamed response had begun" in decision.reason
    not_begun = failure(NOT_BEGUN)
    assert governor.review(not_begun, policy.decide(not_begun, attempt=1)).action is (
        Action.FALLBACK
    )


# -- a real broken stream, from the instrumented SDK to the decision ---------------------


@pytest.mark.parametrize("instrumentation", ["openinference", "openai_v2"])
def test_a_broken_stream_seen_in_real_spans_is_not_a_fallback(instrumentation: str) -> None:
    policy = load_policy(text=POLICY)
    pipeline = Pipeline(policy, governor=Governor(policy, clock=lambda: 100.0))
    with FakeProvider() as fake, _instrumented(instrumentation) as exporter:
        fake.script(Reply.stream_broken("Paris is sunny today, with a light breeze."))
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
        with contextlib.suppress(openai.APIError), client:
            for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
                pass
        outcomes = pipeline.process(encode_spans(exporter.get_finished_spans()), received_ns=1)
    (outcome,) = outcomes
    assert outcome.failure.evidence.stream_began
    assert outcome.decision.action is Action.RETRY
    assert "streamed response had begun" in outcome.decision.reason


@pytest.mark.parametrize("instrumentation", ["openinference", "openai_v2"])
def test_a_broken_stream_is_a_transient_server_error_for_the_builtin_policy(
    instrumentation: str,
) -> None:
    """openai-python's bare APIError for an SSE error event is retried, not escalated."""
    policy = load_policy()
    pipeline = Pipeline(policy, governor=Governor(policy, clock=lambda: 100.0))
    with FakeProvider() as fake, _instrumented(instrumentation) as exporter:
        fake.script(Reply.stream_broken("Paris is sunny today, with a light breeze."))
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
        with pytest.raises(openai.APIError) as raised, client:
            for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
                pass
        assert type(raised.value) is openai.APIError  # not a status error: no HTTP status
        outcomes = pipeline.process(encode_spans(exporter.get_finished_spans()), received_ns=1)
    (outcome,) = outcomes
    found = outcome.failure
    assert (found.failure_class, found.kind, found.rule) == (
        FailureClass.TRANSIENT,
        "unavailable",
        "builtin.openai.stream_error",
    )
    assert found.evidence.stream_began
    assert outcome.decision.action is Action.RETRY
    assert outcome.decision.policy == "builtin.transient_io"
