"""The client's local policy against the built-in rules, and what it reads from a response.

The local policy classifies with a small table of its own (importing the
policy engine into every agent costs too much: see ``supervisor.client._local``).
These tests hold that table to the built-in rules: every HTTP status, every
exception name and every message phrase the built-in rules class as
transient is transient locally with the same kind, and nothing else is.
"""

from __future__ import annotations

import socket
from importlib import resources
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import Policy, load_policy
from supervisor.api.inline import Question, decide
from supervisor.client import LocalPolicy, SupervisorClient
from supervisor.records import Action

DEP = "openai:gpt-4o"
LOCAL = LocalPolicy(rng=lambda: 0.5)


@pytest.fixture(scope="module")
def builtin() -> Policy:
    return load_policy()


def builtin_rules() -> list[dict[str, Any]]:
    text = resources.files("policies").joinpath("default_policy.yaml").read_text("utf-8")
    rules: list[dict[str, Any]] = yaml.safe_load(text)["rules"]
    return rules


def sidecar_verdict(policy: Policy, **question: Any) -> str:
    """The kind the sidecar retries as transient, or ``""``: the local policy fails fast then."""
    answer = decide(policy, None, Question(dependency=DEP, **question))
    return str(answer["kind"]) if answer["class"] == "transient" else ""


def local_verdict(**question: Any) -> str:
    advice = LOCAL.advise(DEP, attempt=1, **question)
    if advice.action is Action.RETRY:
        assert advice.failure_class == "transient"
        return advice.kind
    assert advice.action is Action.FAIL_FAST
    return ""


def test_every_http_status_is_classed_as_the_builtin_rules_class_it(builtin: Policy) -> None:
    differ = [
        (code, sidecar_verdict(builtin, status_code=code), local_verdict(status_code=code))
        for code in range(100, 600)
        if sidecar_verdict(builtin, status_code=code) != local_verdict(status_code=code)
    ]
    assert differ == []


def _names(rule: dict[str, Any]) -> list[str]:
    """Exception names an ``exception_type`` rule matches: its names, its globs filled in."""
    globs = rule["match"]["exception_type"]
    globs = [globs] if isinstance(globs, str) else globs
    names = [glob.replace("*", "Some") for glob in globs]
    return names + [f"somesdk.{name}" for name in names]


def test_every_exception_name_of_the_builtin_rules(builtin: Policy) -> None:
    rules = [r for r in builtin_rules() if set(r["match"]) == {"exception_type"}]
    assert len(rules) > 10
    differ = []
    for rule in rules:
        for name in _names(rule):
            sidecar = sidecar_verdict(builtin, exception_type=name)
            local = local_verdict(exception_type=name)
            if sidecar != local:
                differ.append((rule["name"], name, sidecar, local))
    assert differ == []


def _text_patterns() -> list[tuple[str, str]]:
    """(regex, kind) of the built-in rules that class a message as transient."""
    out = []
    for rule in builtin_rules():
        if set(rule["match"]) == {"message"} and rule["class"] == "transient":
            patterns = rule["match"]["message"]
            for pattern in [patterns] if isinstance(patterns, str) else patterns:
                out.append((pattern, rule["kind"]))
    return out


_TEXT_PATTERNS = _text_patterns()


def test_the_builtin_text_rules_are_found() -> None:
    assert {kind for _, kind in _TEXT_PATTERNS} == {
        "rate_limit",
        "timeout",
        "connection",
        "unavailable",
    }


@settings(max_examples=300, deadline=None)
@given(data=st.data(), index=st.integers(0, len(_TEXT_PATTERNS) - 1))
def test_messages_the_builtin_text_rules_class_as_transient(
    data: st.DataObject, index: int
) -> None:
    pattern, kind = _TEXT_PATTERNS[index]
    message = data.draw(st.from_regex(pattern, fullmatch=True).filter(str.isprintable))
    assert local_verdict(message=message) == kind, message


@pytest.mark.parametrize(
    "message",
    [
        "You exceeded your current quota, please check your plan",
        "Error code: 429 - {'error': {'code': 'insufficient_quota'}}",
        "Your credit balance is too low to access the Anthropic API",
        "billing_hard_limit_reached",
    ],
)
def test_an_exhausted_quota_is_not_retried_even_as_a_429(builtin: Policy, message: str) -> None:
    answer = decide(builtin, None, Question(dependency=DEP, status_code=429, message=message))
    advice = LOCAL.advise(DEP, status_code=429, message=message)
    assert (answer["kind"], advice.kind, advice.action) == (
        "quota_exhausted",
        "quota_exhausted",
        Action.FAIL_FAST,
    )


@pytest.mark.parametrize(
    "question",
    [
        {"status_code": 401, "message": "timed out"},  # the status speaks louder
        {"status_code": 400, "exception_type": "openai.BadRequestError"},
        {"exception_type": "ValueError", "message": "bad input"},
        {"exception_type": "openai.RateLimitError", "message": "Rate limit reached for gpt-4o"},
        {"exception_type": "httpx.ReadError", "message": ""},
        {"exception_type": "threading.ThreadError", "message": "cannot start"},
        {"message": "no errors found; rates fell"},
        {},
    ],
)
def test_mixed_evidence_is_classed_alike(builtin: Policy, question: dict[str, Any]) -> None:
    assert local_verdict(**question) == sidecar_verdict(builtin, **question)


# -- what the client reads from a caught exception's response --------------------------------


@pytest.fixture
def closed_port() -> str:
    """A loopback URL where nothing answers, so the local policy does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def failed_response(status: int, headers: dict[str, str], message: str) -> Exception:
    request = httpx.Request("POST", "https://api.example.com/v1/chat")
    response = httpx.Response(status, request=request, headers=headers)
    return httpx.HTTPStatusError(message, request=request, response=response)


@pytest.mark.parametrize(
    ("headers", "message", "delay"),
    [
        ({"retry-after-ms": "2500", "retry-after": "9"}, "", 2.5),
        ({"Retry-After": "7"}, "Please try again in 1s", 7.0),
        ({"retry-after": "Wed, 01 Jan 2025 12:00:10 GMT"}, "", 0.5),  # in the past: now
        ({"x-ratelimit-reset-requests": "2s", "x-ratelimit-reset-tokens": "1m30s"}, "", 60.0),
        ({}, "Please try again in 4.5s", 4.5),
        ({"retry-after": "soon"}, "", 0.5),
    ],
)
def test_the_local_policy_waits_what_the_response_asks(
    headers: dict[str, str], message: str, delay: float, closed_port: str
) -> None:
    """The delay is read from headers as the sidecar reads them from spans; 0.5 s is the jitter."""
    with SupervisorClient(closed_port, token="t", timeout_s=0.2, local_policy=LOCAL) as client:
        advice = client.decide(DEP, exception=failed_response(429, headers, message))
    assert (advice.source, advice.action, advice.delay_s) == ("local", Action.RETRY, delay)
