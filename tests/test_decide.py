"""Decisions: retry schedules and caps, exhaustion, fallback chains, determinism, observe."""

from __future__ import annotations

import hashlib
import textwrap

import pytest

from policies import Policy, load_policy
from supervisor.records import (
    Action,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
    remediation_ids,
)

T, M, P, S = (
    FailureClass.TRANSIENT,
    FailureClass.MODEL,
    FailureClass.PERMANENT,
    FailureClass.SEMANTIC,
)
BUILTIN = load_policy()


def failure(
    failure_class: FailureClass = T,
    kind: str = "rate_limit",
    *,
    dependency: str = "openai:gpt-4o",
    span_id: str = "00f067aa0ba902b7",
    retry_after_s: float | None = None,
    rule: str = "builtin.openai.rate_limit",
) -> Failure:
    return Failure(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id=span_id,
        parent_span_id="",
        service="agent",
        span_name="chat gpt-4o",
        run_id="4bf92f3577b34da6a3ce929d0e0e4736",
        role=Role.LLM,
        failure_class=failure_class,
        kind=kind,
        dependency=dependency,
        rule=rule,
        message="",
        evidence=ErrorEvidence(status_error=True, retry_after_s=retry_after_s),
        received_ns=0,
    )


def policy(text: str) -> Policy:
    return load_policy(text=textwrap.dedent(text).lstrip("\n"))


def delays(p: Policy, f: Failure, attempts: range) -> list[float | None]:
    out: list[float | None] = []
    for attempt in attempts:
        decision = p.decide(f, attempt=attempt)
        delay = decision.params.get("delay_s")
        assert delay is None or isinstance(delay, float)
        out.append(delay if decision.action is Action.RETRY else None)
    return out


# --- retry schedules --------------------------------------------------------------------

EXPONENTIAL = """
    version: 1
    policies:
      - name: t.retry
        match: {kind: timeout}
        action: retry
        max_attempts: 6
        wait: {type: exponential, multiplier: 0.5, max: 4, jitter: %s}
        honour_retry_after: true
        max_retry_after_s: 30
"""


def test_exponential_delays_double_up_to_the_cap_then_attempts_run_out() -> None:
    p = policy(EXPONENTIAL % "none")

    assert delays(p, failure(kind="timeout"), range(1, 8)) == [0.5, 1.0, 2.0, 4.0, 4.0, None, None]


def test_a_schedule_read_in_any_order_and_past_what_is_remembered_stays_tenacitys() -> None:
    """Backoff remembers the first 64 attempts' waits; later ones are asked each time."""
    p = policy((EXPONENTIAL % "none").replace("max_attempts: 6", "max_attempts: 100"))
    f = failure(kind="timeout")
    expected = [min(4.0, 0.5 * 2.0 ** (a - 1)) for a in range(1, 100)] + [None, None]

    backwards = delays(p, f, range(101, 0, -1))[::-1]

    assert backwards == expected
    assert delays(p, f, range(1, 102)) == expected


def test_fixed_delays_are_constant() -> None:
    p = policy(
        """
        version: 1
        policies:
          - {name: t.fixed, match: {kind: timeout}, action: retry, max_attempts: 3,
             wait: {type: fixed, seconds: 1.25}}
        """
    )

    assert delays(p, failure(kind="timeout"), range(1, 4)) == [1.25, 1.25, None]


def test_full_jitter_stays_below_the_schedule_and_spreads_failures() -> None:
    p = policy(EXPONENTIAL % "full")
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0]

    spans = [f"{i:016x}" for i in range(1, 41)]
    per_span = [delays(p, failure(kind="timeout", span_id=s), range(1, 6)) for s in spans]

    assert all(0 <= d <= c for row in per_span for d, c in zip(row, ceilings, strict=True))  # type: ignore[operator]
    assert len({row[3] for row in per_span}) > 30  # different failures, different delays


def test_equal_jitter_keeps_at_least_half_the_schedule() -> None:
    p = policy(EXPONENTIAL % "equal")

    row = delays(p, failure(kind="timeout"), range(1, 6))

    assert all(c / 2 <= d <= c for d, c in zip(row, [0.5, 1.0, 2.0, 4.0, 4.0], strict=True))  # type: ignore[operator]


def test_random_exponential_is_exponential_with_full_jitter() -> None:
    full = policy(EXPONENTIAL % "full")
    randomised = policy(
        (EXPONENTIAL % "full").replace("type: exponential", "type: random_exponential")
    )

    f = failure(kind="timeout")
    assert delays(full, f, range(1, 7)) == delays(randomised, f, range(1, 7))


