"""The early reads (screens, dependency_of) agree with normalization.

The pipeline normalizes only what :mod:`supervisor.normalize.screen` passes,
so a span it wrongly drops is a missed failure. These tests hold the screens
to ``span.record().error is not None ⇒ screened(span)`` on spans
built from every convention's failure-bearing attributes, on the benchmark's
realistic spans, and (in ``test_normalize_real_instrumentation``) on spans
the real instrumentation packages wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from supervisor.normalize import (
    may_fail_quietly,
    read_spans,
    shows_failure_signal,
)
from tests.screening import assert_early_reads_agree
from tests.test_normalize_wire import any_value

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.spans import make_requests

TOOLS = ["get_weather", "search", "get_wether"]
REASONS = ["stop", "length", "LENGTH", "tool_calls", "content_filter", "max_tokens", "end_turn"]
OUTPUTS = [
    "Sunny, 21 C in Paris.",
    "Error: ValueError('boom')\n Please fix your mistakes.",
    "error: get_wether is not a valid tool, try one of [get_weather].",
    "Traceback (most recent call last):\n  File \"t.py\", line 1\nKeyError: 'city'",
    "ConnectionRefusedError: [Errno 111] refused",
    "TimeoutError('upstream')",
    "Tool execution error",
    '{"error": "quota exceeded"}',
    '{"isError": true, "content": [{"type": "text", "text": "denied"}]}',
    '{"status": "error", "message": "bad input"}',
    '{"results": [], "error": null}',
    '"Error: a JSON-encoded string"',
    "  \n  Exception: leading blanks",
    "",
]
ARGS = ['{"city": "Paris"}', "city=Paris", "", "[1, 2]", "{}"]


def _schema(name: str) -> str:
    return json.dumps({"type": "function", "function": {"name": name, "parameters": {}}})


def _message_list(parts: list[tuple[str, str]], reason: str) -> str:
    return json.dumps(
        [
            {
                "role": "assistant",
                "parts": [
                    {"type": "tool_call", "name": a, "arguments": b}
                    if kind == "call"
                    else {"type": "text", "content": a}
                    for kind, a, b in [(p[0], p[1], "{}") for p in parts]
                ],
                "finish_reason": reason,
            }
        ]
    )


tool = st.sampled_from(TOOLS)
reason = st.sampled_from(REASONS)
output = st.sampled_from(OUTPUTS)
args = st.sampled_from(ARGS)
index = st.integers(min_value=0, max_value=2)

#: (key, value) pairs of every convention that can make a span fail quietly.
pair = st.one_of(
    st.tuples(
        st.just("openinference.span.kind"),
        st.sampled_from(["LLM", "TOOL", "tool", "RETRIEVER", "CHAIN", "AGENT", "X"]),
    ),
    st.tuples(
        st.just("gen_ai.operation.name"),
        st.sampled_from(["chat", "execute_tool", "invoke_agent", "other"]),
    ),
    st.tuples(st.just("gen_ai.tool.name"), tool),
    st.tuples(st.just("gen_ai.request.model"), st.just("gpt-4o")),
    st.tuples(st.just("traceloop.span.kind"), st.sampled_from(["tool", "task", "agent"])),
    st.tuples(st.just("llm.request.type"), st.just("chat")),
    st.tuples(
        st.sampled_from(
            [
                "llm.finish_reason",
                "gen_ai.response.finish_reason",
                "gen_ai.response.stop_reason",
                "gen_ai.response.finish_reasons",
            ]
        ),
        st.one_of(reason, st.lists(reason, max_size=2)),
    ),
    st.tuples(
        st.sampled_from(["output.value", "gen_ai.tool.call.result", "traceloop.entity.output"]),
        output,
    ),
    st.tuples(index.map(lambda n: f"llm.output_messages.{n}.message.role"), st.just("assistant")),
    st.tuples(index.map(lambda n: f"llm.output_messages.{n}.message.content"), output),
    st.tuples(
        st.tuples(index, index).map(
            lambda nm: (
                f"llm.output_messages.{nm[0]}.message.tool_calls.{nm[1]}.tool_call.function.name"
            )
        ),
        tool,
    ),
    st.tuples(
        st.just("llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"), args
    ),
    st.tuples(
        st.just("llm.output_messages.0.message.contents.0.message_content.type"),
        st.sampled_from(["text", "tool_call"]),
    ),
    st.tuples(st.just("llm.output_messages.0.message.contents.0.message_content.text"), output),
    st.tuples(st.just("llm.output_messages.0.message.contents.0.tool_call.function.name"), tool),
    st.tuples(index.map(lambda n: f"llm.tools.{n}.tool.json_schema"), tool.map(_schema)),
    st.tuples(index.map(lambda n: f"llm.tools.{n}.tool.name"), tool),
    st.tuples(
        st.just("gen_ai.output.messages"),
        st.builds(
            _message_list,
            st.lists(
                st.tuples(st.sampled_from(["call", "text"]), st.sampled_from(TOOLS + OUTPUTS))
            ),
            reason,
        ),
    ),
    st.tuples(
        st.just("gen_ai.tool.definitions"),
        st.lists(tool, max_size=2).map(lambda names: json.dumps([{"name": n} for n in names])),
    ),
    st.tuples(index.map(lambda n: f"gen_ai.completion.{n}.role"), st.just("assistant")),
    st.tuples(index.map(lambda n: f"gen_ai.completion.{n}.content"), output),
    st.tuples(index.map(lambda n: f"gen_ai.completion.{n}.finish_reason"), reason),
    st.tuples(index.map(lambda n: f"gen_ai.completion.{n}.tool_calls.0.name"), tool),
    st.tuples(st.just("gen_ai.completion.0.tool_calls.0.arguments"), args),
    st.tuples(st.just("gen_ai.completion.0.function_call.name"), tool),
    st.tuples(index.map(lambda n: f"llm.request.functions.{n}.name"), tool),
    st.tuples(
        st.sampled_from(["http.response.status_code", "rpc.grpc.status_code"]),
        st.sampled_from([0, 200, 404, 503, "OK", "14"]),
    ),
    # What dependency_of reads: providers, models, tool names, hosts.
    st.tuples(
        st.sampled_from(["gen_ai.system", "gen_ai.provider.name", "llm.provider", "llm.system"]),
        st.sampled_from(["openai", "Anthropic", "azure_openai", ""]),
    ),
    st.tuples(
        st.sampled_from(
            [
                "gen_ai.response.model",
                "llm.model_name",
                "llm.request.model_name",
                "llm.response.model_name",
                "embedding.model_name",
            ]
        ),
        st.sampled_from(["gpt-4o", "claude-3-5-haiku", ""]),
    ),
    st.tuples(st.just("llm.invocation_parameters"), st.just('{"model": "gpt-4o-mini"}')),
    st.tuples(st.sampled_from(["tool.name", "traceloop.entity.name"]), tool),
    st.tuples(
        st.sampled_from(["url.full", "http.url", "server.address", "net.peer.name"]),
        st.sampled_from(["https://API.example.com:8443/v1?q=1", "db.internal", "", "not a url"]),
    ),
    st.tuples(st.sampled_from(["http.request.method", "http.method"]), st.just("GET")),
    st.tuples(st.sampled_from(["rpc.system", "rpc.service"]), st.just("grpc")),
)


Pairs = list[tuple[str, object]]


@st.composite
def openinference_span(draw: st.DrawFn) -> Pairs:
    kind = draw(st.sampled_from(["LLM", "llm", "TOOL", "RETRIEVER", "RERANKER", "CHAIN"]))
    pairs: Pairs = [("openinference.span.kind", kind)]
    if draw(st.booleans()):
        pairs.append(("output.value", draw(output)))
    if draw(st.booleans()):
        pairs.append(("llm.finish_reason", draw(reason)))
    for n in range(draw(st.integers(0, 2))):
        prefix = f"llm.output_messages.{n}.message."
        pairs.append((prefix + "role", "assistant"))
        if draw(st.booleans()):
            pairs.append((prefix + "content", draw(output)))
        for m in range(draw(st.integers(0, 2))):
            call = f"{prefix}tool_calls.{m}.tool_call.function."
            pairs += [(call + "name", draw(tool)), (call + "arguments", draw(args))]
        if draw(st.booleans()):
            item = f"{prefix}contents.0."
            pairs += [
                (item + "message_content.type", "tool_call"),
                (item + "tool_call.function.name", draw(tool)),
                (item + "tool_call.function.arguments", draw(args)),
            ]
    for n, name in enumerate(draw(st.lists(tool, max_size=2))):
        if draw(st.booleans()):
            pairs.append((f"llm.tools.{n}.tool.json_schema", _schema(name)))
        else:
            pairs.append((f"llm.tools.{n}.tool.name", name))
    return pairs


@st.composite
def genai_span(draw: st.DrawFn) -> Pairs:
    pairs: Pairs = []
    op = draw(st.sampled_from(["chat", "execute_tool", None]))
    if op is not None:
        pairs.append(("gen_ai.operation.name", op))
    if draw(st.booleans()):
        pairs.append(("gen_ai.tool.name", draw(tool)))
        pairs.append(("gen_ai.tool.call.result", draw(output)))
    else:
        pairs.append(("gen_ai.request.model", "gpt-4o"))
    if draw(st.booleans()):
        pairs.append(("gen_ai.response.finish_reasons", draw(st.lists(reason, max_size=2))))
    if draw(st.booleans()):
        parts = draw(st.lists(st.tuples(st.sampled_from(["call", "text"]), output), max_size=3))
        parts += [("call", name) for name in draw(st.lists(tool, max_size=2))]
        pairs.append(("gen_ai.output.messages", _message_list(parts, draw(reason))))
    if draw(st.booleans()):
        names = draw(st.lists(tool, max_size=2))
        pairs.append(("gen_ai.tool.definitions", json.dumps([{"name": n} for n in names])))
    return pairs


@st.composite
def openllmetry_span(draw: st.DrawFn) -> Pairs:
    pairs: Pairs = []
    kind = draw(st.sampled_from(["tool", "task", "agent", None]))
    if kind is not None:
        pairs += [("traceloop.span.kind", kind), ("traceloop.entity.output", draw(output))]
    else:
        pairs.append(("llm.request.type", "chat"))
    key = draw(st.sampled_from(["gen_ai.response.finish_reason", "gen_ai.response.stop_reason"]))
    if draw(st.booleans()):
        pairs.append((key, draw(reason)))
    for n in range(draw(st.integers(0, 2))):
        prefix = f"gen_ai.completion.{n}."
        pairs.append((prefix + "role", "assistant"))
        if draw(st.booleans()):
            pairs.append((prefix + "content", draw(output)))
        if draw(st.booleans()):
            pairs.append((prefix + "finish_reason", draw(reason)))
        for m in range(draw(st.integers(0, 2))):
            pairs += [
                (f"{prefix}tool_calls.{m}.name", draw(tool)),
                (f"{prefix}tool_calls.{m}.arguments", draw(args)),
            ]
        if draw(st.booleans()):
            pairs.append((prefix + "function_call.name", draw(tool)))
    for n, name in enumerate(draw(st.lists(tool, max_size=2))):
        pairs.append((f"llm.request.functions.{n}.name", name))
    return pairs


#: A span as one or two instrumentations wrote it, plus loose pairs.
span_pairs = st.tuples(
    st.lists(st.one_of(openinference_span(), genai_span(), openllmetry_span()), max_size=2),
    st.lists(pair, max_size=4),
).map(lambda t: [p for bundle in t[0] for p in bundle] + t[1])


def _request(
    pairs: list[tuple[str, object]], status: int, kind: int = 1
) -> ExportTraceServiceRequest:
    span = Span(
        trace_id=bytes(range(1, 17)),
        span_id=bytes(range(1, 9)),
        name="s",
        kind=kind,  # type: ignore[arg-type]  # the enum's int values
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in pairs],
        status=Status(code=status),  # type: ignore[arg-type]  # the enum's int values
    )
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    return request


@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(span_pairs, st.sampled_from([0, 0, 1, 2]), st.sampled_from([1, 2, 3]))
def test_early_reads_agree_with_normalization(pairs: Pairs, status: int, kind: int) -> None:
    """Failing spans pass a screen; dependency_of names the record's dependency."""
    assert_early_reads_agree(_request(pairs, status, kind).SerializeToString())


