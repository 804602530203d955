"""Permanent errors and open breakers, on spans the openai-v2 instrumentation made.

The fleet in miniature: the real ``openai`` SDK calls the fake provider, the
OpenTelemetry GenAI instrumentation (``opentelemetry-instrumentation-openai-v2``,
content capture off, its default) records each call, the OTel SDK's
``BatchSpanProcessor`` exports them and the pipeline judges them with the
governor. Each call is its own trace, so its own run.

* 401s and 404s never open the model's breaker (only transient failures count);
  the same number of 503s does.
* A run with a 401 while its model's breaker is open is aborted (``abort_run``),
  not paused and resumed at half-open; a 503 of another run at the same moment is
  paused, with a deadline and ``on_timeout: resume``; the runs paused together
  resume a few at a time.
* Half-open, one failed trial among three does not re-open the breaker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from policies import BreakerState, Governor, load_policy
from supervisor.act.commands import plan_commands
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.records import Action, CommandType
from supervisor.testing import FakeProvider, Reply

MODEL = "gpt-4o-mini"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _instrumented() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "fleet-agent"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))  # the SDK's default delays
    instrumentor: Any = OpenAIInstrumentor()  # type: ignore[no-untyped-call]
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield provider, exporter
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


@pytest.fixture(scope="module")
def calls() -> dict[str, bytes]:
    """Encoded OTLP requests of the scenario's calls, by name (each a batch the SDK exported)."""
    scripted = {
        "auth": [Reply.unauthorized()] * 8,
        "not_found": [Reply.not_found(MODEL)] * 8,
        "outage": [Reply.server_error(503)] * 6,
        "auth_once": [Reply.unauthorized()],
        "outage_once": [Reply.server_error(503)],
        "trials": [Reply.server_error(503), Reply.text("back"), Reply.text("back")],
    }
    found: dict[str, bytes] = {}
    with FakeProvider() as fake, _instrumented() as (tracer_provider, exporter):
        client = openai.OpenAI(base_url=fake.base_url, api_key="sk-fake", max_retries=0)
        for name, replies in scripted.items():
            fake.script(*replies)
            for _ in replies:
                with contextlib.suppress(openai.APIError):
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}]
                    )
            assert tracer_provider.force_flush()
            spans = exporter.get_finished_spans()
            exporter.clear()
            assert len(spans) == len(replies)
            found[name] = encode_spans(spans).SerializeToString()
    return found


def _judge(pipeline: Pipeline, payload: bytes) -> list[Outcome]:
    return pipeline.process_payload(payload, received_ns=1_000_000_000_000)


def _pipeline() -> tuple[Pipeline, Governor, Clock]:
    clock = Clock()
    policy = load_policy()
    governor = Governor(policy, clock=clock)
    return Pipeline(policy, governor=governor), governor, clock


def test_401s_and_404s_never_open_a_breaker_503s_do(calls: dict[str, bytes]) -> None:
    pipeline, governor, _ = _pipeline()

    permanent = _judge(pipeline, calls["auth"]) + _judge(pipeline, calls["not_found"])

    dependency = permanent[0].failure.dependency
    assert dependency.endswith(MODEL)
    assert {o.failure.kind for o in permanent} == {"auth", "not_found"}
    assert all(o.decision.action is Action.FAIL_FAST for o in permanent)
    info = governor.board.info(dependency)
    assert (info.state, info.failures) == (BreakerState.CLOSED, 0)

    _judge(pipeline, calls["outage"])  # 6 transient failures in a row: fail_max is 5

    assert governor.breaker_state(dependency) is BreakerState.OPEN


def test_a_401_while_the_breaker_is_open_aborts_a_503_pauses_with_a_deadline(
    calls: dict[str, bytes],
) -> None:
    pipeline, governor, clock = _pipeline()
    first = _judge(pipeline, calls["outage"])
    dependency = governor.board.snapshot()[0].dependency
    assert governor.breaker_state(dependency) is BreakerState.OPEN
    # The batch that opened it: six runs paused, not resumed all at once. The first
    # three (half_open_trials) resume when it half-opens, 30 s on; the others are
    # spread over the 30 s after, from a quarter of it on.
    resumes = [o.decision.params["breaker_reopens_in_s"] for o in first]
    assert resumes[:3] == [30.0] * 3
    assert all(37.5 <= float(str(r)) <= 60.0 for r in resumes[3:])
    assert len(set(resumes[3:])) == 3
    clock.now += 10.0

    [auth] = _judge(pipeline, calls["auth_once"])
    [outage] = _judge(pipeline, calls["outage_once"])

    # The revoked key: aborted at once, not paused until the breaker half-opens.
    assert auth.decision.action is Action.FAIL_FAST
    assert "breaker_reopens_in_s" not in auth.decision.params
    commands = plan_commands(auth.failure, auth.decision, now=clock.now)
    assert [c.type for c in commands] == [CommandType.ABORT_RUN]
    # The 503: paused, resumed when the breaker half-opens; the pause says so.
    params = outage.decision.params
    assert outage.decision.action is Action.FAIL_FAST
    assert 20.0 + 7.5 <= float(str(params["breaker_reopens_in_s"])) <= 20.0 + 30.0
    assert (params["pause_timeout_s"], params["on_timeout"]) == (
        params["breaker_reopens_in_s"],
        "resume",
    )
    commands = plan_commands(outage.failure, outage.decision, now=clock.now)
    assert [c.type for c in commands] == [CommandType.PAUSE_RUN, CommandType.RESUME_RUN]


def test_one_failed_trial_among_the_first_runs_resumed_does_not_reopen_it(
    calls: dict[str, bytes],
) -> None:
    pipeline, governor, clock = _pipeline()
    _judge(pipeline, calls["outage"])
    dependency = governor.board.snapshot()[0].dependency
    clock.now += 30.0  # reset_timeout_s: half-open
    assert governor.breaker_state(dependency) is BreakerState.HALF_OPEN

    [trial] = _judge(pipeline, calls["trials"])  # a 503, then two answers

    assert trial.decision.action is Action.RETRY  # not diverted: the breaker stayed half-open
    assert governor.breaker_state(dependency) is BreakerState.CLOSED