def test_delays_are_rounded_to_milliseconds() -> None:
    row = delays(policy(EXPONENTIAL % "full"), failure(kind="timeout"), range(1, 6))

    assert row == [round(d, 3) for d in row if d is not None]


@pytest.mark.parametrize(
    ("retry_after_s", "expected"),
    [
        (10.0, 10.0),  # the server's word is a floor
        (100.0, 30.0),  # ...obeyed up to the cap
        (0.1, 0.5),  # the schedule's own delay when longer
        (float("inf"), 0.5),  # nonsense is ignored
        (-5.0, 0.5),
    ],
)
def test_retry_after_is_honoured_up_to_its_cap(retry_after_s: float, expected: float) -> None:
    p = policy(EXPONENTIAL % "none")

    decision = p.decide(failure(kind="timeout", retry_after_s=retry_after_s), attempt=1)

    assert (decision.action, decision.params["delay_s"]) == (Action.RETRY, expected)


def test_retry_after_is_ignored_when_not_honoured() -> None:
    p = policy(
        (EXPONENTIAL % "none").replace("honour_retry_after: true", "honour_retry_after: false")
    )

    decision = p.decide(failure(kind="timeout", retry_after_s=10.0), attempt=1)

    assert dict(decision.params) == {"attempt": 1, "max_attempts": 6, "delay_s": 0.5}


def test_builtin_rate_limit_honours_the_servers_retry_after() -> None:
    decision = BUILTIN.decide(failure(retry_after_s=2.0), attempt=1)

    assert decision.action is Action.RETRY
    assert decision.params["delay_s"] >= 2.0  # type: ignore[operator]
    assert (decision.params["attempt"], decision.params["max_attempts"]) == (1, 5)


# --- exhaustion ---------------------------------------------------------------------------

_REMEDIATION = remediation_ids(
    "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "builtin.openai.rate_limit"
)


@pytest.mark.parametrize(
    ("on_exhausted", "expected_action", "expected_params"),
    [
        ("escalate", Action.ESCALATE, {"pause_timeout_s": 3600.0, "on_timeout": "abort"}),
        (
            "{action: escalate, timeout_s: 600, on_timeout: resume}",
            Action.ESCALATE,
            {"pause_timeout_s": 600.0, "on_timeout": "resume"},
        ),
        ("fail_fast", Action.FAIL_FAST, {}),
        (
            "{action: remediate, remediator: fallback_switch}",
            Action.REMEDIATE,
            {
                "remediator": "fallback_switch",
                # derived from the failing span and rule: a second dispatch is the same one
                "remediation_id": _REMEDIATION[0],
                "remediation_trace_id": _REMEDIATION[1],
            },
        ),
        (
            '{action: fallback, chain: {"openai:*": ["anthropic:claude-3-5-haiku"]}}',
            Action.FALLBACK,
            {"to": "anthropic:claude-3-5-haiku", "chain": ("anthropic:claude-3-5-haiku",)},
        ),
        ("{action: fallback, on_exhausted: fail_fast}", Action.FAIL_FAST, {}),
    ],
)
def test_spent_attempts_take_the_on_exhausted_action(
    on_exhausted: str, expected_action: Action, expected_params: dict[str, object]
) -> None:
    p = policy(
        f"""
        version: 1
        policies:
          - name: t.retry
            match: {{kind: rate_limit}}
            action: retry
            max_attempts: 2
            on_exhausted: {on_exhausted}
        """
    )

    before, after = p.decide(failure(), attempt=1), p.decide(failure(), attempt=2)

    assert before.action is Action.RETRY
    assert (after.action, dict(after.params), after.policy) == (
        expected_action,
        expected_params,
        "t.retry",
    )
    assert "retries exhausted (2/2 attempts)" in after.reason


def test_one_attempt_means_no_retry_at_all() -> None:
    p = policy(
        """
        version: 1
        policies: [{name: t.once, match: {kind: rate_limit}, action: retry, max_attempts: 1}]
        """
    )

    assert p.decide(failure(), attempt=1).action is Action.ESCALATE


def test_attempts_below_one_count_as_the_first() -> None:
    assert BUILTIN.decide(failure(), attempt=0) == BUILTIN.decide(failure(), attempt=1)


# --- permanent failures ---------------------------------------------------------------------

PERMANENT_KINDS = [
    "auth",
    "permission",
    "not_found",
    "invalid_request",
    "quota_exhausted",
    "parse_error",
    "unknown",
    "my_own_kind",
]


