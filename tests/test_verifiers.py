"""Semantic verifiers: load-time errors with their field path, each check, selectors, bounds."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from policies._schema_verifiers import Verifiers, VerifierSpec
from policies._verifier_checks import MAX_JSON_CHARS, MAX_REGEX_CHARS, NORMALIZED_OUTPUT_CHARS
from policies._verifiers import (
    MAX_TIMEOUTS,
    VerificationFailure,
    VerifierError,
    VerifierSet,
    compile_verifiers,
)
from supervisor.normalize.attributes import MAX_OUTPUT_CHARS
from supervisor.records import AttrValue, ErrorEvidence, Role, SpanRecord

ROOT = ""
CHILD = "00f067aa0ba902b7"


def span(
    output: str = "",
    *,
    service: str = "billing-agent",
    role: Role = Role.LLM,
    name: str = "chat gpt-4o",
    parent: str = CHILD,
    attributes: Mapping[str, AttrValue] | None = None,
    error: ErrorEvidence | None = None,
    recorded: bool = True,
    calls_tools: bool = False,
) -> SpanRecord:
    return SpanRecord(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="b7ad6b7169203331",
        parent_span_id=parent,
        name=name,
        service=service,
        kind=3,
        start_ns=0,
        end_ns=1,
        role=role,
        output_text=output,
        output_recorded=recorded,
        calls_tools=calls_tools,
        error=error,
        attributes=MappingProxyType(dict(attributes or {})),
    )


def spec(**fields: Any) -> VerifierSpec:
    return VerifierSpec.model_validate({"name": "v", **fields})


def verifiers(*specs: dict[str, Any], **options: Any) -> VerifierSet:
    errors: list[VerifierError] = options.pop("errors", [])
    parsed = [VerifierSpec.model_validate({"name": f"v{i}", **s}) for i, s in enumerate(specs)]
    return compile_verifiers(parsed, on_error=errors.append, **options)


def messages(vset: VerifierSet, record: SpanRecord) -> list[str]:
    return [failure.message for failure in vset.check(record)]


def load_errors(**fields: Any) -> list[tuple[str, str]]:
    """(field path, message) of every error loading one verifier."""
    with pytest.raises(ValidationError) as caught:
        spec(**fields)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in caught.value.errors()]


def only_error(**fields: Any) -> tuple[str, str]:
    errors = load_errors(**fields)
    assert len(errors) == 1, errors
    return errors[0]


# --------------------------------------------------------------------------- load errors


@pytest.mark.parametrize(
    ("fields", "path", "words"),
    [
        ({"output_regex": {"pattern": "(unclosed"}}, "output_regex.pattern", "bad regex"),
        ({"output_regex": {"pattern": "a{2,1}"}}, "output_regex.pattern", "min repeat greater"),
        ({"output_regex": {"pattern": "x" * 5000}}, "output_regex.pattern", "longer than"),
        ({"output_regex": {"pattern": ""}}, "output_regex.pattern", "at least 1"),
        (
            {"output_regex": {"pattern": "x", "flags": ["loud"]}},
            "output_regex.flags.0",
            "'ignorecase'",
        ),
        (
            {"output_regex": {"pattern": "x", "must_match": "yes"}},
            "output_regex.must_match",
            "boolean",
        ),
        ({"output_regex": {"pattern": "x", "mustmatch": False}}, "output_regex.mustmatch", "Extra"),
        (
            {"output_json_schema": {"type": "objekt"}},
            "output_json_schema",
            "invalid JSON Schema at $.type",
        ),
        (
            {"output_json_schema": {"properties": {"n": {"minimum": "3"}}}},
            "output_json_schema",
            "at $.properties.n.minimum",
        ),
        (
            {"output_json_schema": {"$ref": "https://example.com/s.json"}},
            "output_json_schema",
            "not local",
        ),
        (
            {"output_json_schema": {"properties": {"code": {"pattern": "(unclosed"}}}},
            "output_json_schema",
            "JSON Schema at $.properties.code.pattern: bad regex '(unclosed': missing )",
        ),
        (
            {"output_json_schema": {"patternProperties": {"^(x": {}}}},
            "output_json_schema",
            "at $.patternProperties: bad regex",
        ),
        (
            {
                "output_json_schema": {
                    "patternProperties": {"^x-": {}},
                    "unevaluatedProperties": False,
                }
            },
            "output_json_schema",
            "unevaluatedProperties with patternProperties",
        ),
        (
            {"output_json_schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
            "output_json_schema",
            "refers to itself",
        ),
        (
            {"output_json_schema": {"$schema": "https://example.com/draft", "type": "object"}},
            "output_json_schema",
            "not a known draft",
        ),
        ({"output_json_schema": "object"}, "output_json_schema", "dictionary"),
        (
            {"attribute_range": {"key": "n", "min": 10, "max": 5}},
            "attribute_range",
            "min (10) is above max (5)",
        ),
        ({"attribute_range": {"key": "n"}}, "attribute_range", "needs min, max or both"),
        ({"attribute_range": {"key": "", "max": 5}}, "attribute_range.key", "at least 1"),
        ({"attribute_range": {"key": " n", "max": 5}}, "attribute_range.key", "surrounding spaces"),
        (
            {"attribute_range": {"key": "n", "max": "5"}},
            "attribute_range.max",
            "a bound must be a number, not str",
        ),
        (
            {"attribute_range": {"key": "n", "max": float("nan")}},
            "attribute_range.max",
            "finite number",
        ),
        ({"output_emtpy": True}, "output_emtpy", "Extra inputs are not permitted"),
        ({"output_empty": True, "match": {"servce": "x"}}, "match.servce", "Extra"),
        ({"output_empty": True, "match": {"role": "robot"}}, "match.role.0", "'llm'"),
        ({"output_empty": True, "match": {"service": "[x"}}, "match.service.0", "unclosed"),
        ({"output_json": False}, "output_json", "false checks nothing"),
        ({"output_empty": True, "output_json": True}, "", "found output_empty and output_json"),
        ({}, "", "exactly one check among output_empty, output_regex"),
        ({"final_answer_empty": True, "match": {"role": "tool"}}, "", "leaves none"),
    ],
)
def test_load_errors_name_the_field(fields: dict[str, Any], path: str, words: str) -> None:
    found_path, message = only_error(**fields)
    assert found_path == path
    assert words in message


def test_load_error_message_is_clear_in_the_exception_text() -> None:
    with pytest.raises(ValidationError) as caught:
        spec(output_regex={"pattern": "(unclosed"})
    text = str(caught.value)
    assert "output_regex.pattern" in text
    assert "bad regex '(unclosed': missing ) at position 9" in text


def test_bad_name_and_duplicate_names() -> None:
    path, message = load_errors(name="bad name", output_empty=True)[0]
    assert path == "name"
    assert "bad name" in message
    adapter = TypeAdapter(Verifiers)
    with pytest.raises(ValidationError, match="two verifiers are named 'a'"):
        adapter.validate_python(
            [{"name": "a", "output_empty": True}, {"name": "a", "output_json": True}]
        )


def test_yaml_verifiers_load_and_have_a_json_schema() -> None:
    text = textwrap.dedent(
        """
        - name: answer-is-json
          match: {service: "billing-*", role: llm}
          output_json_schema: {type: object, required: [answer]}
        - name: no-keys-leaked
          output_regex: {pattern: "sk-[A-Za-z0-9]{20,}", must_match: false, flags: ignorecase}
        - name: tokens-bounded
          match: {role: [llm]}
          attribute_range: {key: llm.token_count.total, max: 8000}
        - name: final-answer
          final_answer_empty: true
        """
    )
    specs = TypeAdapter(Verifiers).validate_python(yaml.safe_load(text))
    assert [s.check for s in specs] == [
        "output_json_schema",
        "output_regex",
        "attribute_range",
        "final_answer_empty",
    ]
    assert specs[1].output_regex is not None
    assert specs[1].output_regex.flags == ["ignorecase"]
    assert len(compile_verifiers(specs)) == 4
    schema = TypeAdapter(Verifiers).json_schema()
    assert "VerifierSpec" in schema["$defs"]


def test_yaml_dates_in_a_schema_are_refused() -> None:
    data = yaml.safe_load("output_json_schema: {const: 2024-01-01}")
    path, message = only_error(**data)
    assert path == "output_json_schema"
    assert "$.const is a date, not JSON" in message


def test_schema_size_is_bounded() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"properties": {"x": deep}}
    assert "nests deeper than" in only_error(output_json_schema=deep)[1]
    wide = {"enum": list(range(20_000))}
    assert "more than 10000 values" in only_error(output_json_schema=wide)[1]


def test_data_keywords_are_not_read_as_schema() -> None:
    # "pattern" inside const is data, and "pattern" as a property name is a name.
    spec(
        output_json_schema={
            "properties": {"pattern": {"type": "string"}},
            "const": {"pattern": "(unclosed"},
        }
    )


# --------------------------------------------------------------------------- regex syntax and time


@pytest.mark.parametrize(
    ("pattern", "output"),
    [
        (r"(a+)+$", "a" * 28 + "!"),
        (r"(.*)*x", "y" * 5000),
        (r"(a|a)*b", "a" * 40),
        (r"^(\w+\s?)*$", "word " * 40 + "!"),
        (r"(x+x+)+y", "x" * 5000),
    ],
)
def test_backtracking_patterns_load_and_cost_bounded_time(pattern: str, output: str) -> None:
    errors: list[VerifierError] = []
    vset = verifiers({"output_regex": {"pattern": pattern, "must_match": False}}, errors=errors)
    start = time.monotonic()
    assert vset.check(span(output)) == []  # not found, or stopped: never a verdict on a timeout
    assert time.monotonic() - start < 2.0
    assert all("timed out after 50 ms" in e.message for e in errors)


def test_re_syntax_works() -> None:
    vset = verifiers(
        {"output_regex": {"pattern": r"(?i)^answer: (?P<n>\d+) \((?P=n)\)$", "flags": "multiline"}}
    )
    assert messages(vset, span("thinking\nANSWER: 42 (42)")) == []
    assert len(messages(vset, span("ANSWER: 42 (43)"))) == 1


# --------------------------------------------------------------------------- each check


def test_output_empty() -> None:
    vset = verifiers({"output_empty": True})
    assert messages(vset, span("")) == ["output is empty"]
    assert messages(vset, span(" \n\t")) == ["output is empty"]
    assert messages(vset, span("hello")) == []
    assert vset.check(span("")) == [VerificationFailure("v0", "output is empty")]


def test_output_regex_must_match() -> None:
    vset = verifiers({"output_regex": {"pattern": r"^ANSWER: \d+$", "flags": ["multiline"]}})
    assert messages(vset, span("thinking...\nANSWER: 42")) == []
    assert messages(vset, span("no idea")) == [r"output does not match /^ANSWER: \d+$/"]
    assert messages(vset, span("")) == [r"output does not match /^ANSWER: \d+$/"]


def test_output_regex_must_not_match() -> None:
    vset = verifiers({"output_regex": {"pattern": "sk-[a-z0-9]{8,}", "must_match": False}})
    assert messages(vset, span("the key is SK-ABCDEFGH12")) == []
    assert messages(vset, span("the key is sk-abcdefgh12")) == ["output matches /sk-[a-z0-9]{8,}/"]
    folded = verifiers(
        {"output_regex": {"pattern": "sk-[a-z0-9]{8,}", "must_match": False, "flags": "ignorecase"}}
    )
    assert messages(folded, span("the key is SK-ABCDEFGH12")) == [
        "output matches /sk-[a-z0-9]{8,}/"
    ]


def test_long_patterns_are_shortened_in_messages() -> None:
    pattern = "x" * 100
    vset = verifiers({"output_regex": {"pattern": pattern}})
    (message,) = messages(vset, span("y"))
    assert message == f"output does not match /{'x' * 60}.../"


def test_output_json() -> None:
    vset = verifiers({"output_json": True})
    assert messages(vset, span('{"answer": 42}')) == []
    assert messages(vset, span("[1, 2]")) == []
    assert messages(vset, span("Sure! Here it is")) == [
        "output is not JSON: Expecting value at 1:1"
    ]
    assert messages(vset, span("")) == ["output is not JSON: Expecting value at 1:1"]
    assert messages(vset, span('{"a": 1,\n "b": }')) == [
        "output is not JSON: Expecting value at 2:7"
    ]
    assert messages(vset, span('{"a": NaN}')) == ["output is not JSON: NaN is not JSON"]
    # orjson refuses integers over 64 bits; they are JSON all the same.
    assert messages(vset, span(str(2**70))) == []


def test_output_json_schema() -> None:
    schema = {
        "type": "object",
        "required": ["answer"],
        "properties": {
            "answer": {"type": "integer"},
            "tags": {"type": "array", "uniqueItems": True},
        },
    }
    vset = verifiers({"output_json_schema": schema})
    assert messages(vset, span('{"answer": 42}')) == []
    assert messages(vset, span('{"answer": "x"}')) == [
        "output fails the JSON Schema at $.answer: 'x' is not of type 'integer'"
    ]
    assert messages(vset, span("{}")) == [
        "output fails the JSON Schema at $: 'answer' is a required property"
    ]
    assert messages(vset, span("nope")) == ["output is not JSON: Expecting value at 1:1"]
    # uniqueItems with JSON Schema's equality: 1 and 1.0 are equal, 1 and true are not.
    assert messages(vset, span('{"answer": 1, "tags": [1, true, {"a": [1]}, {"a": [2]}]}')) == []
    (message,) = messages(vset, span('{"answer": 1, "tags": [1, 1.0]}'))
    assert message.startswith("output fails the JSON Schema at $.tags: ")
    assert message.endswith("has non-unique elements")


def test_declared_draft_is_honoured() -> None:
    # In draft-07 a list under "items" is a tuple of schemas, which 2020-12 refuses.
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "items": [{"type": "integer"}, {"type": "string"}],
    }
    vset = verifiers({"output_json_schema": schema})
    assert messages(vset, span('[1, "a"]')) == []
    assert len(messages(vset, span('["a", 1]'))) == 1


def test_unique_items_is_linear() -> None:
    vset = verifiers({"output_json_schema": {"type": "array", "uniqueItems": True}})
    items = ",".join(f'{{"a": {i}}}' for i in range(20_000))
    start = time.perf_counter()
    assert messages(vset, span(f"[{items}]")) == []
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    "document",
    [
        {"a": 1, "x-b": 2},
        {"a": 1, "x-b": "two"},
        {"a": 1, "c": 3},
        {"a": 1, "c": 3, "d": 4},
        {"code": "AB-12"},
        {"code": "ab-12"},
        {"names": {"ok": 1, "Not OK": 2}},
    ],
)
def test_json_schema_regex_keywords_say_what_jsonschema_says(document: dict[str, Any]) -> None:
    # pattern, patternProperties and additionalProperties are replaced (bounded in time):
    # the verdicts and messages must stay jsonschema's own.
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
            "names": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        },
        "patternProperties": {"^x-": {"type": "integer"}},
        "additionalProperties": False,
    }
    found = messages(verifiers({"output_json_schema": schema}), span(json.dumps(document)))
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(document))
    expected = []
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        expected = [f"output fails the JSON Schema at {best.json_path}: {best.message}"]
    assert found == expected


def test_additional_properties_without_patterns_say_what_jsonschema_says() -> None:
    schema = {"properties": {"a": {}}, "additionalProperties": False}
    document = {"a": 1, "b": 2, "c": 3}
    (found,) = messages(verifiers({"output_json_schema": schema}), span(json.dumps(document)))
    best = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(document)
    )
    assert found == f"output fails the JSON Schema at $: {best.message}"


def test_json_schema_regexes_share_one_time_budget_per_output() -> None:
    errors: list[VerifierError] = []
    schema = {"type": "object", "patternProperties": {"^(a|a)*$": {"type": "integer"}}}
    vset = verifiers({"output_json_schema": schema}, errors=errors)
    # Each key fails the pattern in about half the time limit (~25 ms) and is no error,
    # so every one is searched: 200 of them would take seconds.
    output = json.dumps({"a" * 16 + f"!{i}": i for i in range(200)})
    start = time.monotonic()
    assert vset.check(span(output)) == []
    assert time.monotonic() - start < 2.0
    assert [e.message for e in errors] == [
        "the JSON Schema's regexes took over 50 ms on one output; the span was not judged"
    ]
    assert messages(vset, span('{"aaaa": 1}')) == []
    assert messages(vset, span('{"aaaa": "one"}')) == [
        "output fails the JSON Schema at $.aaaa: 'one' is not of type 'integer'"
    ]


def test_attribute_range() -> None:
    vset = verifiers({"attribute_range": {"key": "llm.token_count.total", "min": 1, "max": 8000}})

    def check(value: AttrValue) -> list[str]:
        return messages(vset, span("x", attributes={"llm.token_count.total": value}))

    assert check(500) == []
    assert check(8000) == []
    assert check(1.0) == []
    assert check(9000) == ["attribute llm.token_count.total = 9000 is above 8000"]
    assert check(0) == ["attribute llm.token_count.total = 0 is below 1"]
    assert check("9000") == ["attribute llm.token_count.total = '9000' is above 8000"]
    assert check(" 12.5 ") == []
    assert check("lots") == ["attribute llm.token_count.total = 'lots' is not a number"]
    assert check(True) == ["attribute llm.token_count.total = True is not a number"]
    assert check(float("nan")) == ["attribute llm.token_count.total = nan is not a number"]
    assert check((1, 2)) == ["attribute llm.token_count.total = (1, 2) is not a number"]
    assert messages(vset, span("x")) == []  # missing: not a failure unless required


def test_attribute_range_required_and_float_bounds() -> None:
    vset = verifiers({"attribute_range": {"key": "score", "min": 0.5, "required": True}})
    assert messages(vset, span("x")) == ["attribute score is missing"]
    assert messages(vset, span("x", attributes={"score": 0.25})) == [
        "attribute score = 0.25 is below 0.5"
    ]
    assert messages(vset, span("x", attributes={"score": 0.75})) == []


def test_final_answer_empty_looks_at_root_agent_and_chain_spans_and_llm_answers() -> None:
    vset = verifiers({"final_answer_empty": True})
    root_agent = span("", role=Role.AGENT, parent=ROOT, name="invoke_agent")
    assert messages(vset, root_agent) == ["final answer is empty"]
    assert messages(vset, span("  ", role=Role.CHAIN, parent=ROOT)) == ["final answer is empty"]
    assert messages(vset, span("42", role=Role.AGENT, parent=ROOT)) == []
    assert messages(vset, span("", role=Role.AGENT, parent=CHILD)) == []  # not the run's end
    # An LLM answer that calls no tool ends the agent's loop, wherever its span is.
    assert messages(vset, span("", role=Role.LLM, parent=CHILD)) == ["final answer is empty"]
    assert messages(vset, span("", role=Role.LLM, calls_tools=True)) == []  # a step
    assert messages(vset, span("", role=Role.TOOL, parent=ROOT)) == []
    assert vset.wants("billing-agent", Role.AGENT, "invoke_agent")
    assert vset.wants("billing-agent", Role.LLM, "chat")
    assert not vset.wants_text("billing-agent", Role.LLM, "chat")  # emptiness only
    assert not vset.wants("billing-agent", Role.TOOL, "execute_tool")


def test_an_output_that_was_not_recorded_is_not_judged_and_said_once() -> None:
    errors: list[VerifierError] = []
    vset = verifiers(
        {"output_empty": True},
        {"final_answer_empty": True},
        {"output_json": True},
        {"output_regex": {"pattern": "x"}},
        errors=errors,
    )
    for _ in range(3):
        assert messages(vset, span("", recorded=False)) == []
    assert [(e.verifier, e.message[:40]) for e in errors] == [
        (f"v{i}", "spans that recorded no output (content c") for i in range(4)
    ]


def test_an_answer_that_only_calls_tools_is_not_empty_nor_judged_as_text() -> None:
    vset = verifiers(
        {"output_empty": True}, {"output_json": True}, {"output_regex": {"pattern": "x"}}
    )
    assert messages(vset, span("", calls_tools=True)) == []
    # Text beside the calls is the model's to answer for.
    assert messages(vset, span("let me look", calls_tools=True)) == [
        "output is not JSON: Expecting value at 1:1",
        "output does not match /x/",
    ]


def test_spans_that_already_failed_are_not_verified() -> None:
    vset = verifiers({"output_empty": True})
    failed = span("", error=ErrorEvidence(status_error=True, exception_type="TimeoutError"))
    assert vset.check(failed) == []


def test_every_failing_verifier_is_reported_in_order() -> None:
    vset = verifiers(
        {"output_json": True}, {"output_empty": True}, {"output_regex": {"pattern": "x"}}
    )
    assert [f.verifier for f in vset.check(span(""))] == ["v0", "v1", "v2"]
    assert vset.names == ("v0", "v1", "v2")


# --------------------------------------------------------------------------- selectors


def test_selectors_all_must_hold() -> None:
    vset = verifiers(
        {
            "output_empty": True,
            "match": {
                "service": ["billing-*", "search"],
                "role": ["llm", "tool"],
                "span_name": "chat *",
            },
        }
    )
    assert messages(vset, span("")) == ["output is empty"]
    assert messages(vset, span("", service="search", role=Role.TOOL, name="chat x")) == [
        "output is empty"
    ]
    assert messages(vset, span("", service="shipping")) == []
    assert messages(vset, span("", role=Role.AGENT)) == []
    assert messages(vset, span("", name="embeddings")) == []
    assert vset.wants("billing-eu", Role.LLM, "chat gpt-4o")
    assert vset.wants("billing-eu", "llm", "chat gpt-4o")  # type: ignore[arg-type]
    assert not vset.wants("shipping", Role.LLM, "chat gpt-4o")
    assert not vset.wants("billing-eu", Role.HTTP, "chat gpt-4o")
    assert not vset.wants("billing-eu", Role.LLM, "embeddings")


def test_an_empty_set_wants_nothing() -> None:
    vset = compile_verifiers([])
    assert len(vset) == 0
    assert not vset.wants("billing-agent", Role.LLM, "chat")
    assert vset.check(span("")) == []


def test_the_service_index_is_bounded() -> None:
    vset = verifiers({"output_empty": True, "match": {"service": "svc-1*"}})
    for i in range(3000):
        vset.check(span("", service=f"svc-{i}"))
    assert len(vset._by_service) <= 1024


def test_unselected_spans_cost_little() -> None:
    vset = verifiers(
        *({"output_json": True, "match": {"service": f"other-{i}"}} for i in range(50))
    )
    record = span("not json")
    start = time.perf_counter()
    for _ in range(20_000):
        vset.check(record)
    # About a microsecond each; the bound only catches a per-verifier scan per span.
    assert time.perf_counter() - start < 1.0


# --------------------------------------------------------------------------- bounds


def test_the_cut_constant_follows_the_normalizer() -> None:
    assert NORMALIZED_OUTPUT_CHARS == MAX_OUTPUT_CHARS


def test_a_megabyte_of_output_is_bounded() -> None:
    errors: list[VerifierError] = []
    vset = verifiers(
        {"output_empty": True},
        {"output_regex": {"pattern": "SECRET", "must_match": False}},
        {"output_regex": {"pattern": "^\\s*[^x]"}},
        {"output_json": True},
        errors=errors,
    )
    big = "x" * (1024 * 1024 - 6) + "SECRET"
    start = time.perf_counter()
    for _ in range(3):
        # The secret lies past the searched prefix; the JSON is too long to parse.
        assert vset.check(span(big)) == []
    assert time.perf_counter() - start < 1.0
    assert len(big) > MAX_REGEX_CHARS and len(big) > MAX_JSON_CHARS
    assert [(e.verifier, e.message.split(" ")[0]) for e in errors] == [
        ("v2", "/^\\s*[^x]/"),
        ("v3", "an"),
    ]


def test_cut_json_is_not_judged_unless_cuts_are_off() -> None:
    document = '{"items": [' + ",".join(['"item"'] * 2000)
    cut = document[:NORMALIZED_OUTPUT_CHARS]
    errors: list[VerifierError] = []
    vset = verifiers({"output_json": True}, errors=errors)
    assert vset.check(span(cut)) == []
    assert "cut at 4096 characters" in errors[0].message
    strict = verifiers({"output_json": True}, output_cut_at=None)
    assert messages(strict, span(cut))[0].startswith("output is not JSON: ")
    # A short document that ends early is simply not JSON.
    assert messages(vset, span('{"items": [1, 2'))[0].startswith("output is not JSON: ")


def test_a_slow_pattern_times_out_once_and_is_switched_off() -> None:
    errors: list[VerifierError] = []
    vset = verifiers({"output_regex": {"pattern": "a.*b.*c"}}, errors=errors)
    slow = span("ab" * (MAX_REGEX_CHARS // 2))
    start = time.perf_counter()
    for _ in range(MAX_TIMEOUTS + 3):
        assert vset.check(slow) == []  # a timeout leaves the span unjudged
    assert time.perf_counter() - start < 3.0
    assert [e.message.split(" ")[0] for e in errors] == ["regex", "switched"]
    assert "timed out after 50 ms" in errors[0].message
    assert "switched off after 5 regex timeouts" in errors[1].message
    assert vset.check(span("")) == []  # off until the policy is reloaded


def test_an_unexpected_error_in_a_check_is_reported_not_raised() -> None:
    class Exploding(Mapping[str, AttrValue]):
        def __getitem__(self, key: str) -> AttrValue:
            raise KeyError(key)

        def get(self, key: str, default: Any = None) -> Any:
            raise RuntimeError("boom")

        def __iter__(self) -> Iterator[str]:
            return iter(())

        def __len__(self) -> int:
            return 0

    errors: list[VerifierError] = []
    vset = verifiers({"attribute_range": {"key": "n", "max": 1}}, errors=errors)
    record = dataclasses.replace(span("x"), attributes=Exploding())
    assert vset.check(record) == []
    assert vset.check(record) == []
    assert errors == [VerifierError("v0", "check failed with RuntimeError: boom")]
    assert vset.errors == errors


def test_errors_are_logged_by_default(caplog: pytest.LogCaptureFixture) -> None:
    vset = compile_verifiers([spec(output_json=True)])
    with caplog.at_level("WARNING", logger="spanvisor.verifiers"):
        vset.check(span("x" * (MAX_JSON_CHARS + 1)))
        vset.check(span("x" * (MAX_JSON_CHARS + 1)))
    assert len(caplog.records) == 1
    assert "verifier v: an output over" in caplog.text
