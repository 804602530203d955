"""The pipeline reports each failure once, at its origin, and counts attempts."""

from __future__ import annotations

import itertools

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from supervisor.judge.pipeline import Pipeline
from supervisor.records import Action, ErrorEvidence, FailureClass, Role, SpanRecord

TRACE = "0af7651916cd43dd8448eb211c80319c"
_ids = itertools.count(1)

RATE_LIMIT = ErrorEvidence(
    status_error=True,
    status_message="RateLimitError: Error code: 429 - {'error': {'code': 'rate_limit_exceeded'}}",
    exception_type="openai.RateLimitError",
    exception_message="Error code: 429 - {'error': {'code': 'rate_limit_exceeded'}}",
    http_status=429,
    provider_code="rate_limit_exceeded",
)
GENERIC = ErrorEvidence(status_error=True, status_message="")


def span(
    role: Role,
    error: ErrorEvidence | None,
    *,
    parent: str = "",
    span_id: str | None = None,
    trace: str = TRACE,
    dependency: str = "",
    service: str = "agent",
    name: str = "",
    start_ns: int = 0,
    end_ns: int = 0,
) -> SpanRecord:
    sid = span_id or f"{next(_ids):016x}"
    return SpanRecord(
        trace_id=trace,
        span_id=sid,
        parent_span_id=parent,
        name=name or f"{role.value} span",
        service=service,
        kind=0,
        start_ns=start_ns,
        end_ns=end_ns,
        role=role,
        dependency=dependency,
        error=error,
    )


@pytest.fixture
def pipeline() -> Pipeline:
    return Pipeline(load_policy())


def test_parent_that_propagates_a_child_error_is_attributed_not_reported(
    pipeline: Pipeline,
) -> None:
    llm = span(Role.LLM, RATE_LIMIT, parent="00000000000000aa", dependency="openai:gpt-4o-mini")
    agent = span(Role.AGENT, RATE_LIMIT, span_id="00000000000000aa")

    outcomes = pipeline.process_records([llm, agent], received_ns=1)

    assert [o.failure.span_id for o in outcomes] == [llm.span_id]
    failure = outcomes[0].failure
    assert (failure.failure_class, failure.kind) == (FailureClass.TRANSIENT, "rate_limit")
    assert failure.attributed == ("00000000000000aa",)
    assert pipeline.stats().attributed == 1


def test_http_origin_under_an_llm_span_takes_the_llm_dependency(pipeline: Pipeline) -> None:
    http = span(
        Role.HTTP,
        ErrorEvidence(status_error=True, http_status=429),
        parent="00000000000000bb",
        dependency="http:api.openai.com",
    )
    llm = span(Role.LLM, RATE_LIMIT, span_id="00000000000000bb", dependency="openai:gpt-4o")

    outcomes = pipeline.process_records([http, llm], received_ns=1)

    assert len(outcomes) == 1
    assert outcomes[0].failure.span_id == http.span_id
    assert outcomes[0].failure.dependency == "openai:gpt-4o"


def test_parent_failing_for_its_own_reason_is_reported_too(pipeline: Pipeline) -> None:
    tool = span(
        Role.TOOL,
        ErrorEvidence(status_error=True, exception_type="TimeoutError", exception_message="5s"),
        parent="00000000000000cc",
        dependency="tool:get_weather",
    )
    llm = span(
        Role.LLM,
        ErrorEvidence(
            status_error=True,
            exception_type="openai.AuthenticationError",
            exception_message="Error code: 401 - {'error': {'code': 'invalid_api_key'}}",
            http_status=401,
            provider_code="invalid_api_key",
        ),
        span_id="00000000000000cc",
        dependency="openai:gpt-4o",
    )

    outcomes = pipeline.process_records([tool, llm], received_ns=1)

    assert [(o.failure.span_id, o.failure.kind) for o in outcomes] == [
        (tool.span_id, "timeout"),
        (llm.span_id, "auth"),
    ]


def test_parent_in_a_later_batch_is_attributed_to_the_earlier_origin(pipeline: Pipeline) -> None:
    llm = span(Role.LLM, RATE_LIMIT, parent="00000000000000dd", dependency="openai:gpt-4o")
    chain = span(Role.CHAIN, GENERIC, parent="00000000000000ee", span_id="00000000000000dd")
    agent = span(Role.AGENT, RATE_LIMIT, span_id="00000000000000ee")

    first = pipeline.process_records([llm], received_ns=1)
    second = pipeline.process_records([chain], received_ns=2)
    third = pipeline.process_records([agent], received_ns=3)

    assert [o.failure.span_id for o in first] == [llm.span_id]
    assert second == []
    assert third == []
    assert pipeline.stats().attributed == 2


def test_an_ancestor_above_a_span_that_did_not_fail_is_attributed(pipeline: Pipeline) -> None:
    # The OpenAI Agents SDK: agent (ERROR) > turn (OK, never judged) > generation (ERROR).
    llm = span(
        Role.LLM,
        RATE_LIMIT,
        parent="00000000000000f1",
        dependency="openai:gpt-4o",
        start_ns=10,
        end_ns=20,
    )
    agent = span(Role.AGENT, RATE_LIMIT, span_id="00000000000000f2", start_ns=0, end_ns=30)

    outcomes = pipeline.process_records([agent, llm], received_ns=1)

    assert [o.failure.span_id for o in outcomes] == [llm.span_id]
    assert outcomes[0].failure.attributed == (agent.span_id,)


