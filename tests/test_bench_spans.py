"""The benchmark generator makes valid OTLP requests with the mix it promises."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

# `bench/` is a folder of scripts beside the packages, not an installed package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.spans import (  # noqa: E402 - needs the path above
    SESSION_MARK,
    SPAN_MARK,
    TRACE_MARK,
    make_requests,
    span_count,
    to_json_lines,
    with_fresh_ids,
)

N_REQUESTS = 8
PER_REQUEST = 250
ERROR = Status.StatusCode.STATUS_CODE_ERROR


def _spans(payload: bytes) -> list[tuple[str, Span]]:
    request = ExportTraceServiceRequest.FromString(payload)
    out: list[tuple[str, Span]] = []
    for rs in request.resource_spans:
        service = {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"]
        out.extend((service, span) for ss in rs.scope_spans for span in ss.spans)
    return out


def _attrs(span: Span) -> dict[str, object]:
    return {kv.key: kv.value for kv in span.attributes}


@pytest.fixture(scope="module")
def payloads() -> list[bytes]:
    return make_requests(N_REQUESTS, PER_REQUEST, failure_rate=0.05, seed=7)


def test_each_request_holds_exactly_the_requested_spans(payloads: list[bytes]) -> None:
    assert [span_count(p) for p in payloads] == [PER_REQUEST] * N_REQUESTS


def test_same_seed_gives_same_bytes() -> None:
    first = make_requests(2, 50, seed=3, start_ns=10**18)
    assert first == make_requests(2, 50, seed=3, start_ns=10**18)
    assert first != make_requests(2, 50, seed=4, start_ns=10**18)


def test_spans_have_10_to_20_attributes_and_llm_spans_with_tools_up_to_30(
    payloads: list[bytes],
) -> None:
    counts = sorted(len(span.attributes) for p in payloads for _, span in _spans(p))
    assert counts[0] >= 10 and counts[-1] <= 30
    assert 10 <= counts[len(counts) // 2] <= 20
    over = {
        _attrs(span)["openinference.span.kind"].string_value
        for p in payloads
        for _, span in _spans(p)
        if len(span.attributes) > 20
    }
    assert over == {"LLM"}  # the offered tools' schemas, one attribute each


def test_traces_are_whole_trees_with_one_root_and_known_parents(payloads: list[bytes]) -> None:
    for payload in payloads:
        by_trace: dict[bytes, list[Span]] = {}
        for _, span in _spans(payload):
            by_trace.setdefault(span.trace_id, []).append(span)
        assert len(by_trace) >= 10
        for spans in by_trace.values():
            ids = {s.span_id for s in spans}
            roots = [s for s in spans if not s.parent_span_id]
            orphans = [s for s in spans if s.parent_span_id and s.parent_span_id not in ids]
            assert (len(roots), orphans) == (1, [])
            assert {16} == {len(s.trace_id) for s in spans}
            assert {8} == {len(s.span_id) for s in spans}


def test_mix_of_conventions_and_span_kinds(payloads: list[bytes]) -> None:
    kinds: Counter[str] = Counter()
    for payload in payloads:
        for service, span in _spans(payload):
            attrs = _attrs(span)
            if "openinference.span.kind" in attrs:
                kinds[f"oi:{attrs['openinference.span.kind'].string_value}"] += 1  # type: ignore[attr-defined]
                assert service == "support-agent"
            elif "http.request.method" in attrs:
                kinds["http"] += 1
            else:
                operation = attrs["gen_ai.operation.name"].string_value  # type: ignore[attr-defined]
                kinds[f"genai:{operation}"] += 1
                assert service == "research-agent"
    total = N_REQUESTS * PER_REQUEST
    expected = {
        "oi:AGENT",
        "oi:CHAIN",
        "oi:LLM",
        "oi:TOOL",
        "http",
        "genai:invoke_agent",
        "genai:chat",
        "genai:execute_tool",
    }
    assert expected == set(kinds)
    assert all(count >= 0.02 * total for count in kinds.values()), kinds
    llm = kinds["oi:LLM"] + kinds["genai:chat"]
    assert 0.25 * total <= llm <= 0.6 * total


def test_originating_failures_are_exactly_the_stated_rate(payloads: list[bytes]) -> None:
    origins: list[Span] = []
    for payload in payloads:
        spans = [span for _, span in _spans(payload)]
        failed_parents = {s.parent_span_id for s in spans if s.status.code == ERROR}
        origins += [s for s in spans if s.status.code == ERROR and s.span_id not in failed_parents]
    assert round(0.05 * N_REQUESTS * PER_REQUEST) == len(origins)


def test_failures_look_like_real_provider_and_tool_errors(payloads: list[bytes]) -> None:
    types: Counter[str] = Counter()
    for payload in payloads:
        for _, span in _spans(payload):
            if span.status.code != ERROR:
                continue
            assert span.status.message or _attrs(span).get("error.type") is not None
            for event in span.events:
                event_attrs = {kv.key: kv.value.string_value for kv in event.attributes}
                assert event.name == "exception"
                types[event_attrs["exception.type"]] += 1
                if event_attrs["exception.type"] == "openai.RateLimitError":
                    assert "'code': 'rate_limit_exceeded'" in event_attrs["exception.message"]
                    assert event_attrs["exception.message"].startswith("Error code: 429 - ")
    for expected in ("openai.RateLimitError", "TimeoutError", "httpx.ReadTimeout"):
        assert types[expected] > 0, types
    assert types["anthropic.OverloadedError"] + types["anthropic.InternalServerError"] > 0


def test_http_503_is_a_status_code_and_its_tool_propagates_it(payloads: list[bytes]) -> None:
    seen = 0
    for payload in payloads:
        spans = {s.span_id: s for _, s in _spans(payload)}
        for span in spans.values():
            attrs = _attrs(span)
            code = attrs.get("http.response.status_code")
            if code is not None and code.int_value == 503:  # type: ignore[attr-defined]
                parent = spans[span.parent_span_id]
                assert (span.status.code, parent.status.code) == (ERROR, ERROR)
                seen += 1
    assert seen > 0


def test_fresh_ids_change_every_id_and_nothing_else(payloads: list[bytes]) -> None:
    original = payloads[0]
    copy = with_fresh_ids(original, 41)
    marks = (TRACE_MARK in copy, SPAN_MARK in copy, SESSION_MARK in copy)
    assert (len(original), False, False, False) == (len(copy), *marks)
    before, after = _spans(original), _spans(copy)
    assert [s.name for _, s in before] == [s.name for _, s in after]
    assert set() == {s.span_id for _, s in before} & {s.span_id for _, s in after}
    assert set() == {s.trace_id for _, s in before} & {s.trace_id for _, s in after}
    other = _spans(with_fresh_ids(original, 42))
    assert set() == {s.trace_id for _, s in other} & {s.trace_id for _, s in after}
    assert _sessions(before) and set() == _sessions(before) & _sessions(after)
    assert set() == _sessions(other) & _sessions(after)


def _sessions(spans: list[tuple[str, Span]]) -> set[str]:
    return {
        kv.value.string_value
        for _, span in spans
        for kv in span.attributes
        if kv.key in ("session.id", "gen_ai.conversation.id")
    }


def test_json_lines_use_hex_ids() -> None:
    payload = make_requests(1, 20, seed=5)
    lines = to_json_lines(payload).splitlines()
    first_span = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    request = ExportTraceServiceRequest.FromString(payload[0])
    assert len(lines) == 1
    assert request.resource_spans[0].scope_spans[0].spans[0].trace_id.hex() == first_span["traceId"]


@pytest.mark.parametrize(("n", "per", "rate"), [(-1, 5, 0.1), (1, 0, 0.1), (1, 5, 1.5)])
def test_bad_arguments_are_refused(n: int, per: int, rate: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        make_requests(n, per, failure_rate=rate)
