"""A big request is judged in steps, and no crafted one costs more than its size.

The event loop that judges also answers ingest and the control API, so the
judging of a request's failures yields every few dozen of them
(:mod:`supervisor.judge.steps`); and attribution through spans that did not
fail looks at a bounded number of shorter spans per container, so a trace of
thousands of failing containers costs time in proportion to its size.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies import load_policy
from supervisor.judge import attribution, pipeline
from supervisor.judge.attribution import Candidate, propagates, signature
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.judge.steps import CHUNK, Steps, chunks, drive
from supervisor.records import Classification, ErrorEvidence, FailureClass, Role, SpanRecord
from supervisor.runs import RunTracker

TRACE = "0af7651916cd43dd8448eb211c80319c"


def failing_request(spans: int, failing_every: int, per_trace: int = 100) -> bytes:
    """One OTLP request: traces of ``per_trace`` tool spans, one in ``failing_every`` ERROR."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(key="service.name").value.string_value = "agent"
    scope = resource_spans.scope_spans.add()
    trace_id = os.urandom(16)
    for i in range(spans):
        if i % per_trace == 0:
            trace_id = os.urandom(16)
        span = scope.spans.add(
            trace_id=trace_id,
            span_id=os.urandom(8),
            name=f"tool call {i % 50}",
            start_time_unix_nano=1_700_000_000_000_000_000 + i,
            end_time_unix_nano=1_700_000_000_000_100_000 + i,
        )
        if i % failing_every == 0:
            span.status.code = 2
            span.status.message = "upstream timed out"
    return request.SerializeToString()


def _steps_of(steps: Steps[object], counted: list[int]) -> Iterator[int]:
    """How many counted calls each step of ``steps`` made."""
    while True:
        before = counted[0]
        try:
            next(steps)
        except StopIteration:
            yield counted[0] - before
            return
        yield counted[0] - before


def test_the_failures_of_a_big_request_are_judged_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3,000 failing spans in one request: before, all were classified, attributed and
    # decided in one step, holding the event loop for the whole of it.
    judged = Pipeline(load_policy(), runs=RunTracker())
    counted = [0]
    made = pipeline.failure_at

    def counting_failure_at(*args: object, **kwargs: object) -> object:
        counted[0] += 1
        return made(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "failure_at", counting_failure_at)

    def whole_batch() -> Steps[list[Outcome]]:
        outcomes, rest = yield from judged.first_pass_steps(failing_request(30_000, 10), 1)
        return outcomes + (yield from judged.rest_pass_steps(rest))

    per_step = list(_steps_of(whole_batch(), counted))

    assert counted[0] == 3000
    assert max(per_step) <= CHUNK


def test_a_request_judged_in_steps_decides_as_the_same_request_in_one_go() -> None:
    payload = failing_request(4000, 20, per_trace=40)
    in_one_go = Pipeline(load_policy(), runs=RunTracker())
    stepped = Pipeline(load_policy(), runs=RunTracker())
    expected = in_one_go.process_payload(payload, 1)

    first = stepped.first_pass_steps(payload, 1)
    steps = 0
    while True:
        try:
            next(first)
        except StopIteration as done:
            outcomes, rest = done.value
            break
        steps += 1
    outcomes += drive(stepped.rest_pass_steps(rest))

    assert steps > 4000 // CHUNK
    assert len(expected) == 200
    assert [(o.failure.span_id, o.failure.run_id, o.decision) for o in outcomes] == [
        (o.failure.span_id, o.failure.run_id, o.decision) for o in expected
    ]


def test_chunks_cover_every_item_once_in_order() -> None:
    assert [len(c) for c in chunks(range(130), 64)] == [64, 64, 2]
    assert list(itertools.chain.from_iterable(chunks(range(130), 64))) == list(range(130))
    assert list(chunks([], 64)) == []


# ------------------------------------------------- attribution through OK spans


_KINDS = [
    Classification(FailureClass.TRANSIENT, "rate_limit", "", "r"),
    Classification(FailureClass.TRANSIENT, "timeout", "", "t"),
    Classification(FailureClass.PERMANENT, "unknown", "", "u"),
]
_EVIDENCE = ErrorEvidence(status_error=True, status_message="failed")
_ids = itertools.count(1)


def _candidate(role: Role, start: int, end: int, kind: int) -> Candidate:
    record = SpanRecord(
        trace_id=TRACE,
        span_id=f"{next(_ids):016x}",
        parent_span_id="",
        name=role.value,
        service="agent",
        kind=0,
        start_ns=start,
        end_ns=end,
        role=role,
        dependency="",
        error=_EVIDENCE,
    )
    verdict = _KINDS[kind]
    return Candidate(record, TRACE, verdict, signature(record, verdict))


def _closest_inside(candidates: list[Candidate]) -> dict[str, str]:
    """Attribution through OK spans as its definition reads: the longest contained that fits."""
    for outer in candidates:
        if outer.attributed_to is not None or outer.record.role not in (Role.AGENT, Role.CHAIN):
            continue
        o = outer.record
        inside = [
            c
            for c in candidates
            if c is not outer
            and o.start_ns <= c.record.start_ns
            and c.record.end_ns <= o.end_ns
            and o.end_ns - o.start_ns > c.record.end_ns - c.record.start_ns
            and propagates(outer, c.sig)
            and not attribution._leads_to(c, outer)
        ]
        if inside:
            outer.attributed_to = max(inside, key=lambda c: c.record.end_ns - c.record.start_ns)
    return _links(candidates)


def _links(candidates: list[Candidate]) -> dict[str, str]:
    return {
        c.record.span_id: c.attributed_to.record.span_id
        for c in candidates
        if c.attributed_to is not None
    }


_spans = st.lists(
    st.tuples(
        st.sampled_from([Role.AGENT, Role.CHAIN, Role.LLM, Role.TOOL]),
        st.integers(0, 40),
        st.integers(0, 40),
        st.integers(0, len(_KINDS) - 1),
    ),
    min_size=2,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_spans)
def test_containers_take_the_longest_failing_span_inside_that_they_propagate(
    spans: list[tuple[Role, int, int, int]],
) -> None:
    def build() -> list[Candidate]:
        return [_candidate(role, a, a + length, kind) for role, a, length, kind in spans]

    reference = build()
    judged = build()
    for r, j in zip(reference, judged, strict=True):  # the same spans, both times
        j.record = r.record

    expected = _closest_inside(reference)
    attribution._attribute_through_ok_spans({c.record.span_id: c for c in judged})

    assert _links(judged) == expected


def test_a_trace_of_thousands_of_failing_containers_costs_linear_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3,000 failing agent spans in one trace, each inside the one before: every
    # container holds all the others. Before, each compared itself with all of
    # them (4.5 million comparisons, seconds of the event loop for one request).
    compared = [0]
    real = attribution.propagates

    def counting(parent: Candidate, child: attribution.Signature) -> bool:
        compared[0] += 1
        return real(parent, child)

    monkeypatch.setattr(attribution, "propagates", counting)
    nested = [_candidate(Role.AGENT, i, 10_000 - i, 0) for i in range(3000)]

    attribution._attribute_through_ok_spans({c.record.span_id: c for c in nested})

    assert compared[0] < 3000
    # Each container propagates the next one inside it, nearest first.
    assert all(c.attributed_to is nested[i + 1] for i, c in enumerate(nested[:-1]))
