"""Normalization edge cases: wrong types, missing and huge values, unicode, old and new names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

import supervisor.normalize as normalize
from supervisor.normalize import attributes, evidence, genai, http_rpc
from supervisor.normalize.attributes import (
    MAX_ATTRIBUTES,
    MAX_MESSAGE_CHARS,
    MAX_OUTPUT_CHARS,
    MAX_VALUE_CHARS,
    args_digest,
    as_int,
    convert_attributes,
)
from supervisor.records import ErrorEvidence, Role, SpanRecord

RESOURCE: Mapping[str, Any] = MappingProxyType({"service.name": "agent"})
CLIENT, SERVER, INTERNAL = 3, 2, 1


# -- building spans ----------------------------------------------------------


def _set(target: AnyValue, value: Any) -> None:
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _set(target.kvlist_value.values.add(key=key).value, item)
    elif isinstance(value, (list, tuple)):
        target.array_value.SetInParent()
        for item in value:
            _set(target.array_value.values.add(), item)
    elif value is None:
        pass
    else:  # pragma: no cover - test helper misuse
        raise TypeError(value)


def _kvs(attrs: Mapping[str, Any]) -> list[KeyValue]:
    out = []
    for key, value in attrs.items():
        kv = KeyValue(key=key)
        _set(kv.value, value)
        out.append(kv)
    return out


def make_span(
    attrs: Mapping[str, Any] | None = None,
    *,
    name: str = "span",
    kind: int = INTERNAL,
    status: tuple[int, str] = (0, ""),
    events: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> Span:
    span = Span(
        trace_id=bytes(range(16)),
        span_id=bytes(range(8)),
        name=name,
        kind=kind,  # type: ignore[arg-type]
        start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=1_700_000_001_000_000_000,
        status=Status(code=status[0], message=status[1]),  # type: ignore[arg-type]
    )
    span.attributes.extend(_kvs(attrs or {}))
    for event_name, event_attrs in events:
        span.events.add(name=event_name).attributes.extend(_kvs(event_attrs))
    return span


def norm(attrs: Mapping[str, Any] | None = None, **kwargs: Any) -> SpanRecord:
    return normalize.normalize_span(make_span(attrs, **kwargs), RESOURCE, "agent")


def err(record: SpanRecord) -> ErrorEvidence:
    assert record.error is not None, "expected error evidence"
    return record.error


ERROR = (2, "")


# -- attribute conversion ----------------------------------------------------


def test_every_anyvalue_type_converts_to_plain_python() -> None:
    kvs = _kvs(
        {
            "s": "text",
            "empty": "",
            "b": True,
            "i": -7,
            "d": 0.5,
            "raw": b"\x00\xff",
            "arr": ["a", 1, False],
            "map": {"k": "v", "n": {"deep": 1}},
        }
    )
    converted = convert_attributes([*kvs, KeyValue(key="unset")]).values
    assert converted == {
        "s": "text",
        "empty": "",
        "b": True,
        "i": -7,
        "d": 0.5,
        "raw": b"\x00\xff",
        "arr": ("a", 1, False),
        "map": {"k": "v", "n": {"deep": 1}},
        "unset": None,
    }


def test_huge_string_is_truncated_but_its_full_text_stays_readable() -> None:
    huge = "x" * (MAX_VALUE_CHARS * 3)
    converted = convert_attributes(_kvs({"big": huge, "small": "y"}))
    assert (MAX_VALUE_CHARS, huge, "y") == (
        len(str(converted.values["big"])),
        converted.full("big"),
        converted.full("small"),
    )


def test_attribute_count_array_length_and_depth_are_bounded_and_keys_kept_whole() -> None:
    many = convert_attributes(_kvs({f"k{i}": i for i in range(MAX_ATTRIBUTES + 50)})).values
    long_key = convert_attributes(_kvs({"k" * 10_000: 1})).values
    long_array = convert_attributes(_kvs({"a": list(range(1000))})).values["a"]
    nested: Any = "leaf"
    for _ in range(10):
        nested = [nested]
    deep = convert_attributes(_kvs({"n": nested})).values["n"]
    depth = 0
    while isinstance(deep, tuple):
        depth += 1
        deep = deep[0]
    assert (
        len(many),
        [len(k) for k in long_key],
        len(long_array),  # type: ignore[arg-type]
        depth,
        deep,
    ) == (MAX_ATTRIBUTES, [10_000], 128, attributes.MAX_DEPTH, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (12, 12),
        ("12", 12),
        (" -3 ", -3),
        (3.0, 3),
        (3.5, None),
        (True, None),
        ("ten", None),
        (None, None),
        ("9" * 40, None),
    ],
)
def test_as_int_accepts_ints_and_integral_text_only(value: object, expected: int | None) -> None:
    assert expected == as_int(value)


def test_args_digest_is_canonical_short_and_stable() -> None:
    a = args_digest('{"city": "Paris", "unit": "C"}')
    b = args_digest('{ "unit":"C","city":"Paris" }')
    c = args_digest({"unit": "C", "city": "Paris"})
    assert (len(a), a == b, a == c) == (16, True, True)
    assert args_digest("not json") != args_digest("not  json")
    assert args_digest("") == ""


# -- roles, dependencies, conventions ----------------------------------------


def test_span_without_known_attributes_is_other_with_no_dependency() -> None:
    record = norm({"custom": 1}, name="do-work")
    assert (
        record.role,
        record.dependency,
        record.conventions,
        record.error,
        record.service,
        record.trace_id,
        record.span_id,
        record.parent_span_id,
    ) == (
        Role.OTHER,
        "",
        (),
        None,
        "agent",
        "000102030405060708090a0b0c0d0e0f",
        "0001020304050607",
        "",
    )


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        (
            {
                "gen_ai.system": "openai",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.usage.prompt_tokens": 5,
                "gen_ai.usage.completion_tokens": 2,
            },
            ("openai:gpt-4o", 5, 2),
        ),
        (
            {
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.usage.input_tokens": 5,
                "gen_ai.usage.output_tokens": 2,
            },
            ("openai:gpt-4o", 5, 2),
        ),
        (
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.system": "Azure OpenAI",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.response.model": "gpt-4o-2024-08-06",
            },
            ("azure.ai.openai:gpt-4o-2024-08-06", None, None),
        ),
        (
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "az.ai.openai",
                "gen_ai.request.model": "m",
            },
            ("azure.ai.openai:m", None, None),
        ),
        ({"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}, ("unknown:m", None, None)),
        (
            {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "Anthropic"},
            ("anthropic:unknown", None, None),
        ),
        (
            {
                "openinference.span.kind": "LLM",
                "llm.provider": "azure",
                "llm.system": "openai",
                "llm.model_name": "gpt-4o",
                "llm.token_count.prompt": 7.0,
            },
            ("azure.ai.openai:gpt-4o", 7, None),
        ),
        (
            {
                "openinference.span.kind": "EMBEDDING",
                "llm.system": "openai",
                "embedding.model_name": "text-embedding-3-small",
            },
            ("openai:text-embedding-3-small", None, None),
        ),
        (
            {
                "llm.request.type": "chat",
                "gen_ai.system": "Bedrock",
                "gen_ai.request.model": "claude",
            },
            ("aws.bedrock:claude", None, None),
        ),
    ],
)
def test_llm_dependency_tokens_old_and_new_names(
    attrs: dict[str, Any], expected: tuple[str, int | None, int | None]
) -> None:
    record = norm(attrs, kind=CLIENT)
    assert (Role.LLM, *expected) == (
        record.role,
        record.dependency,
        record.input_tokens,
        record.output_tokens,
    )


@pytest.mark.parametrize(
    ("attrs", "role"),
    [
        ({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner"}, Role.AGENT),
        ({"gen_ai.agent.name": "planner"}, Role.AGENT),
        ({"gen_ai.operation.name": "invoke_workflow"}, Role.CHAIN),
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"}, Role.TOOL),
        ({"openinference.span.kind": "AGENT"}, Role.AGENT),
        ({"openinference.span.kind": "chain"}, Role.CHAIN),
        ({"openinference.span.kind": "RETRIEVER"}, Role.TOOL),
        ({"openinference.span.kind": "GUARDRAIL"}, Role.OTHER),
        ({"openinference.span.kind": 5}, Role.OTHER),
        ({"traceloop.span.kind": "workflow", "traceloop.entity.name": "w"}, Role.CHAIN),
        ({"traceloop.span.kind": "task"}, Role.CHAIN),
        ({"traceloop.span.kind": "agent"}, Role.AGENT),
        ({"traceloop.span.kind": "tool", "traceloop.entity.name": "t"}, Role.TOOL),
        ({"rpc.system": "grpc", "rpc.service": "Weather"}, Role.HTTP),
        ({"http.request.method": "GET"}, Role.HTTP),
    ],
)
def test_roles_per_convention(attrs: dict[str, Any], role: Role) -> None:
    assert role == norm(attrs).role


def test_first_convention_wins_and_all_are_listed() -> None:
    record = norm(
        {
            "openinference.span.kind": "LLM",
            "llm.model_name": "from-openinference",
            "llm.system": "openai",
            "gen_ai.request.model": "from-genai",
            "http.response.status_code": 200,
        },
        kind=CLIENT,
    )
    assert (
        record.conventions,
        record.dependency,
        record.role,
    ) == (("openinference", "gen_ai", "http"), "openai:from-openinference", Role.LLM)


@pytest.mark.parametrize(
    ("attrs", "kind", "expected"),
    [
        (
            {"http.request.method": "GET", "server.address": "API.Example.com"},
            CLIENT,
            "http:api.example.com",
        ),
        (
            {"http.method": "GET", "net.peer.name": "old.example.com"},
            CLIENT,
            "http:old.example.com",
        ),
        (
            {
                "http.request.method": "GET",
                "url.full": "https://user:pw@svc.example.com:8443/a?b#c",
            },
            CLIENT,
            "http:svc.example.com",
        ),
        ({"http.method": "POST", "http.url": "http://[::1]:8080/x"}, CLIENT, "http:::1"),
        ({"http.request.method": "GET", "url.full": "/relative"}, CLIENT, ""),
        ({"http.request.method": "GET", "server.address": "me.example.com"}, SERVER, ""),
        ({"rpc.system": "grpc", "rpc.service": "weather.Weather"}, CLIENT, "http:weather.Weather"),
    ],
)
def test_http_dependency_host(attrs: dict[str, Any], kind: int, expected: str) -> None:
    assert expected == norm(attrs, kind=kind).dependency


def test_unicode_names_and_text_survive() -> None:
    record = norm(
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "模型-✓",
            "gen_ai.output.messages": json.dumps(
                [
                    {
                        "role": "assistant",
                        "parts": [{"type": "text", "content": "Il fait très beau ☀️"}],
                    }
                ]
            ),
            "gen_ai.conversation.id": "会话-1",
        }
    )
    assert (
        record.dependency,
        record.output_text,
        record.session_id,
        record.run_id,
    ) == ("openai:模型-✓", "Il fait très beau ☀️", "会话-1", "会话-1")


def test_session_id_names() -> None:
    assert [
        norm({"openinference.span.kind": "CHAIN", "session.id": "s-oi"}).session_id,
        norm({"gen_ai.operation.name": "chat", "gen_ai.conversation.id": "c-genai"}).session_id,
        norm(
            {
                "traceloop.span.kind": "workflow",
                "traceloop.association.properties.session_id": "s-tl",
            }
        ).session_id,
        norm({"gen_ai.operation.name": "chat", "gen_ai.conversation.id": 42.5}).session_id[:0],
    ] == ["s-oi", "c-genai", "s-tl", ""]


# -- output text and tool calls ----------------------------------------------


def test_output_text_is_bounded() -> None:
    text = "é" * (MAX_OUTPUT_CHARS * 4)
    record = norm(
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.output.messages": json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": text}]}]
            ),
        }
    )
    assert len(record.output_text) == MAX_OUTPUT_CHARS


def test_structured_genai_messages_and_tool_definitions() -> None:
    record = norm(
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "m",
            "gen_ai.output.messages": [
                {
                    "role": "assistant",
                    "parts": [
                        {"type": "text", "content": "calling"},
                        {"type": "tool_call", "name": "lookup", "arguments": {"q": "x"}},
                    ],
                    "finish_reason": "tool_calls",
                }
            ],
            "gen_ai.tool.definitions": [{"type": "function", "name": "search"}],
        }
    )
    assert (
        record.output_text,
        err(record).invalid_tool_calls,
        err(record).finish_reasons,
    ) == ("calling", ("unknown_tool:lookup",), ("tool_calls",))


def test_openinference_anthropic_style_contents_and_tools() -> None:
    prefix = "llm.output_messages.0.message.contents."
    record = norm(
        {
            "openinference.span.kind": "LLM",
            "llm.provider": "anthropic",
            "llm.response.model_name": "claude",
            "llm.output_messages.0.message.role": "assistant",
            prefix + "0.message_content.type": "text",
            prefix + "0.message_content.text": "Let me look.",
            prefix + "1.message_content.type": "tool_use",
            prefix + "1.tool_call.function.name": "get_wether",
            prefix + "1.tool_call.function.arguments": '{"city": "P"}',
            "llm.tools.0.tool.json_schema": json.dumps({"name": "get_weather"}),
            "llm.tools.1.tool.json_schema": json.dumps(
                {"type": "function", "function": {"name": "get_time"}}
            ),
        }
    )
    assert (
        record.output_text,
        err(record).invalid_tool_calls,
        record.dependency,
    ) == ("Let me look.", ("unknown_tool:get_wether",), "anthropic:claude")


def test_openllmetry_indexed_completions_functions_and_finish_reasons() -> None:
    record = norm(
        {
            "llm.request.type": "chat",
            "gen_ai.system": "OpenAI",
            "gen_ai.request.model": "gpt-3.5-turbo",
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": "hi",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.finish_reason": "tool_calls",
            "gen_ai.completion.0.tool_calls.0.name": "get_weather",
            "gen_ai.completion.0.tool_calls.0.arguments": '{"city": ',
            "gen_ai.completion.0.tool_calls.1.name": "get_wether",
            "gen_ai.completion.0.tool_calls.1.arguments": "{}",
            "llm.request.functions.0.name": "get_weather",
            "llm.usage.total_tokens": 30,
        }
    )
    assert (
        record.role,
        record.dependency,
        err(record).invalid_tool_calls,
        tuple(sorted(record.conventions, reverse=True)),
    ) == (
        Role.LLM,
        "openai:gpt-3.5-turbo",
        ("bad_arguments:get_weather", "unknown_tool:get_wether"),
        ("openllmetry", "gen_ai"),
    )


def test_openllmetry_completion_text_and_length() -> None:
    record = norm(
        {
            "llm.request.type": "completion",
            "gen_ai.completion.0.content": "cut",
            "gen_ai.completion.0.finish_reason": "length",
        }
    )
    assert (record.output_text, err(record).finish_reasons) == ("cut", ("length",))


def test_traceloop_tool_span_with_json_encoded_output_that_swallowed_an_error() -> None:
    record = norm(
        {
            "traceloop.span.kind": "tool",
            "traceloop.entity.name": "get_weather",
            "traceloop.entity.input": json.dumps({"args": [], "kwargs": {"city": "Atlantis"}}),
            "traceloop.entity.output": json.dumps("Error: city not found"),
        }
    )
    assert (
        record.dependency,
        err(record).swallowed,
        err(record).exception_message,
        len(record.tool_args_digest),
    ) == ("tool:get_weather", True, "city not found", 16)


@pytest.mark.parametrize(
    ("calls", "offered", "expected"),
    [
        ([("a", "{}")], frozenset({"a"}), ()),
        ([("a", "")], frozenset({"a"}), ()),
        ([("a", None)], None, ()),
        ([("a", {"x": 1})], None, ()),
        ([("b", "{}")], frozenset({"a"}), ("unknown_tool:b",)),
        ([("b", "{}")], frozenset(), ()),
        ([("b", "{}")], None, ()),
        ([("a", "[1, 2]")], None, ("bad_arguments:a",)),
        ([("a", "{oops")], None, ("bad_arguments:a",)),
        ([("a", 5)], None, ("bad_arguments:a",)),
        ([("b", "{oops")], frozenset({"a"}), ("unknown_tool:b", "bad_arguments:b")),
    ],
)
def test_check_tool_calls(
    calls: list[tuple[str, object]], offered: frozenset[str] | None, expected: tuple[str, ...]
) -> None:
    assert expected == evidence.check_tool_calls(calls, offered)


# -- failure signs -----------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "kind", "failing"),
    [
        ({"http.response.status_code": 200}, CLIENT, False),
        ({"http.response.status_code": 404}, CLIENT, True),
        ({"http.status_code": "503"}, CLIENT, True),
        ({"http.response.status_code": 404}, SERVER, False),
        ({"http.response.status_code": 500}, SERVER, True),
        ({"rpc.system": "grpc", "rpc.grpc.status_code": 0}, CLIENT, False),
        ({"rpc.system": "grpc", "rpc.grpc.status_code": 14}, CLIENT, True),
        (
            {"gen_ai.operation.name": "chat", "gen_ai.response.finish_reasons": ["stop"]},
            CLIENT,
            False,
        ),
        (
            {"gen_ai.operation.name": "chat", "gen_ai.response.finish_reasons": ["STOP", "SAFETY"]},
            CLIENT,
            True,
        ),
        (
            {"gen_ai.operation.name": "chat", "gen_ai.response.finish_reasons": "content_filter"},
            CLIENT,
            True,
        ),
        ({"openinference.span.kind": "LLM", "llm.finish_reason": "refusal"}, CLIENT, True),
        ({"error.type": "timeout"}, CLIENT, True),
    ],
)
def test_failure_signs_without_error_status(
    attrs: dict[str, Any], kind: int, failing: bool
) -> None:
    assert failing == (norm(attrs, kind=kind).error is not None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (14, 14),
        ("14", 14),
        ("UNAVAILABLE", 14),
        ("unavailable", 14),
        ("StatusCode.DEADLINE_EXCEEDED", 4),
        ("RESOURCE_EXHAUSTED", 8),
        ("CANCELED", 1),
        ("NOT_A_CODE", None),
        (99, None),
        (-1, None),
        (True, None),
    ],
)
def test_grpc_codes_by_number_and_name(value: object, expected: int | None) -> None:
    assert expected == http_rpc.grpc_code(value)


@pytest.mark.parametrize(
    "key", ["rpc.grpc.status_code", "rpc.response.status_code", "rpc.status_code"]
)
def test_grpc_status_attribute_names(key: str) -> None:
    value: object = 14 if key == "rpc.grpc.status_code" else "UNAVAILABLE"
    record = norm({"rpc.system": "grpc", key: value}, kind=CLIENT)
    assert (err(record).grpc_code, record.conventions) == (14, ("rpc",))


def test_error_status_with_exception_event_and_bounded_messages() -> None:
    huge = "boom " * 5000
    record = norm(
        {"gen_ai.operation.name": "chat"},
        status=(2, huge),
        events=[
            ("exception", {"exception.type": "builtins.ValueError", "exception.message": huge})
        ],
    )
    ev = err(record)
    assert (
        ev.status_error,
        ev.exception_type,
        len(ev.exception_message),
        len(ev.status_message),
    ) == (True, "builtins.ValueError", MAX_MESSAGE_CHARS, MAX_MESSAGE_CHARS)


def test_exception_event_is_found_among_many_stream_events() -> None:
    events: list[tuple[str, Mapping[str, Any]]] = [("gen_ai.content.completion.chunk", {})] * 100
    events.append(
        (
            "exception",
            {
                "exception.type": "openai.APIConnectionError",
                "exception.message": "Connection error.",
            },
        )
    )
    record = norm({"gen_ai.operation.name": "chat"}, events=events)
    assert (
        err(record).exception_type,
        err(record).exception_message,
        err(record).status_error,
    ) == ("openai.APIConnectionError", "Connection error.", False)


def test_exception_type_falls_back_to_the_stacktrace() -> None:
    stack = (
        'Traceback (most recent call last):\n  File "a.py", line 1, in f\n'
        "httpx.ReadTimeout: timed out"
    )
    record = norm({}, status=ERROR, events=[("exception", {"exception.stacktrace": stack})])
    assert err(record).exception_type == "httpx.ReadTimeout"


@pytest.mark.parametrize(
    ("error_type", "expected"),
    [
        ("<class 'openai.RateLimitError'>", "openai.RateLimitError"),
        ("RateLimitError", "RateLimitError"),
        ("httpx.ReadTimeout", "httpx.ReadTimeout"),
        ("timeout", ""),
        ("500", ""),
        ("_OTHER", ""),
        ("Some Error", ""),
    ],
)
def test_error_type_attribute(error_type: str, expected: str) -> None:
    ev = err(norm({"error.type": error_type}, status=ERROR))
    assert (expected, error_type) == (ev.exception_type, ev.error_type)


def test_status_message_prefix_names_the_exception() -> None:
    ev = err(norm({}, status=(2, "APITimeoutError: Request timed out.")))
    plain = err(norm({}, status=(2, "Error code: 503 - upstream down")))
    assert (
        ev.exception_type,
        ev.exception_message,
        plain.exception_type,
        plain.http_status,
    ) == ("APITimeoutError", "Request timed out.", "", 503)


# -- free text ---------------------------------------------------------------

OPENAI_V1_QUOTA = (
    "Error code: 429 - {'error': {'message': 'You exceeded your current quota, please check "
    "your plan and billing details.', 'type': 'insufficient_quota', 'param': None, "
    "'code': 'insufficient_quota'}}"
)
ANTHROPIC_OVERLOADED = (
    "Error code: 529 - {'type': 'error', 'error': {'type': 'overloaded_error', "
    "'message': 'Overloaded'}, 'request_id': 'req_1'}"
)


@pytest.mark.parametrize(
    ("text", "status", "code"),
    [
        (OPENAI_V1_QUOTA, 429, "insufficient_quota"),
        (ANTHROPIC_OVERLOADED, 529, "overloaded_error"),
        # anthropic-python >= 2.17: the status, the message, a trailer of the response.
        (
            "529 Overloaded (request_id: req_1, path: /v1/messages, type: overloaded_error)",
            529,
            "overloaded_error",
        ),
        (
            "RateLimitError: 429 Number of request tokens has exceeded your per-minute rate "
            "limit (error_code: tokens_per_minute, request_id: req_2, path: /v1/messages, "
            "type: rate_limit_error)",
            429,
            "rate_limit_error",
        ),
        ("529 status code (no body) (path: /v1/messages)", 529, ""),
        ("finished 200 steps (path: /tmp/run)", None, ""),
        (
            "Error code: 503 - {'error': {'message': 'down', 'type': 'server_error', "
            "'param': None, 'code': None}}",
            503,
            "server_error",
        ),
        (
            '{"error": {"code": 429, "message": "Resource exhausted", '
            '"status": "RESOURCE_EXHAUSTED"}}',
            None,
            "RESOURCE_EXHAUSTED",
        ),
        (
            "Error code: 400 - This model's maximum context length is 8192 tokens.",
            400,
            "context_length_exceeded",
        ),
        (
            "Error code: 400 - prompt is too long: 210000 tokens > 200000 maximum",
            400,
            "context_length_exceeded",
        ),
        (
            "Error code: 404 - The model `gpt-9` does not exist or you do not have access to it.",
            404,
            "model_not_found",
        ),
        ("Client error '429 Too Many Requests' for url 'https://x'", 429, ""),
        ("503 Server Error: Service Unavailable for url: https://x", 503, ""),
        ("upstream returned status_code=502", 502, ""),
        ("HTTP/1.1 504 Gateway Timeout", 504, ""),
        ("Error code: 999 - weird", None, ""),
        ("nothing to see", None, ""),
    ],
)
def test_http_status_and_provider_code_from_text(text: str, status: int | None, code: str) -> None:
    assert (status, code) == (
        evidence.http_status_from_text(text),
        evidence.provider_code_from_text(text),
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Rate limit reached ... Please try again in 1.5s. Visit https://x", 1.5),
        ("Please try again in 20ms.", 0.02),
        ("Please try again in 1m3s.", 63.0),
        ("Please try again in 6m0s.", 360.0),
        ("Please retry after 20 seconds.", 20.0),
        ("Retry-After: 3", 3.0),
        ("try again later", None),
        ("Please try again in 99999999h", None),
    ],
)
def test_retry_after_from_text(text: str, expected: float | None) -> None:
    assert expected == evidence.retry_after_from_text(text)


def test_retry_after_from_captured_headers() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    now_ns = int(now.timestamp() * 1e9)
    cases: list[dict[str, Any]] = [
        {
            "http.response.header.retry-after-ms": ("1500",),
            "http.response.header.retry-after": ("9",),
        },
        {"http.response.header.retry-after": ("2",)},
        {"retry-after": 4},
        {
            "http.response.header.x-ratelimit-reset-requests": "1s",
            "http.response.header.x-ratelimit-reset-tokens": "6m0s",
        },
        {"http.response.header.anthropic-ratelimit-requests-reset": "2025-01-01T12:00:30Z"},
        {"http.response.header.retry-after": "Wed, 01 Jan 2025 12:00:10 GMT"},
        {"http.response.header.retry-after": "garbage"},
        {},
    ]
    assert [evidence.retry_after_from_attributes(c, now_ns) for c in cases] == [
        1.5,
        2.0,
        4.0,
        360.0,
        30.0,
        10.0,
        None,
        None,
    ]


def test_retry_after_headers_reach_the_evidence() -> None:
    record = norm(
        {"gen_ai.operation.name": "chat", "http.response.header.retry-after": ("7",)},
        status=(2, "Error code: 429 - Please try again in 1s."),
    )
    assert (err(record).retry_after_s, err(record).http_status) == (7.0, 429)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("RateLimitError: Error code: 429", ("RateLimitError", "Error code: 429")),
        (
            "openai.APITimeoutError: Request timed out.",
            ("openai.APITimeoutError", "Request timed out."),
        ),
        ("ReadTimeout: timed out", ("ReadTimeout", "timed out")),
        ("Error code: 429 - x", ("", "Error code: 429 - x")),
        ("Note: something", ("", "Note: something")),
    ],
)
def test_split_exception_prefix(text: str, expected: tuple[str, str]) -> None:
    assert expected == evidence.split_exception_prefix(text)


# -- swallowed errors --------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Error: city not found", ("", "city not found", ())),
        ("error: quota exceeded", ("", "quota exceeded", ())),
        ("Exception: boom", ("", "boom", ())),
        ("Error: ValueError('boom')\n Please fix your mistakes.", ("ValueError", "boom", ())),
        ("Error: KeyError: 'x'", ("KeyError", "'x'", ())),
        (
            "Error: get_wether is not a valid tool, try one of [get_weather, get_time].",
            (
                "",
                "get_wether is not a valid tool, try one of [get_weather, get_time].",
                ("unknown_tool:get_wether",),
            ),
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "ZeroDivisionError: division by zero",
            ("ZeroDivisionError", "division by zero", ()),
        ),
        ("ValueError: invalid city", ("ValueError", "invalid city", ())),
        ("<ToolException>: service down", ("ToolException", "service down", ())),
        (
            "requests.exceptions.ConnectionError('refused')",
            ("requests.exceptions.ConnectionError", "refused", ()),
        ),
        ("Tool execution error", ("ToolException", "Tool execution error", ())),
        ('{"error": "city not found"}', ("", "city not found", ())),
        (
            '{"error": {"type": "not_found", "message": "no such city"}}',
            ("not_found", "no such city", ()),
        ),
        (
            '{"isError": true, "content": [{"type": "text", "text": "TimeoutError: slow"}]}',
            ("TimeoutError", "slow", ()),
        ),
        ('{"status": "error", "content": "Tool failed", "type": "tool"}', ("", "Tool failed", ())),
    ],
)
def test_swallowed_error_patterns(output: str, expected: tuple[str, str, tuple[str, ...]]) -> None:
    found = evidence.detect_swallowed(output)
    assert found is not None
    assert expected == (found.exception_type, found.message, found.invalid_tool_calls)


@pytest.mark.parametrize(
    "output",
    [
        "Sunny, 21C",
        "No errors were found in the document.",
        "Error rates fell by 5% last quarter.",
        "The ValueError class is raised when an argument is bad.",
        "Errors: none",
        '{"error": null, "result": 42}',
        '{"error": "", "data": [1]}',
        '{"result": "ok", "error": "partial"}',
        '{"status": "ok"}',
        "Here is the log:\n" + "x" * 300 + "\nTraceback (most recent call last):\nValueError: old",
        "",
        "   ",
        "[1, 2, 3]",
    ],
)
def test_prose_and_normal_output_are_not_swallowed_errors(output: str) -> None:
    assert None is evidence.detect_swallowed(output)


def test_swallowed_check_applies_to_tool_spans_with_ok_status_only() -> None:
    tool = {"openinference.span.kind": "TOOL", "tool.name": "t", "output.value": "Error: nope"}
    chain = {"openinference.span.kind": "CHAIN", "output.value": "Error: nope"}
    failed = norm(tool, status=(2, "ToolException: nope"))
    assert (
        err(norm(tool)).swallowed,
        norm(chain).error,
        err(failed).swallowed,
    ) == (True, None, False)


# -- provider names ----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("openai", "openai"),
        ("OpenAI", "openai"),
        ("azure", "azure.ai.openai"),
        ("az.ai.openai", "azure.ai.openai"),
        ("azure.ai.inference", "azure.ai.inference"),
        ("Anthropic", "anthropic"),
        ("mistralai", "mistral_ai"),
        ("vertexai", "gcp.vertex_ai"),
        ("xai", "x_ai"),
        ("Some New Provider", "some new provider"),
        (7, "7"),
        (None, ""),
        (True, ""),
    ],
)
def test_provider_names_are_normalised(raw: object, expected: str) -> None:
    assert expected == genai.normalize_provider(raw)


# -- requests, robustness ----------------------------------------------------


def test_normalize_request_walks_every_resource_and_scope() -> None:
    request = ExportTraceServiceRequest()
    first = request.resource_spans.add()
    first.resource.attributes.extend(_kvs({"service.name": "alpha", "host.name": "h"}))
    first.scope_spans.add().spans.extend([make_span(name="a1"), make_span(name="a2")])
    first.scope_spans.add().spans.extend([make_span(name="a3")])
    second = request.resource_spans.add()
    second.resource.attributes.extend(_kvs({"service.name": 12}))
    second.scope_spans.add().spans.extend([make_span(name="b1")])
    third = request.resource_spans.add()
    third.scope_spans.add().spans.extend([make_span(name="c1")])
    records = normalize.normalize_request(request)
    assert [(r.name, r.service) for r in records] == [
        ("a1", "alpha"),
        ("a2", "alpha"),
        ("a3", "alpha"),
        ("b1", "12"),
        ("c1", "unknown_service"),
    ]
    assert records[0].resource_attributes["host.name"] == "h"
    assert records[0].resource_attributes is records[2].resource_attributes


def test_records_are_read_only() -> None:
    record = norm({"gen_ai.operation.name": "chat"})
    with pytest.raises(TypeError):
        record.attributes["x"] = 1  # type: ignore[index]


class _Broken:
    """A span whose attributes cannot be read (stands for any internal failure)."""

    trace_id = b"\x01" * 16
    span_id = b"\x02" * 8
    parent_span_id = b""
    name = "broken"
    kind = 3
    start_time_unix_nano = 1
    end_time_unix_nano = 2
    status = Status(code=2, message="it failed")  # type: ignore[arg-type]

    @property
    def attributes(self) -> Any:
        raise RuntimeError("cannot read")


def test_internal_failure_yields_a_minimal_record_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = normalize.failures()
    record = normalize.normalize_span(_Broken(), {"service.name": "x"}, "x")
    assert ("01" * 16, "broken", Role.OTHER, True, "it failed", before + 1) == (
        record.trace_id,
        record.name,
        record.role,
        err(record).status_error,
        err(record).status_message,
        normalize.failures(),
    )


_scalar = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True),
    st.booleans(),
    st.binary(max_size=16),
    st.none(),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.system",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "gen_ai.usage.input_tokens",
        "gen_ai.response.finish_reasons",
        "gen_ai.output.messages",
        "gen_ai.tool.definitions",
        "gen_ai.tool.name",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
        "openinference.span.kind",
        "llm.model_name",
        "llm.output_messages.0.message.role",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.name",
        "llm.output_messages.0.message.contents.0.message_content.type",
        "llm.tools.0.tool.json_schema",
        "llm.invocation_parameters",
        "tool.name",
        "input.value",
        "output.value",
        "traceloop.span.kind",
        "traceloop.entity.output",
        "llm.request.type",
        "gen_ai.completion.0.content",
        "gen_ai.completion.0.tool_calls.0.name",
        "llm.request.functions.0.name",
        "http.response.status_code",
        "http.status_code",
        "url.full",
        "server.address",
        "rpc.system",
        "rpc.grpc.status_code",
        "rpc.response.status_code",
        "error.type",
        "http.response.header.retry-after",
        "session.id",
    ]
) | st.text(max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attrs=st.dictionaries(_keys, _value, max_size=12),
    kind=st.integers(min_value=0, max_value=5),
    status=st.tuples(st.integers(min_value=0, max_value=2), st.text(max_size=60)),
    exception=st.none()
    | st.dictionaries(
        st.sampled_from(["exception.type", "exception.message", "exception.stacktrace"]),
        st.text(max_size=60),
    ),
)
def test_normalize_span_never_raises_and_keeps_bounds(
    attrs: dict[str, Any], kind: int, status: tuple[int, str], exception: dict[str, str] | None
) -> None:
    before = normalize.failures()
    events = [("exception", exception)] if exception is not None else []
    record = norm(attrs, kind=kind, status=status, events=events)
    assert before == normalize.failures(), "fell back to a minimal record"
    assert isinstance(record, SpanRecord)
    assert len(record.output_text) <= MAX_OUTPUT_CHARS
    if record.error is not None:
        assert len(record.error.exception_message) <= MAX_MESSAGE_CHARS
        assert len(record.error.status_message) <= MAX_MESSAGE_CHARS


# -- text scans: a pattern per form finds what one alternation finds -------------------

#: Pieces of provider and client error messages, hints and near misses, in any case.
_MESSAGE_PIECES = st.sampled_from(
    [
        "Error code: 429",
        "error code: 5031",
        "Server error '503 Service Unavailable'",
        "Client error '404 Not Found' for url",
        "xClient error '418 ",
        "502 Server Error",
        "1502 Server Error: Bad",
        "status_code=429",
        "status code: 503",
        "status: 200",
        "substatus=500",
        "HTTP/1.1 502",
        "HTTP 429",
        "xhttp 500",
        "Please try again in 1.5s",
        "retry after= 5",
        "Retry-After: 20",
        "retrying in 2 minutes",
        "try again after 250ms",
        "retry_after 3",
        "try again later",
        "retryafter 9",
        "{'code': 'rate_limit_exceeded'}",
        '"code":"insufficient_quota"',
        "'type': 'error', 'error': {'type': 'overloaded_error'}",
        "529 Overloaded",
        "(request_id: req_1, path: /v1/messages, type: overloaded_error)",
        "(path: /v1/messages)",
        ", type: rate_limit_error)",
        "{'status': 'RESOURCE_EXHAUSTED'}",
        "code: 'x'",
        "You exceeded your current quota",
        "Rate limit reached for gpt-4o",
        "maximum context length is 8192 tokens",
        "prompt is too long: 210000 tokens > 200000",
        "The model `gpt-5` does not exist",
        "invalid x-api-key",
        "content management policy",
        "Kelvin \u212a and \u017ftatus=500",
        "İstanbul",
    ]
)
_MESSAGES = st.lists(
    st.one_of(_MESSAGE_PIECES, st.text(alphabet=" .:='\"-_0123456789aeHrStyT", max_size=8)),
    max_size=8,
).map(" ".join) | st.text(max_size=60)


def _alternation(patterns: Iterable[re.Pattern[str]], *, named: bool = False) -> re.Pattern[str]:
    """The forms as one ``re`` alternation, each under its own flags: the reference search."""
    parts = []
    for i, pattern in enumerate(patterns):
        flags = "i" if pattern.flags & re.IGNORECASE else ""
        flags += "m" if pattern.flags & re.MULTILINE else ""
        body = f"(?P<p{i}>{pattern.pattern})" if named else pattern.pattern
        parts.append(f"(?{flags}:{body})")
    return re.compile("|".join(parts))


_HTTP_REFERENCE = _alternation(evidence._HTTP_STATUS_FORMS)
_TRAILER_REFERENCE = _alternation(evidence._SDK_TRAILER_STATUS_FORMS)
_PHRASE_REFERENCE = _alternation(evidence._PHRASES, named=True)
#: The retry hint as plainly written, searched in the text as it is.
_RETRY_HINT_REFERENCE = re.compile(
    r"(?:try again|retry|retrying)\s+(?:in|after)\s*:?\s*|\bretry[-_ ]after\s*[:=]?\s*",
    re.IGNORECASE,
)


def _reference_http_status(text: str) -> int | None:
    head = text[: evidence.SCAN_CHARS]
    match = _HTTP_REFERENCE.search(head) or _TRAILER_REFERENCE.search(head)
    group = next((g for g in match.groups() if g is not None), None) if match else None
    return int(group) if group is not None and 100 <= int(group) <= 599 else None


def _reference_retry_after(text: str) -> float | None:
    head = text[: evidence.SCAN_CHARS]
    for match in _RETRY_HINT_REFERENCE.finditer(head):
        delay = evidence.parse_duration(head[match.end() : match.end() + 64])
        if delay is not None:
            return delay
    return None


def _reference_provider_code(text: str) -> str:
    head = text[: evidence.SCAN_CHARS]
    match = evidence._BODY_CODE.search(head)
    if match:
        return match.group(1)
    for match in evidence._BODY_TYPE.finditer(head):
        if match.group(1) != "error":
            return match.group(1)
    match = evidence._SDK_TRAILER_TYPE.search(head) or evidence._BODY_STATUS.search(head)
    if match:
        return match.group(1)
    match = _PHRASE_REFERENCE.search(head)
    codes = list(evidence._PHRASES.values())
    return codes[int(match.lastgroup[1:])] if match and match.lastgroup else ""


@settings(max_examples=400, deadline=None)
@given(text=_MESSAGES, upper=st.booleans())
def test_text_scans_find_what_a_regex_search_finds(text: str, upper: bool) -> None:
    text = text.upper() if upper else text
    assert evidence.http_status_from_text(text) == _reference_http_status(text)
    assert evidence.retry_after_from_text(text) == _reference_retry_after(text)
    assert evidence.provider_code_from_text(text) == _reference_provider_code(text)


# -- tool outputs that are LangChain ToolMessages, and refused arguments -----------------


def _oi_tool_message(content: str, status: str) -> str:
    """A ToolMessage as OpenInference's LangChain instrumentation writes ``output.value``."""
    data = {"content": content, "type": "tool", "name": "read_file", "tool_call_id": "c1"}
    return json.dumps({"type": "tool", "data": {**data, "status": status}})