def test_realistic_spans_are_screened_and_most_successes_are_not() -> None:
    payloads = make_requests(4, 500, failure_rate=0.05, seed=3)
    failing = passed = total = 0
    for payload in payloads:
        assert_early_reads_agree(payload)
        for item in read_spans(payload):
            total += 1
            failing += item.record().error is not None
            passed += shows_failure_signal(item) or may_fail_quietly(item)
    # The screen is only worth having if it lets most successful spans through unread.
    assert failing <= passed < failing + (total - failing) // 2


def test_quiet_failures_are_found_only_by_the_second_screen() -> None:
    cases = {
        "swallowed tool error": [
            ("openinference.span.kind", "TOOL"),
            ("output.value", "Error: ValueError('boom')"),
        ],
        "unoffered tool": [
            ("openinference.span.kind", "LLM"),
            ("llm.output_messages.0.message.role", "assistant"),
            ("llm.output_messages.0.message.tool_calls.0.tool_call.function.name", "get_wether"),
            ("llm.tools.0.tool.json_schema", _schema("get_weather")),
        ],
        "cut-off answer in a message list": [
            ("gen_ai.operation.name", "chat"),
            ("gen_ai.output.messages", _message_list([("text", "The answer is")], "length")),
        ],
    }
    for name, pairs in cases.items():
        [item] = read_spans(_request(pairs, 0).SerializeToString())
        assert item.record().error is not None, name
        assert not shows_failure_signal(item), name
        assert may_fail_quietly(item), name
    ok = [("openinference.span.kind", "TOOL"), ("output.value", "Sunny, 21 C in Paris.")]
    [item] = read_spans(_request(ok, 0).SerializeToString())
    assert not shows_failure_signal(item) and not may_fail_quietly(item)


