"""Whatever a policy file contains, loading it succeeds or raises PolicyError: nothing else.

And a policy that loads always classifies and decides without raising.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import regex
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Policy, load_policy
from policies._match import Message, Subject
from supervisor.errors import PolicyError
from supervisor.records import Action, ErrorEvidence, Failure, Role, SpanRecord

RULE_KEYS = ["name", "match", "class", "kind", "dependency", "description"]
MATCH_KEYS = [
    "exception_type",
    "error_type",
    "message",
    "http_status",
    "grpc_code",
    "provider_code",
    "finish_reason",
    "role",
    "service",
    "dependency",
    "span_name",
    "attributes",
    "swallowed",
    "invalid_tool_call",
    "class",
    "kind",
    "rule",
]
ENTRY_KEYS = [
    "name",
    "match",
    "action",
    "observe",
    "max_attempts",
    "wait",
    "honour_retry_after",
    "max_retry_after_s",
    "on_exhausted",
    "chain",
    "remediator",
]
WAIT_KEYS = ["type", "multiplier", "min", "max", "exp_base", "seconds", "jitter"]
WORDS = [
    "retry",
    "fallback",
    "fail_fast",
    "escalate",
    "remediate",
    "none",
    "transient",
    "model",
    "permanent",
    "semantic",
    "rate_limit",
    "timeout",
    "tool",
    "llm",
    "exponential",
    "random_exponential",
    "fixed",
    "full",
    "equal",
    "5xx",
    "500-599",
    "UNAVAILABLE",
    "openai:*",
    "*Timeout*",
    "{provider}",
    "{nope}",
    "builtin.x",
    "a[",
    "[!]",
]
BAD_REGEXES = ["(", "[", "a**", "(?P<", "\\", "a{99999999999}", "(?i", "*", "(?<=a+)b"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(WORDS + BAD_REGEXES),
)
keys = st.one_of(
    st.sampled_from(
        [
            "version",
            "builtin",
            "observe",
            "rules",
            "policies",
            *RULE_KEYS,
            *MATCH_KEYS,
            *ENTRY_KEYS,
            *WAIT_KEYS,
        ]
    ),
    st.text(max_size=8),
    st.integers(min_value=-3, max_value=600),
)
values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(keys, inner, max_size=5),
    ),
    max_leaves=25,
)


def section(item_keys: list[str]) -> st.SearchStrategy[list[dict[Any, Any]]]:
    item = st.dictionaries(
        st.sampled_from(item_keys),
        st.one_of(
            values,
            st.dictionaries(st.sampled_from(MATCH_KEYS + WAIT_KEYS), values, max_size=4),
        ),
        max_size=len(item_keys),
    )
    return st.lists(item, max_size=3)


documents = st.one_of(
    values,
    st.fixed_dictionaries(
        {"version": st.one_of(st.just(1), scalars)},
        optional={
            "builtin": st.one_of(st.booleans(), scalars),
            "observe": st.one_of(st.booleans(), scalars),
            "rules": section(RULE_KEYS),
            "policies": section(ENTRY_KEYS),
        },
    ),
)

SPANS = [
    SpanRecord(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        parent_span_id="",
        name="chat",
        service="agent",
        kind=0,
        start_ns=0,
        end_ns=1,
        role=role,
        dependency="openai:gpt-4o",
        error=evidence,
        attributes={"http.route": "/v1", "retries": 2},
    )
    for role, evidence in [
        (Role.LLM, ErrorEvidence(status_error=True, http_status=429, provider_code="x")),
        (Role.TOOL, ErrorEvidence(swallowed=True, exception_message="Error: timed out")),
        (Role.HTTP, ErrorEvidence(grpc_code=14, retry_after_s=3.0, finish_reasons=("length",))),
    ]
]


def exercise(policy: Policy) -> None:
    """A loaded policy classifies and decides every span without raising."""
    for span in SPANS:
        verdict = policy.classify(span)
        assert verdict is not None
        assert span.error is not None
        failure = Failure(
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id="",
            service=span.service,
            span_name=span.name,
            run_id=span.run_id,
            role=span.role,
            failure_class=verdict.failure_class,
            kind=verdict.kind,
            dependency=verdict.dependency,
            rule=verdict.rule,
            message="",
            evidence=span.error,
            received_ns=0,
        )
        for attempt in (1, 2, 50):
            assert policy.decide(failure, attempt=attempt).action in set(Action)


def load_or_policy_error(text: str) -> None:
    try:
        policy = load_policy(text=text, source="fuzz.yaml")
    except PolicyError as exc:
        assert exc.issues
        lines = len(text.splitlines()) + 2
        for issue in exc.issues:
            assert issue.source == "fuzz.yaml"
            assert issue.line is None or 1 <= issue.line <= lines
            assert issue.message
        return
    exercise(policy)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(documents)
def test_arbitrary_documents_load_or_raise_policy_error(document: Any) -> None:
    load_or_policy_error(yaml.safe_dump(document, allow_unicode=True))


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_loads_or_raises_policy_error(text: str) -> None:
    load_or_policy_error(text)


DEFAULT = resources.files("policies").joinpath("default_policy.yaml").read_text(encoding="utf-8")
DEFAULT_LINES = DEFAULT.splitlines()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=len(DEFAULT_LINES) - 1),
            st.sampled_from(["drop", "dup", "junk"]),
            st.text(max_size=6),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mangled_builtin_policy_loads_or_raises_policy_error(
    edits: list[tuple[int, str, str]],
) -> None:
    lines = list(DEFAULT_LINES)
    for index, how, junk in edits:
        at = index % len(lines)
        if how == "drop":
            del lines[at]
        elif how == "dup":
            lines.insert(at, lines[at])
        else:
            lines[at] = lines[at][: len(lines[at]) // 2] + junk
    # A user file may not reuse builtin names; make it layer-able by renaming them.
    text = "\n".join(lines).replace("name: builtin.", "name: user.")
    load_or_policy_error(text)


# --- the message fast paths are exact -------------------------------------------------------


def _as_list(value: str | list[str]) -> list[str]:
    return value if isinstance(value, list) else [value]


BUILTIN_PATTERNS = [
    pattern
    for rule in yaml.safe_load(DEFAULT)["rules"]
    for pattern in _as_list(rule.get("match", {}).get("message", []))
]
EXTRA_PATTERNS = [
    "(?i)[A-Z]+ error",
    "(?i)\\x41bc",
    "(?i)caf\\u00c9",
    "(?i)ab|c",
    "Timeout|timed out",
    "(?i)(?-i:Rate) limit",
    "(?i)\\bquota\\b",
    "(?i)a[]b]c|def",
]
#: ``regex`` syntax whose meaning under (?i) lowercasing the text would change.
CASED_REGEX_PATTERNS = [
    "(?i)[[:upper:]]+ error",
    "(?i)\\p{lu}imit",
    "(?i)(?f)strasse",
    "(?i)(?<word>rate) limit",
]
FRAGMENTS = [
    "Rate Limit",
    "TIMED OUT",
    "Connection Refused",
    "not found",
    "ABC",
    "Error",
    "É",
    "]",
    "STRASSE",
    "Straße",
]


@FUZZ
@given(
    st.sampled_from(BUILTIN_PATTERNS + EXTRA_PATTERNS + CASED_REGEX_PATTERNS),
    st.lists(st.one_of(st.text(max_size=8), st.sampled_from(FRAGMENTS)), max_size=8),
)
def test_message_matching_equals_a_plain_regex_search(pattern: str, parts: list[str]) -> None:
    """The speed-ups change nothing: the same as one search with the same engine."""
    message = " ".join(parts)
    span = SPANS[0]
    evidence = ErrorEvidence(status_error=True, exception_message=message)

    matched = Message([pattern])(Subject(span, evidence))

    assert matched == (regex.search(pattern, message, regex.VERSION0) is not None)


@FUZZ
@given(
    st.sampled_from(BUILTIN_PATTERNS + EXTRA_PATTERNS),
    st.lists(st.one_of(st.text(max_size=8), st.sampled_from(FRAGMENTS)), max_size=8),
)
def test_re_patterns_mean_the_same_on_the_regex_engine(pattern: str, parts: list[str]) -> None:
    """Patterns written for ``re`` (the built-in ones among them) classify as they did."""
    message = " ".join(parts)
    assert (regex.search(pattern, message, regex.VERSION0) is not None) == (
        re.search(pattern, message) is not None
    )
