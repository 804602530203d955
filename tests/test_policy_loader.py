"""Loading policies: layering on the built-in one, and every issue with its path and line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import MappingProxyType
from typing import get_args

import pytest

from policies import Policy, json_schema, load_policy
from policies._schema_fields import ClassName, RoleName
from supervisor.errors import PolicyError, PolicyIssue
from supervisor.records import (
    Action,
    AttrValue,
    ErrorEvidence,
    FailureClass,
    Role,
    SpanRecord,
)


def yaml(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def span(
    evidence: ErrorEvidence,
    *,
    role: Role = Role.LLM,
    attributes: dict[str, AttrValue] | None = None,
) -> SpanRecord:
    return SpanRecord(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        parent_span_id="",
        name="chat gpt-4o",
        service="billing-agent",
        kind=3,
        start_ns=0,
        end_ns=1,
        role=role,
        dependency="openai:gpt-4o",
        provider="openai",
        model="gpt-4o",
        error=evidence,
        attributes=MappingProxyType(attributes or {}),
    )


def issues_of(text: str) -> list[tuple[str, int | None]]:
    with pytest.raises(PolicyError) as caught:
        load_policy(text=text, source="p.yaml")
    return [(i.path, i.line) for i in caught.value.issues]


RATE_LIMIT = ErrorEvidence(
    status_error=True,
    exception_type="openai.RateLimitError",
    exception_message="Error code: 429 - {'error': {'code': 'rate_limit_exceeded'}}",
    http_status=429,
    provider_code="rate_limit_exceeded",
)

USER = yaml(
    """
    version: 1
    rules:
      - name: acme.search_flaky
        match: {exception_type: "acme.*", role: tool}
        class: transient
        kind: search_flaky
    policies:
      - name: acme.search_flaky
        match: {kind: search_flaky}
        action: retry
        max_attempts: 2
    """
)


# --- the built-in policy -----------------------------------------------------------


def test_the_builtin_policy_ends_with_catch_alls() -> None:
    policy = load_policy()

    assert (policy.source, policy.rules[-1], policy.policies[-1]) == (
        "<builtin>",
        "builtin.unknown",
        "builtin.default",
    )
    assert all(name.startswith("builtin.") for name in policy.rules + policy.policies)


def test_the_builtin_policy_is_loaded_once() -> None:
    assert load_policy() is load_policy()


def test_schema_literals_match_the_records_enums() -> None:
    assert set(get_args(ClassName)) == {c.value for c in FailureClass}
    assert set(get_args(RoleName)) == {r.value for r in Role}


# --- layering -------------------------------------------------------------------------


def test_user_rules_and_entries_come_before_the_builtin_ones() -> None:
    builtin = load_policy()

    policy = load_policy(text=USER)

    assert policy.rules == ("acme.search_flaky", *builtin.rules)
    assert policy.policies == ("acme.search_flaky", *builtin.policies)
    assert policy.source == "<string>"


def test_a_user_rule_wins_over_the_builtin_one() -> None:
    text = yaml(
        """
        version: 1
        rules:
          - name: acme.openai_429
            match: {http_status: 429, dependency: "openai:*"}
            class: transient
            kind: rate_limit
            dependency: "{provider}"
        """
    )

    verdict = load_policy(text=text).classify(span(RATE_LIMIT))

    assert verdict is not None
    assert (verdict.rule, verdict.kind, verdict.dependency) == (
        "acme.openai_429",
        "rate_limit",
        "openai",
    )


def test_builtin_false_keeps_only_the_catch_alls() -> None:
    policy = load_policy(text="builtin: false\n" + USER)

    assert policy.rules == ("acme.search_flaky", "builtin.unknown")
    assert policy.policies == ("acme.search_flaky", "builtin.default")
    verdict = policy.classify(span(RATE_LIMIT))
    assert verdict is not None
    assert (verdict.failure_class, verdict.kind, verdict.rule) == (
        FailureClass.PERMANENT,
        "unknown",
        "builtin.unknown",
    )


def test_loading_from_a_path_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(USER, encoding="utf-8")

    policy = load_policy(path)

    assert isinstance(policy, Policy)
    assert (policy.source, policy.rules[0]) == (str(path), "acme.search_flaky")


def test_a_path_and_text_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        load_policy("x.yaml", text=USER)


def test_a_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    with pytest.raises(PolicyError) as caught:
        load_policy(path)

    [issue] = caught.value.issues
    assert (issue.source, issue.path, issue.line) == (str(path), "", None)
    assert issue.message.startswith("cannot read")


def test_a_file_that_is_not_utf8_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\n# caf\xe9\n")

    with pytest.raises(PolicyError) as caught:
        load_policy(path)

    assert [i.message.split(":")[0] for i in caught.value.issues] == ["not UTF-8 text"]


# --- what a rule can match ------------------------------------------------------------------


def classify_with(match: str, evidence: ErrorEvidence, **span_kw: object) -> str | None:
    text = yaml(
        f"""
        version: 1
        builtin: false
        rules:
          - name: t
            match: {match}
            class: transient
            kind: timeout
        """
    )
    verdict = load_policy(text=text).classify(span(evidence, **span_kw))  # type: ignore[arg-type]
    return None if verdict is None else verdict.rule


@pytest.mark.parametrize(
    ("match", "evidence", "expected"),
    [
        ('{http_status: "5xx"}', ErrorEvidence(http_status=503), "t"),
        ('{http_status: "5xx"}', ErrorEvidence(http_status=429), "builtin.unknown"),
        ('{http_status: "500-502"}', ErrorEvidence(http_status=502), "t"),
        ("{http_status: [[500, 502]]}", ErrorEvidence(http_status=501), "t"),
        ("{http_status: [500, 502]}", ErrorEvidence(http_status=501), "builtin.unknown"),
        ('{http_status: "429"}', ErrorEvidence(http_status=429), "t"),
        ("{grpc_code: unavailable}", ErrorEvidence(grpc_code=14), "t"),
        ("{grpc_code: [4, UNAVAILABLE]}", ErrorEvidence(grpc_code=4), "t"),
        ("{exception_type: RateLimitError}", RATE_LIMIT, "t"),
        ('{exception_type: "openai.*"}', RATE_LIMIT, "t"),
        ("{exception_type: ratelimiterror}", RATE_LIMIT, "builtin.unknown"),
        ('{error_type: "*Timeout"}', ErrorEvidence(error_type="httpx.ReadTimeout"), "t"),
        ("{provider_code: rate_limit_*}", RATE_LIMIT, "t"),
        ("{message: '(?i)RATE_LIMIT_EXCEEDED'}", RATE_LIMIT, "t"),
        ("{message: 'RATE_LIMIT_EXCEEDED'}", RATE_LIMIT, "builtin.unknown"),
        (
            "{message: 'rate_limit_exceeded', http_status: 500}",
            RATE_LIMIT,
            "builtin.unknown",
        ),
        ("{finish_reason: LENGTH}", ErrorEvidence(finish_reasons=("length",)), "t"),
        ("{role: [tool, llm]}", RATE_LIMIT, "t"),
        ("{role: tool}", RATE_LIMIT, "builtin.unknown"),
        ('{service: "billing-*", dependency: "openai:*"}', RATE_LIMIT, "t"),
        ('{span_name: "chat *"}', RATE_LIMIT, "t"),
        ("{swallowed: true}", ErrorEvidence(swallowed=True), "t"),
        ("{swallowed: false}", ErrorEvidence(swallowed=True), "builtin.unknown"),
        ("{invalid_tool_call: true}", ErrorEvidence(invalid_tool_calls=("x",)), "t"),
        ("{}", ErrorEvidence(status_error=True), "t"),
    ],
)
def test_rule_conditions(match: str, evidence: ErrorEvidence, expected: str) -> None:
    assert expected == classify_with(match, evidence)


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ({"gen_ai.system": "openai", "retries": 2}, "t"),
        ({"gen_ai.system": "openai", "retries": 3}, "builtin.unknown"),
        ({"gen_ai.system": "openai"}, "builtin.unknown"),
        ({"gen_ai.system": "azure.openai", "retries": 2}, "builtin.unknown"),
    ],
)
def test_attribute_conditions(attributes: dict[str, AttrValue], expected: str) -> None:
    match = '{attributes: {gen_ai.system: openai, retries: 2, "http.route": {regex: "^/v1/"}}}'
    attrs: dict[str, AttrValue] = {"http.route": "/v1/chat", **attributes}

    assert expected == classify_with(match, RATE_LIMIT, attributes=attrs)


def test_an_attribute_true_does_not_equal_one() -> None:
    match = "{attributes: {streaming: true}}"

    assert classify_with(match, RATE_LIMIT, attributes={"streaming": 1}) == "builtin.unknown"
    assert classify_with(match, RATE_LIMIT, attributes={"streaming": True}) == "t"


def test_a_dependency_template_uses_record_fields() -> None:
    text = yaml(
        """
        version: 1
        rules:
          - name: acme.quota
            match: {provider_code: insufficient_quota}
            class: permanent
            kind: quota_exhausted
            dependency: "account:{provider}/{service}"
        """
    )
    evidence = ErrorEvidence(status_error=True, provider_code="insufficient_quota")

    verdict = load_policy(text=text).classify(span(evidence))

    assert verdict is not None
    assert verdict.dependency == "account:openai/billing-agent"


# --- issues: path and line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "words"),
    [
        pytest.param("version: 1\nrules: [\n", [("", 3)], "YAML syntax error", id="yaml-syntax"),
        pytest.param("version: 1\n\tbad: tab\n", [("", 2)], "YAML syntax error", id="yaml-tab"),
        pytest.param("", [("", 1)], "empty policy document", id="empty"),
        pytest.param("- 1\n", [("", 1)], "a policy file is a mapping", id="not-a-mapping"),
        pytest.param("rules: []\n", [("version", 1)], "missing required key", id="no-version"),
        pytest.param("version: 2\n", [("version", 1)], "unknown value 2", id="version-2"),
        pytest.param(
            "version: 1\nversion: 1\n", [("version", 2)], "duplicate key", id="duplicate-key"
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match:
                  mesage: x
                class: model
                kind: parse_error
            """,
            [("rules[0].match.mesage", 5)],
            "did you mean 'message'",
            id="unknown-key",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match: {exception_type: Foo}
                class: model
                kind: parse_error
              - name: r2
                match:
                  message: "rate (limit"
                class: model
                kind: parse_error
            """,
            [("rules[1].match.message", 9)],
            "bad regex 'rate (limit': missing )",
            id="bad-regex",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match:
                  message: [ok, "a{99999999999}"]
                class: model
                kind: parse_error
            """,
            [("rules[0].match.message[1]", 5)],
            "bad regex",
            id="bad-regex-overflow",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match: {exception_type: "[abc"}
                class: model
                kind: parse_error
            """,
            [("rules[0].match.exception_type", 4)],
            "unclosed '['",
            id="bad-glob",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match: {}
                class: transeint
                kind: parse_error
            """,
            [("rules[0].class", 5)],
            "unknown value 'transeint'",
            id="unknown-class",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                match: {class: [transient, temporary]}
                action: none
            """,
            [("policies[0].match.class[1]", 4)],
            "unknown value 'temporary'",
            id="unknown-class-in-decision",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retyr
            """,
            [("policies[0]", 3)],
            "unknown action 'retyr'",
            id="unknown-action",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                on_exhausted: retry
            """,
            [("policies[0].on_exhausted", 5)],
            "unknown action 'retry'",
            id="retry-cannot-follow-retry",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                wait: {type: exponential, max: .inf}
            """,
            [("policies[0].wait.max", 5)],
            "finite",
            id="infinite-knob",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                max_retry_after_s: .nan
            """,
            [("policies[0].max_retry_after_s", 5)],
            "finite",
            id="nan-knob",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                max_attempts: 1000000
            """,
            [("policies[0].max_attempts", 5)],
            "less than or equal to 100",
            id="unbounded-attempts",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                max_attempts: "3"
            """,
            [("policies[0].max_attempts", 5)],
            "valid integer, got str '3'",
            id="wrong-type",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: retry
                wait:
                  min: 10
                  max: 5
            """,
            [("policies[0].wait", 5)],
            "wait.min (10.0) is above wait.max (5.0)",
            id="min-above-max",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: remediate
            """,
            [("policies[0].remediator", 3)],
            "missing required key 'remediator'",
            id="missing-remediator",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                match: {kind: rate_limt}
                action: escalate
            """,
            [("policies[0].match.kind", 4)],
            "unknown kind 'rate_limt'",
            id="unknown-kind",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: r
                match: {http_status: 6xx, grpc_code: NOPE}
                class: transient
                kind: timeout
                dependency: "{host}"
            """,
            [
                ("rules[0].match.grpc_code", 4),
                ("rules[0].match.http_status", 4),
                ("rules[0].dependency", 7),
            ],
            "",
            id="bad-codes-and-template",
        ),
        pytest.param(
            """
            version: 1
            rules:
              - name: builtin.mine
                class: transient
                kind: timeout
              - name: builtin.mine
                class: transient
                kind: timeout
            """,
            [
                ("rules[0].name", 3),
                ("rules[1].name", 6),
                ("rules[1].name", 6),
            ],
            "",
            id="reserved-and-duplicate-names",
        ),
        pytest.param(
            """
            version: 1
            policies:
              - name: p
                action: fallback
                chain:
                  "openai:[gpt": [x]
            """,
            [('policies[0].chain["openai:[gpt"]', 6)],
            "unclosed '['",
            id="bad-glob-as-chain-key",
        ),
        pytest.param("a: &a [*a]\n", [("", 1)], "recursive YAML alias", id="recursive-alias"),
        pytest.param(
            "version: 1\nrules: !!python/object/apply:os.system [echo]\n",
            [("", 2)],
            "could not determine a constructor",
            id="unsafe-tag",
        ),
    ],
)
def test_every_error_kind_has_its_path_and_line(
    text: str, expected: list[tuple[str, int]], words: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(text=yaml(text), source="p.yaml")

    issues = caught.value.issues
    assert expected == [(i.path, i.line) for i in issues]
    assert all(i.source == "p.yaml" for i in issues)
    assert words in issues[0].message


def test_every_issue_of_a_file_is_reported_at_once() -> None:
    text = yaml(
        """
        version: 1
        rules:
          - name: a
            match: {message: "("}
            class: nope
            kind: timeout
        policies:
          - name: b
            match: {kind: nope}
            action: escalate
          - name: c
            action: retry
            wait: {type: fixed, seconds: -1}
        """
    )

    assert issues_of(text) == [
        ("rules[0].match.message", 4),
        ("rules[0].class", 5),
        ("policies[0].match.kind", 9),
        ("policies[1].wait.seconds", 13),
    ]


def test_the_error_message_lists_every_issue() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(text="version: 1\nrules: 3\npolicies: 4\n", source="p.yaml")

    assert str(caught.value).splitlines() == [
        str(PolicyIssue("p.yaml", "rules", 2, "Input should be a valid list, got int 3")),
        str(PolicyIssue("p.yaml", "policies", 3, "Input should be a valid list, got int 4")),
    ]


def test_deeply_nested_yaml_is_refused_not_crashed() -> None:
    text = "version: 1\nrules: " + "[" * 5000 + "]" * 5000 + "\n"

    with pytest.raises(PolicyError):
        load_policy(text=text)


def test_an_alias_bomb_is_refused() -> None:
    lines = ["version: 1", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]

    with pytest.raises(PolicyError) as caught:
        load_policy(text="\n".join(lines))

    assert [i.message for i in caught.value.issues] == ["more than 200000 YAML nodes once expanded"]


# --- the JSON Schema ----------------------------------------------------------------------


def test_json_schema_describes_the_file() -> None:
    schema = json_schema()

    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["version"]["const"] == 1
    assert set(schema["properties"]) == {
        "version",
        "admission",
        "builtin",
        "observe",
        "rules",
        "policies",
        "fallbacks",
        "breakers",
        "retry_budget",
        "restart_intensity",
        "remediators",
        "detectors",
        "context_pressure",
        "run_budget",
        "service_budgets",
        "verifiers",
        "slo",
    }
    assert schema["$defs"]["Rule"]["properties"]["class"]["enum"] == [
        "transient",
        "model",
        "permanent",
        "semantic",
    ]
    assert schema["$defs"]["Rule"]["additionalProperties"] is False
    actions = set(schema["properties"]["policies"]["items"]["discriminator"]["mapping"])
    assert actions == {a.value for a in Action}


def test_policies_imports_nothing_of_ours_but_the_records_and_errors() -> None:
    code = (
        "import sys, policies; policies.load_policy();"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('supervisor', 'remediators'))))"
    )

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )

    assert out.stdout.split() == ["supervisor", "supervisor.errors", "supervisor.records"]


def test_remediators_are_checked_at_load() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(
            text="""\