@pytest.mark.parametrize("kind", PERMANENT_KINDS)
def test_builtin_never_retries_a_permanent_failure(kind: str) -> None:
    actions = {BUILTIN.decide(failure(P, kind), attempt=a).action for a in range(1, 8)}

    assert Action.RETRY not in actions


def test_a_user_retry_entry_skips_permanent_failures_unless_it_names_the_class() -> None:
    implicit = policy(
        """
        version: 1
        policies: [{name: t.retry_parse, match: {kind: parse_error}, action: retry}]
        """
    )
    explicit = policy(
        """
        version: 1
        policies:
          - {name: t.retry_parse, match: {kind: parse_error, class: permanent}, action: retry}
        """
    )

    skipped = implicit.decide(failure(P, "parse_error"), attempt=1)

    assert (skipped.action, skipped.policy) == (Action.FAIL_FAST, "builtin.permanent")
    assert implicit.decide(failure(M, "parse_error"), attempt=1).policy == "t.retry_parse"
    assert explicit.decide(failure(P, "parse_error"), attempt=1).action is Action.RETRY


# --- fallback chains ----------------------------------------------------------------------------

FALLBACK = """
    version: 1
    policies:
      - name: t.fallback
        match: {kind: quota_exhausted}
        action: fallback
        chain:
          "openai:*": ["openai:gpt-4o-mini", "anthropic:claude-3-5-haiku"]
          "azure:*": ["openai:gpt-4o"]
        on_exhausted: escalate
"""
CHAIN = ("openai:gpt-4o-mini", "anthropic:claude-3-5-haiku")
#: An escalation's pause: its deadline and what follows it (the defaults).
PAUSED = {"pause_timeout_s": 3600.0, "on_timeout": "abort"}


@pytest.mark.parametrize(
    ("dependency", "expected"),
    [
        ("openai:gpt-4o", (Action.FALLBACK, {"to": "openai:gpt-4o-mini", "chain": CHAIN})),
        (
            "openai:gpt-4o-mini",
            (Action.FALLBACK, {"to": "anthropic:claude-3-5-haiku", "chain": CHAIN}),
        ),
        ("azure:gpt-4o", (Action.FALLBACK, {"to": "openai:gpt-4o", "chain": ("openai:gpt-4o",)})),
        ("anthropic:claude-3-5-haiku", (Action.ESCALATE, PAUSED)),
        ("", (Action.ESCALATE, PAUSED)),
    ],
)
def test_fallback_moves_along_the_chain(
    dependency: str, expected: tuple[Action, dict[str, object]]
) -> None:
    decision = policy(FALLBACK).decide(
        failure(P, "quota_exhausted", dependency=dependency), attempt=1
    )

    assert expected == (decision.action, dict(decision.params))


def test_builtin_quota_exhaustion_has_no_chain_so_escalates() -> None:
    decision = BUILTIN.decide(failure(P, "quota_exhausted"), attempt=1)

    assert (decision.action, decision.policy) == (Action.ESCALATE, "builtin.quota_exhausted")
    assert "no fallback left for openai:gpt-4o" in decision.reason


# --- built-in decisions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure_class", "kind", "attempt", "expected"),
    [
        (T, "rate_limit", 1, (Action.RETRY, "builtin.rate_limit")),
        (T, "rate_limit", 5, (Action.ESCALATE, "builtin.rate_limit")),
        (T, "timeout", 1, (Action.RETRY, "builtin.transient_io")),
        (T, "connection", 3, (Action.RETRY, "builtin.transient_io")),
        (T, "unavailable", 4, (Action.ESCALATE, "builtin.transient_io")),
        (P, "auth", 1, (Action.FAIL_FAST, "builtin.fail_fast")),
        (P, "invalid_request", 1, (Action.FAIL_FAST, "builtin.fail_fast")),
        (M, "context_overflow", 1, (Action.REMEDIATE, "builtin.context_overflow")),
        (M, "output_truncated", 1, (Action.RETRY, "builtin.output_truncated")),
        (M, "output_truncated", 2, (Action.ESCALATE, "builtin.output_truncated")),
        (M, "parse_error", 2, (Action.RETRY, "builtin.model_output")),
        (M, "invalid_tool_call", 3, (Action.ESCALATE, "builtin.model_output")),
        (M, "content_policy", 1, (Action.ESCALATE, "builtin.content_policy")),
        (T, "tool_error", 1, (Action.RETRY, "builtin.tool_error")),
        (T, "tool_error", 2, (Action.ESCALATE, "builtin.tool_error")),
        (P, "unknown", 1, (Action.ESCALATE, "builtin.unknown")),
        (P, "parse_error", 1, (Action.FAIL_FAST, "builtin.permanent")),
        (T, "my_flaky_thing", 1, (Action.RETRY, "builtin.transient")),
        (M, "my_model_thing", 2, (Action.ESCALATE, "builtin.model")),
        (M, "reasoning_loop", 1, (Action.REMEDIATE, "builtin.reasoning_loop")),
        (T, "stall", 1, (Action.REMEDIATE, "builtin.stall")),
        (S, "verification_failed", 1, (Action.REMEDIATE, "builtin.verification_failed")),
        (P, "budget_exceeded", 1, (Action.ESCALATE, "builtin.budget_exceeded")),
    ],
)
def test_builtin_decisions(
    failure_class: FailureClass, kind: str, attempt: int, expected: tuple[Action, str]
) -> None:
    decision = BUILTIN.decide(failure(failure_class, kind), attempt=attempt)

    assert expected == (decision.action, decision.policy)