def _lc_tool_message(content: str, status: str) -> str:
    """As OpenLLMetry writes ``traceloop.entity.output``: LangChain's serialised form."""
    kwargs = {"content": content, "type": "tool", "tool_call_id": "c1", "status": status}
    message = {"lc": 1, "type": "constructor", "id": ["x", "ToolMessage"], "kwargs": kwargs}
    return json.dumps({"output": message, "kwargs": {"tags": []}})


@pytest.mark.parametrize("envelope", [_oi_tool_message, _lc_tool_message])
def test_a_tool_message_is_read_for_its_content_and_status(envelope: Any) -> None:
    swallowed = evidence.detect_swallowed
    assert evidence.tool_message(envelope("Error: refused", "success")) == (
        "Error: refused",
        "success",
    )
    assert swallowed(envelope("Error: connection refused", "success")) == evidence.Swallowed(
        "", "connection refused"
    )
    assert swallowed(envelope("the archive is offline", "error")) == evidence.Swallowed(
        "", "the archive is offline"
    )
    assert swallowed(envelope("Error rates fell to 0.1%", "success")) is None
    assert swallowed(envelope('{"status": "ok", "errors": []}', "success")) is None


def test_a_tool_message_cut_by_the_output_bound_is_read_up_to_the_cut() -> None:
    text = _oi_tool_message("Error: disk full\n" + "x" * 10_000, "success")[:4096]
    found = evidence.detect_swallowed(text)
    assert found is not None and found.message.startswith("disk full")
    assert evidence.tool_message('{"type": "tool", "data": {"no": "content"') is None
    assert evidence.tool_message('{"content": "not a message", "x": 1}') is None


