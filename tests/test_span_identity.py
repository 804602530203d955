"""One truth per span: every stage sees the run and the dependency the span's record names.

The run a span belongs to and the dependency it called are worked out once
(:mod:`supervisor.normalize.span`), and the pipeline, the run tracker and the
governor's success feed all read that answer. These tests send encoded
requests through a real :class:`Pipeline` with a :class:`RunTracker` and a
governor that records what it is told, and hold each stage to the record.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from policies._cascade import Cascade
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.normalize import read_spans
from supervisor.records import Decision, Failure
from supervisor.runs import RunTracker

_ids = itertools.count(1)
RATE_LIMITED = "RateLimitError: Error code: 429 - {'error': {'code': 'rate_limit_exceeded'}}"


class RecordingGovernor:
    """A governor that keeps what it is told and changes no decision."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, bool]] = []

    def observe_calls(self, calls: list[tuple[int, str, bool]]) -> None:
        self.calls.extend(calls)

    times_calls = False

    def observe_durations(self, calls: list[tuple[str, int]]) -> None:
        pass

    def observe_cascades(self, successes: list[str], failures: list[Failure]) -> list[Cascade]:
        return []

    def review(self, failure: Failure, decision: Decision) -> Decision:
        return decision


def _value(value: object) -> AnyValue:
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(string_value=str(value))


def encoded_span(
    attributes: dict[str, object],
    *,
    trace: bytes,
    failed: bool = False,
    parent: bytes = b"",
    name: str = "chat",
) -> Span:
    return Span(
        trace_id=trace,
        span_id=next(_ids).to_bytes(8, "big"),
        parent_span_id=parent,
        name=name,
        start_time_unix_nano=10**18,
        end_time_unix_nano=10**18 + 10**9,
        attributes=[KeyValue(key=k, value=_value(v)) for k, v in attributes.items()],
        status=Status(code=Status.STATUS_CODE_ERROR, message=RATE_LIMITED)
        if failed
        else Status(code=Status.STATUS_CODE_OK),
    )


def request(*spans: Span, service: str = "agent") -> bytes:
    req = ExportTraceServiceRequest()
    resource_spans = req.resource_spans.add()
    resource_spans.resource.attributes.append(KeyValue(key="service.name", value=_value(service)))
    resource_spans.scope_spans.add().spans.extend(spans)
    return req.SerializeToString()


def tracked_pipeline() -> tuple[Pipeline, RunTracker, RecordingGovernor]:
    policy = load_policy()
    governor = RecordingGovernor()
    runs = RunTracker(settings=policy.detectors.for_service, models=policy.detectors.models)
    return Pipeline(policy, governor=governor, runs=runs), runs, governor


GENAI_CHAT = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "openai",
    "gen_ai.request.model": "gpt-4o",
}


def test_a_success_between_two_failures_of_a_session_run_resets_the_attempts() -> None:
    """``session.id`` without OpenInference's span kind still names the run, for every stage."""
    pipeline, runs, _ = tracked_pipeline()
    trace = bytes(range(1, 17))
    call = {**GENAI_CHAT, "session.id": "conversation-7"}
    attempts: list[object] = []
    for failed in (True, False, True):
        outcomes = pipeline.process_payload(
            request(encoded_span(call, trace=trace, failed=failed)), received_ns=10**18
        )
        attempts += [o.decision.params.get("attempt") for o in outcomes]
        assert {o.failure.run_id for o in outcomes} <= {"conversation-7"}

    assert attempts == [1, 1]
    assert [view.run_id for view in runs.snapshot()] == ["conversation-7"]


def test_two_session_names_on_one_span_name_one_run_for_the_failure_and_the_detectors() -> None:
    pipeline, runs, _ = tracked_pipeline()
    trace = bytes(range(2, 18))
    both = {
        "openinference.span.kind": "LLM",
        "llm.provider": "openai",
        "llm.model_name": "gpt-4o",
        "session.id": "A",
        "gen_ai.conversation.id": "B",
    }
    (outcome,) = pipeline.process_payload(
        request(encoded_span(both, trace=trace, failed=True)), received_ns=10**18
    )
    (view,) = runs.snapshot()
    (span,) = read_spans(request(encoded_span(both, trace=trace)))

    assert outcome.failure.run_id == view.run_id == span.record().session_id
    assert view.errors == 1  # the failure counted in the run the detectors watch


def test_a_child_that_names_no_session_is_filed_under_the_session_its_trace_named() -> None:
    pipeline, runs, _ = tracked_pipeline()
    trace = bytes(range(3, 19))
    root = encoded_span({"gen_ai.conversation.id": "conv-1"}, trace=trace, name="agent")
    pipeline.process_payload(request(root), received_ns=10**18)
    child = encoded_span(GENAI_CHAT, trace=trace, failed=True, parent=root.span_id)
    (outcome,) = pipeline.process_payload(request(child), received_ns=10**18)

    assert outcome.failure.run_id == "conv-1"
    assert [(v.run_id, v.errors) for v in runs.snapshot()] == [("conv-1", 1)]