version: 1
remediators:
  fixer:
    use: llm
    tools: [switch_fallback, shell]
    budget: {steps: -1, deadline_s: 0}
policies:
  - name: nobody
    match: {kind: auth}
    action: remediate
    remediator: nobody
  - name: nested
    match: {kind: rate_limit}
    action: retry
    on_exhausted: {action: remediate, remediator: ghost}
"""
        )
    text = str(caught.value)
    assert "remediators.fixer.tools[1]: unknown value 'shell'" in text
    assert "remediators.fixer.budget.steps" in text
    assert "remediators.fixer.budget.deadline_s" in text
    assert "policies[0].remediator: unknown remediator 'nobody'" in text
    assert "policies[1].on_exhausted.remediator: unknown remediator 'ghost'" in text


def test_a_defined_remediator_is_compiled_with_its_settings() -> None:
    policy = load_policy(
        text="""\
version: 1
remediators:
  switch:
    use: fallback_switch
    budget: {tool_calls: 2}
    verify_window_s: 5
policies:
  - name: s
    match: {kind: rate_limit}
    action: remediate
    remediator: switch
"""
    )
    spec = policy.remediator("switch")
    assert spec is not None
    assert (spec.use, spec.budget.tool_calls, spec.verify_window_s) == ("fallback_switch", 2, 5)
    assert "switch" in policy.remediators_used
    builtin = policy.remediator("retry_step")
    assert builtin is not None and builtin.use == "retry_step"  # built-ins need no entry
    assert policy.remediator("undefined") is None


def test_a_run_budget_with_abort_run_aborts_instead_of_escalating() -> None:
    from supervisor.records import ErrorEvidence, Failure, FailureClass, Role

    def over(policy: Policy) -> str:
        failure = Failure(
            trace_id="a" * 32,
            span_id="b" * 16,
            parent_span_id="",
            service="agent",
            span_name="chat",
            run_id="a" * 32,
            role=Role.LLM,
            failure_class=FailureClass.PERMANENT,
            kind="budget_exceeded",
            dependency="openai:gpt-4o",
            rule="builtin.detect.run_budget",
            message="",
            evidence=ErrorEvidence(),
            received_ns=0,
        )
        return policy.decide(failure, attempt=1).action.value

    assert over(load_policy(text="version: 1\nrun_budget: {max_cost_usd: 5}\n")) == "escalate"
    aborting = "version: 1\nrun_budget: {max_cost_usd: 5, action: abort_run}\n"
    assert over(load_policy(text=aborting)) == "fail_fast"


def test_the_builtin_verifiers_come_with_the_builtin_policy_only() -> None:
    assert load_policy().verifiers.names == ("builtin.final_answer",)
    assert load_policy(text="version: 1\n").verifiers.names == ("builtin.final_answer",)
    assert load_policy(text="version: 1\nbuiltin: false\n").verifiers.names == ()


def test_verifier_names_starting_builtin_are_reserved() -> None:
    text = "version: 1\nverifiers:\n  - {name: builtin.mine, output_empty: true}\n"
    with pytest.raises(PolicyError) as caught:
        load_policy(text=text)
    assert "verifiers[0].name" in str(caught.value)