TOOL_SPANS: dict[str, Pairs] = {
    "openinference": [("openinference.span.kind", "TOOL")],
    "gen_ai": [("gen_ai.operation.name", "execute_tool"), ("gen_ai.tool.name", "search")],
    "openllmetry": [("traceloop.span.kind", "tool")],
}
TOOL_OUTPUT_KEYS = {
    "openinference": "output.value",
    "gen_ai": "gen_ai.tool.call.result",
    "openllmetry": "traceloop.entity.output",
}
FINISH_SPANS: dict[str, Pairs] = {
    "llm.finish_reason": [("openinference.span.kind", "LLM")],
    "gen_ai.response.finish_reasons": [("gen_ai.operation.name", "chat")],
    "gen_ai.response.finish_reason": [("llm.request.type", "chat")],
    "gen_ai.response.stop_reason": [("llm.request.type", "chat")],
    "gen_ai.completion.1.finish_reason": [
        ("gen_ai.completion.0.role", "assistant"),
        ("gen_ai.completion.1.role", "assistant"),
    ],
}


def test_every_tool_output_and_finish_reason_is_screened() -> None:
    """Exhaustive over the small tables above: each way a quiet failure is written."""
    for convention, pairs in TOOL_SPANS.items():
        for text in OUTPUTS:
            request = _request([*pairs, (TOOL_OUTPUT_KEYS[convention], text)], 0)
            assert_early_reads_agree(request.SerializeToString())
    for key, pairs in FINISH_SPANS.items():
        for value in REASONS:
            assert_early_reads_agree(_request([*pairs, (key, value)], 0).SerializeToString())


def test_dependency_of_names_what_the_record_names() -> None:
    client = [("http.request.method", "GET"), ("url.full", "https://API.example.com/v1")]
    cases = {
        "http:api.example.com": (client, 3),
        "": (client, 2),  # a server span: its own host is no dependency
        "openai:gpt-4o": (
            [
                ("gen_ai.operation.name", "chat"),
                ("gen_ai.system", "openai"),
                ("gen_ai.request.model", "gpt-4o"),
            ],
            3,
        ),
        "tool:search": ([("openinference.span.kind", "TOOL"), ("tool.name", "search")], 1),
    }
    for expected, (pairs, kind) in cases.items():
        [item] = read_spans(_request(pairs, 0, kind).SerializeToString())
        assert (expected, expected) == (item.dependency, item.record().dependency)