def test_in_an_outage_each_failure_lists_its_own_containers_nearest_first(
    pipeline: Pipeline,
) -> None:
    # Every trace of the batch fails the same way: agent (ERROR) > turn (OK) > step
    # (ERROR) > call (OK) > generation (ERROR), children before parents as exporters
    # send them. Each generation is the origin; its step and agent are attributed.
    records: list[SpanRecord] = []
    expected: dict[str, tuple[str, ...]] = {}
    for i in range(60):
        trace = f"{i + 1:032x}"
        llm = span(
            Role.LLM,
            RATE_LIMIT,
            trace=trace,
            parent=f"{i:08x}00000001",
            dependency="openai:gpt-4o",
            start_ns=40,
            end_ns=50,
        )
        step = span(
            Role.CHAIN,
            RATE_LIMIT,
            trace=trace,
            span_id=f"{i:08x}00000002",
            parent=f"{i:08x}00000003",
            start_ns=20,
            end_ns=70,
        )
        agent = span(Role.AGENT, RATE_LIMIT, trace=trace, span_id=f"{i:08x}00000004", end_ns=90)
        records += [llm, step, agent]
        expected[llm.span_id] = (step.span_id, agent.span_id)

    outcomes = pipeline.process_records(records, received_ns=1)

    assert {o.failure.span_id: o.failure.attributed for o in outcomes} == expected
    assert pipeline.stats().attributed == 120


def test_an_ancestor_above_an_ok_span_in_a_later_batch_is_attributed(pipeline: Pipeline) -> None:
    llm = span(
        Role.LLM,
        RATE_LIMIT,
        parent="00000000000000f3",
        dependency="openai:gpt-4o",
        start_ns=10,
        end_ns=20,
    )
    agent = span(Role.AGENT, RATE_LIMIT, span_id="00000000000000f4", start_ns=0, end_ns=30)
    elsewhere = span(
        Role.AGENT, RATE_LIMIT, trace="1" * 32, span_id="00000000000000f5", start_ns=0, end_ns=30
    )

    assert len(pipeline.process_records([llm], received_ns=1)) == 1
    assert pipeline.process_records([agent], received_ns=2) == []
    # The same error in another trace is that trace's own failure.
    assert [o.failure.span_id for o in pipeline.process_records([elsewhere], received_ns=3)] == [
        elsewhere.span_id
    ]


def test_a_container_failing_for_its_own_reason_is_reported(pipeline: Pipeline) -> None:
    llm = span(
        Role.LLM,
        RATE_LIMIT,
        parent="00000000000000f6",
        dependency="openai:gpt-4o",
        start_ns=10,
        end_ns=20,
    )
    timeout = ErrorEvidence(status_error=True, exception_type="TimeoutError", exception_message="")
    agent = span(Role.AGENT, timeout, span_id="00000000000000f7", start_ns=0, end_ns=30)

    outcomes = pipeline.process_records([llm, agent], received_ns=1)

    assert [(o.failure.span_id, o.failure.kind) for o in outcomes] == [
        (llm.span_id, "rate_limit"),
        (agent.span_id, "timeout"),
    ]


def test_a_span_that_names_itself_its_parent_is_still_reported(pipeline: Pipeline) -> None:
    looped = span(
        Role.LLM,
        RATE_LIMIT,
        span_id="00000000000000f8",
        parent="00000000000000f8",
        dependency="openai:gpt-4o",
    )

    assert [o.failure.span_id for o in pipeline.process_records([looped], received_ns=1)] == [
        looped.span_id
    ]


def test_a_resent_batch_reports_nothing_new(pipeline: Pipeline) -> None:
    llm = span(Role.LLM, RATE_LIMIT, dependency="openai:gpt-4o")

    first = pipeline.process_records([llm], received_ns=1)
    again = pipeline.process_records([llm], received_ns=2)

    assert len(first) == 1
    assert again == []
    assert pipeline.stats().duplicates == 1


def test_attempts_count_failures_of_one_dependency_in_a_run(pipeline: Pipeline) -> None:
    decisions = [
        pipeline.process_records(
            [span(Role.LLM, RATE_LIMIT, dependency="openai:gpt-4o")], received_ns=i
        )[0].decision
        for i in range(1, 4)
    ]

    assert [d.action for d in decisions] == [Action.RETRY] * 3
    assert [d.params["attempt"] for d in decisions] == [1, 2, 3]


def test_own_decision_spans_are_never_judged(pipeline: Pipeline) -> None:
    own = span(Role.OTHER, GENERIC, service="spanvisor", name="spanvisor.decide")

    assert pipeline.process_records([own], received_ns=1) == []
    assert pipeline.stats().own_spans_skipped == 1