def test_context_overflow_names_its_remediator() -> None:
    decision = BUILTIN.decide(failure(M, "context_overflow"), attempt=1)

    assert decision.params["remediator"] == "compact_context"
    # The decision names the remediation (workflow id and trace) before it starts.
    f = failure(M, "context_overflow")
    ids = remediation_ids(f.trace_id, f.span_id, f.rule)
    assert (decision.params["remediation_id"], decision.params["remediation_trace_id"]) == ids


# --- determinism and observe mode ----------------------------------------------------------------


def test_the_same_failure_always_gets_the_same_decision() -> None:
    f = failure(kind="timeout")
    again = load_policy(text="version: 1\n")

    first = [BUILTIN.decide(f, attempt=a) for a in range(1, 6)]

    assert first == [BUILTIN.decide(f, attempt=a) for a in range(1, 6)]
    assert first == [again.decide(f, attempt=a) for a in range(1, 6)]


def test_jitter_is_pinned_by_a_stable_hash_not_the_process() -> None:
    # The fraction is blake2b(trace id / span id / entry name), the same in every
    # process and release; at attempt 3 the schedule's ceiling is 8 s and its floor
    # 1 s (the built-in floor for timeouts), full jitter in between.
    key = b"4bf92f3577b34da6a3ce929d0e0e4736/00f067aa0ba902b7/builtin.transient_io"
    fraction = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64

    decision = BUILTIN.decide(failure(kind="timeout"), attempt=3)

    assert (decision.params["delay_s"], round(1.0 + 7.0 * fraction, 3)) == (7.195, 7.195)


def test_an_observe_entry_is_reported_but_not_delivered() -> None:
    p = policy(
        """
        version: 1
        policies:
          - {name: t.shadow, match: {kind: timeout}, action: fail_fast, observe: true}
        """
    )

    shadow, live = p.decide(failure(kind="timeout"), attempt=1), p.decide(failure(), attempt=1)

    assert (shadow.action, shadow.observe_only) == (Action.FAIL_FAST, True)
    assert (live.policy, live.observe_only) == ("builtin.rate_limit", False)


def test_top_level_observe_covers_the_builtin_entries_too() -> None:
    p = load_policy(text="version: 1\nobserve: true\n")

    decisions: list[Decision] = [
        p.decide(failure(c, k), attempt=1)
        for c, k in [
            (T, "rate_limit"),
            (P, "auth"),
            (M, "context_overflow"),
            (P, "quota_exhausted"),
        ]
    ]

    assert [d.observe_only for d in decisions] == [True] * 4
    assert BUILTIN.decide(failure(), attempt=1).observe_only is False


def test_a_retry_that_runs_out_falls_back_along_the_chain_the_policy_gives() -> None:
    # The built-in retries end in a fallback with no chain of their own: one chain,
    # written once for the outage entry, serves the rate limits too.
    p = policy(
        """
        version: 1
        policies:
          - name: primary_down
            match: {kind: unavailable, dependency: "openai:gpt-4o"}
            action: fallback
            chain:
              "openai:gpt-4o": ["openai:gpt-4o-mini"]
        """
    )

    exhausted = p.decide(failure(T, "rate_limit"), attempt=6)

    assert (exhausted.action, exhausted.policy) == (Action.FALLBACK, "builtin.rate_limit")
    assert exhausted.params["to"] == "openai:gpt-4o-mini"
    # A dependency no chain covers still ends where it did: a person.
    elsewhere = p.decide(failure(T, "rate_limit", dependency="anthropic:claude"), attempt=6)
    assert elsewhere.action is Action.ESCALATE