@pytest.mark.parametrize(
    ("output", "invalid"),
    [
        ("Error: ModelBehaviorError('Invalid JSON input for tool read_file')", "read_file"),
        (
            "Error invoking tool 'read_file' with kwargs {'city': 1} with error:\n"
            " path: Field required\n Please fix the error and try again.",
            "read_file",
        ),
        ("Log line 3: Invalid JSON input for tool x, seen yesterday", None),
    ],
)
def test_a_framework_refusing_the_models_arguments_is_an_invalid_tool_call(
    output: str, invalid: str | None
) -> None:
    found = evidence.detect_swallowed(output)
    if invalid is None:
        assert found is None
    else:
        assert found is not None and found.invalid_tool_calls == (f"bad_arguments:{invalid}",)


@pytest.mark.parametrize(
    ("exception_type", "message", "arguments", "stacktrace", "refused"),
    [
        ("pydantic_core._pydantic_core.ValidationError", "1 validation error for read_file",
         None, "", True),
        ("ValidationError", "2 validation errors for read_file_args", None, "", True),
        ("ValidationError", "1 validation error for Order", None, "", False),
        ("ValidationError", "1 validation error for ReadFileInput", None,
         'File "base.py", line 835, in _parse_input\n    result = ...', True),
        ("ValidationError", "Tool input validation error", None, "", True),
        ("json.decoder.JSONDecodeError", "Expecting value", "{path: x", "", True),
        ("json.decoder.JSONDecodeError", "Expecting value", '{"path": "x"}', "", False),
        ("json.decoder.JSONDecodeError", "Expecting value", "/srv/notes.txt", "", False),
        ("", "Error running tool (non-fatal): {'error': 'Invalid JSON input for tool read_file'}",
         None, "", True),
    ],
)  # fmt: skip
def test_arguments_refused_are_told_from_a_backends_data(
    exception_type: str, message: str, arguments: object, stacktrace: str, refused: bool
) -> None:
    found = evidence.rejected_arguments("read_file", exception_type, message, arguments, stacktrace)
    assert found == (("bad_arguments:read_file",) if refused else ())