def test_observe_mode_marks_every_decision() -> None:
    observing = Pipeline(load_policy(), observe_only=True)

    outcomes = observing.process_records(
        [span(Role.LLM, RATE_LIMIT, dependency="openai:gpt-4o")], received_ns=1
    )

    assert [o.decision.observe_only for o in outcomes] == [True]


def test_bounded_memory_counts_evictions() -> None:
    small = Pipeline(load_policy(), seen_capacity=2, runs_capacity=2)

    for _ in range(5):
        small.process_records([span(Role.LLM, RATE_LIMIT, dependency="openai:gpt-4o")], 1)

    assert small.stats().evictions > 0
    assert small.stats().failures == 5


def _request(*spans: Span) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    return request


def _span(span_id: int, attributes: dict[str, str], *, error: str = "") -> Span:
    return Span(
        trace_id=bytes.fromhex(TRACE),
        span_id=span_id.to_bytes(8, "big"),
        name="s",
        attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attributes.items()],
        status=Status(code=Status.STATUS_CODE_ERROR, message=error) if error else Status(),
    )


def test_spans_that_show_failure_are_judged_before_the_rest_of_the_batch(
    pipeline: Pipeline,
) -> None:
    swallowed = _span(
        1,
        {
            "openinference.span.kind": "TOOL",
            "tool.name": "get_weather",
            "output.value": "Error: TimeoutError: the weather service did not answer",
        },
    )
    errored = _span(
        2,
        {"openinference.span.kind": "LLM", "llm.provider": "openai", "llm.model_name": "gpt-4o"},
        error="APIConnectionError: Connection error.",
    )
    payload = _request(swallowed, errored).SerializeToString()

    first, rest = pipeline.first_pass(payload, received_ns=1)
    later = pipeline.rest_pass(rest)

    assert [(o.failure.span_id, o.failure.kind) for o in first] == [(f"{2:016x}", "connection")]
    assert [(o.failure.span_id, o.failure.kind) for o in later] == [(f"{1:016x}", "timeout")]
    assert later[0].failure.evidence.swallowed


def test_a_success_of_the_dependency_ends_the_steps_attempts() -> None:
    """A step's attempts: failures of a dependency in a run since its last success there."""
    from policies._governor import Governor

    policy = load_policy()
    pipeline = Pipeline(policy, governor=Governor(policy))
    llm = {"gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "m"}
    error = "Error code: 503 - {'error': {'message': 'overloaded', 'type': 'server_error'}}"

    def attempt_of(*spans: Span) -> list[int]:
        outcomes = pipeline.process_payload(_request(*spans).SerializeToString(), 0)
        return [int(o.decision.params["attempt"]) for o in outcomes]  # type: ignore[call-overload]

    assert attempt_of(_span(1, llm, error=error)) == [1]
    assert attempt_of(_span(2, llm, error=error)) == [2]
    assert attempt_of(_span(3, llm)) == []  # the step went through
    assert attempt_of(_span(4, llm, error=error)) == [1]  # the next step starts afresh


class _Waits:
    """A RecoveryListener that waits for one (run, dependency) pair and records what it is told."""

    def __init__(self, run: str, dependency: str) -> None:
        self.dependencies = {dependency}
        self.waiting = {(run, dependency): {"remediation-1"}}
        self.told: list[tuple[str, str, str]] = []
        self.ended_runs: list[str] = []

    def succeeded(self, run: str, dependency: str, span_id: str) -> None:
        self.told.append((run, dependency, span_id))

    def ended(self, trace_id: str, run: str, span_id: str) -> None:
        self.ended_runs.append(run)


def test_successes_are_passed_on_only_for_the_runs_a_remediation_waits_for() -> None:
    from tests.test_runs import TRACE, llm, payload, span

    watched_run = TRACE.hex()
    waits = _Waits(watched_run, "openai:gpt-4o")
    pipeline = Pipeline(load_policy(), recovery=waits)
    elsewhere = llm("fine")
    elsewhere.trace_id = b"\x22" * 16
    recovered = llm("fine")
    unwatched = span("execute_tool search", {"gen_ai.tool.name": "search"})
    pipeline.process_payload(payload(elsewhere, recovered, unwatched), received_ns=10**12)
    assert waits.told == [(watched_run, "openai:gpt-4o", recovered.span_id.hex())]
    assert waits.ended_runs == []  # no root span ended


def test_every_root_span_that_ended_ok_is_passed_on_as_its_runs_end() -> None:
    from tests.test_runs import TRACE, payload, span

    waits = _Waits(TRACE.hex(), "openai:gpt-4o")
    pipeline = Pipeline(load_policy(), recovery=waits)
    done = span("agent run", {}, parent=False)
    failed = span("agent run", {}, trace=b"\x33" * 16, parent=False)
    failed.status.code = failed.status.STATUS_CODE_ERROR
    # An event but no failure: judged with the failures, then found OK.
    noisy = span("agent run", {}, trace=b"\x44" * 16, parent=False)
    noisy.events.add(name="checkpoint")
    pipeline.process_payload(payload(done, failed, noisy), received_ns=10**12)
    assert waits.ended_runs == [TRACE.hex(), noisy.trace_id.hex()]