def test_every_span_of_a_large_request_counts_once_in_its_run() -> None:
    """Spans are read a chunk at a time; each, quiet ones included, counts once."""
    pipeline, runs, _ = tracked_pipeline()
    trace = bytes(range(4, 20))
    offered = {"gen_ai.tool.definitions": '[{"name": "search"}]'}
    calls = [
        # An answer asking for a tool it was not offered: the quiet screen keeps it for later.
        encoded_span(
            {
                **GENAI_CHAT,
                **offered,
                "gen_ai.usage.input_tokens": 10,
                "gen_ai.output.messages": '[{"role": "assistant", "parts": [{"type":'
                f' "tool_call", "name": "serch", "arguments": {{"q": {n}}}}}]}}]',
            },
            trace=trace,
        )
        for n in range(100)
    ]
    pipeline.process_payload(request(*calls), received_ns=10**18)

    (view,) = runs.snapshot()
    assert (view.spans, view.llm_calls, view.input_tokens) == (100, 100, 1000)


# -- every convention, every stage ------------------------------------------------

SESSION_KEYS = (
    "gen_ai.conversation.id",
    "session.id",
    "traceloop.association.properties.session_id",
    "traceloop.association.properties.thread_id",
)
CONVENTIONS: dict[str, list[dict[str, object]]] = {
    "genai": [
        GENAI_CHAT,
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": "anthropic",
            "gen_ai.response.model": "claude-3-5-sonnet",
        },
        {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"},
    ],
    "openinference": [
        {"openinference.span.kind": "LLM", "llm.provider": "openai", "llm.model_name": "gpt-4o"},
        {"openinference.span.kind": "TOOL", "tool.name": "lookup", "input.value": "{}"},
        {"openinference.span.kind": "CHAIN"},
    ],
    "openllmetry": [
        {"traceloop.span.kind": "tool", "traceloop.entity.name": "fetch"},
        {"llm.request.type": "chat", "gen_ai.system": "OpenAI", "gen_ai.request.model": "gpt-4"},
    ],
    "http": [
        {
            "http.request.method": "GET",
            "server.address": "api.example.com",
            "http.response.status_code": 200,
        },
    ],
}
shapes = st.sampled_from([shape for group in CONVENTIONS.values() for shape in group])
sessions = st.dictionaries(
    st.sampled_from(SESSION_KEYS), st.sampled_from(["s1", "s2", "", 42]), max_size=2
)
span_specs = st.lists(
    st.tuples(shapes, sessions, st.booleans(), st.integers(min_value=0, max_value=2)),
    min_size=1,
    max_size=12,
)


def _failures_by_span(outcomes: Collection[Outcome]) -> dict[str, Failure]:
    return {o.failure.span_id: o.failure for o in outcomes if o.failure.rule.startswith("builtin.")}


_TOOL = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_specs)
# A loop found in a trace's first spans, before a later span of the batch named its
# session: the loop is the session's run's, as the trace's run became it.
@example(
    specs=[
        (_TOOL, {}, False, 0),
        (_TOOL, {}, False, 0),
        (GENAI_CHAT, {"gen_ai.conversation.id": "s1"}, True, 0),
        (_TOOL, {}, False, 0),
    ]
)
def test_every_stage_sees_the_records_run_and_dependency(
    specs: list[tuple[dict[str, object], dict[str, object], bool, int]],
) -> None:
    pipeline, runs, governor = tracked_pipeline()
    traces = [bytes([n + 1]) * 16 for n in range(3)]
    spans = [
        encoded_span({**shape, **session}, trace=traces[t], failed=failed)
        for shape, session, failed, t in specs
    ]
    payload = request(*spans)
    records = {r.span_id: r for r in (s.record() for s in read_spans(payload))}
    named: dict[str, set[str]] = {}
    for record in records.values():
        named.setdefault(record.trace_id, set()).update({record.session_id} - {""})

    def expected_run(trace_id: str) -> str:
        # A trace that named one session is that session's; one that named two is
        # pathological: any one of them, as long as every stage agrees (checked below).
        sessions = named[trace_id]
        return next(iter(sessions)) if len(sessions) == 1 else trace_id

    outcomes = pipeline.process_payload(payload, received_ns=10**18)

    errors: dict[str, int] = {}
    for span_id, failure in _failures_by_span(outcomes).items():
        record = records[span_id]
        assert failure.dependency == record.dependency
        assert failure.run_id == runs.resolve(record.trace_id, record.session_id)
        if len(named[record.trace_id]) < 2:
            assert failure.run_id == expected_run(record.trace_id)
        errors[failure.run_id] = errors.get(failure.run_id, 0) + 1
    succeeded = sorted(r.dependency for r in records.values() if r.error is None and r.dependency)
    assert sorted(d for _, d, ok in governor.calls if ok) == succeeded
    views = {view.run_id: view for view in runs.snapshot(limit=100)}
    assert {run: views[run].errors for run in errors} == errors
    for record in records.values():
        run = runs.resolve(record.trace_id, record.session_id)
        assert run in views
        if len(named[record.trace_id]) < 2:
            assert run == expected_run(record.trace_id)


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (AnyValue(int_value=120), 120),
        (AnyValue(int_value=0), 0),
        (AnyValue(int_value=-5), 0),
        (AnyValue(int_value=1 << 50), 0),
        (AnyValue(double_value=2.0), 2),
        (AnyValue(string_value="42"), 42),
        (AnyValue(string_value="many"), 0),
        (AnyValue(), 0),
    ],
)
def test_a_token_count_is_read_whatever_its_encoding(value: AnyValue, tokens: int) -> None:
    span = encoded_span(GENAI_CHAT, trace=bytes(range(5, 21)))
    span.attributes.append(KeyValue(key="gen_ai.usage.input_tokens", value=value))
    (view,) = read_spans(request(span))
    assert view.input_tokens == tokens
