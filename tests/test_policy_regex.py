"""Regexes in classification rules: ``re`` syntax on the ``regex`` engine, bounded in time.

An operator writes the pattern, a span supplies the text: a pattern that
backtracks badly must cost one bounded search per span, never the loop.
"""

from __future__ import annotations

import logging
import time

import pytest

from policies import load_policy, regex_timeouts
from policies._match import Attributes, Message, Subject
from policies._regex import REGEX_TIMEOUT_S, PolicyRegex
from supervisor.records import ErrorEvidence, Role, SpanRecord

#: Fails in about 2**n steps on "a" * n + "!": far past any time limit at n = 30.
SLOW = "^(a|a)*$"
SLOW_TEXT = "a" * 30 + "!"


def span(message: str, **attributes: str) -> SpanRecord:
    return SpanRecord(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        parent_span_id="",
        name="lookup",
        service="agent",
        kind=0,
        start_ns=0,
        end_ns=1,
        role=Role.TOOL,
        error=ErrorEvidence(status_error=True, exception_message=message),
        attributes=attributes,
    )


def subject(message: str) -> Subject:
    record = span(message)
    assert record.error is not None
    return Subject(record, record.error)


def test_a_nested_quantifier_rule_does_not_hold_the_loop() -> None:
    policy = load_policy(
        text="""
version: 1
rules:
  - name: user.nested
    match: {message: '(a+)+$'}
    class: permanent
    kind: nested
""",
        source="nested.yaml",
    )
    start = time.monotonic()
    verdict = policy.classify(span("a" * 28 + "!"))
    assert time.monotonic() - start < 2.0
    assert verdict is not None
    assert verdict.rule != "user.nested"
    verdict = policy.classify(span("aaaa"))
    assert verdict is not None
    assert verdict.rule == "user.nested"


def test_a_search_that_times_out_is_no_match_and_the_next_rule_decides() -> None:
    policy = load_policy(
        text=f"""
version: 1
rules:
  - name: user.slow
    match: {{message: '{SLOW}'}}
    class: permanent
    kind: slow
  - name: user.bang
    match: {{message: '!$'}}
    class: transient
    kind: bang
""",
        source="slow.yaml",
    )
    start = time.monotonic()
    verdict = policy.classify(span(SLOW_TEXT))
    assert time.monotonic() - start < 2.0
    assert verdict is not None
    assert verdict.rule == "user.bang"
    verdict = policy.classify(span("aaa"))
    assert verdict is not None
    assert verdict.rule == "user.slow"


def test_timeouts_are_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    message = Message([SLOW], "user.slow")
    regex = message.tests[0][2]
    with caplog.at_level(logging.WARNING, logger="spanvisor.policies"):
        assert not message(subject(SLOW_TEXT))
        assert not message(subject(SLOW_TEXT))
    assert regex.timeouts == 2
    (record,) = caplog.records
    assert record.getMessage() == (
        f"rule user.slow message regex /{SLOW}/ timed out after {REGEX_TIMEOUT_S * 1000:.0f} ms"
        f" on a {len(SLOW_TEXT)}-character text and counts as no match; later timeouts of"
        " this pattern are counted, not logged"
    )


def test_timeouts_of_every_pattern_add_up_where_stats_read_them() -> None:
    before = regex_timeouts()
    message = Message([SLOW], "user.slow")
    assert not message(subject(SLOW_TEXT))
    assert regex_timeouts() == before + 1


def test_a_long_nested_quantifier_message_is_judged_within_the_time_limit() -> None:
    """The reported case, at the longest text a rule reads: bounded by the limit, not 2**n."""
    policy = load_policy(
        text="version: 1\nrules:\n  - name: user.nested\n    match: {message: '(a+)+$'}\n"
        "    class: permanent\n    kind: nested\n",
        source="nested.yaml",
    )
    start = time.monotonic()
    for n in (28, 40, 8000):
        verdict = policy.classify(span("a" * n + "!"))
        assert verdict is not None
        assert verdict.rule != "user.nested"
    assert time.monotonic() - start < 1.0


def test_attribute_regexes_are_bounded_too() -> None:
    attributes = Attributes({"tool.input": ("regex", SLOW)}, "user.slow")
    record = span("boom", **{"tool.input": SLOW_TEXT})
    assert record.error is not None
    start = time.monotonic()
    assert not attributes(Subject(record, record.error))
    assert time.monotonic() - start < 2.0
    record = span("boom", **{"tool.input": "aa"})
    assert record.error is not None
    assert attributes(Subject(record, record.error))


def test_search_raises_for_callers_that_decide_themselves() -> None:
    regex = PolicyRegex(SLOW)
    with pytest.raises(TimeoutError):
        regex.search(SLOW_TEXT)
    assert regex.timeouts == 0  # only matches() counts


@pytest.mark.parametrize(
    ("pattern", "text", "found"),
    [
        ("(?i)quota exceeded", "QUOTA Exceeded", True),
        (r"(?P<code>\d{3}) then (?P=code)", "429 then 429", True),
        (r"(?P<code>\d{3}) then (?P=code)", "429 then 500", False),
        (r"(?i)error (?:code )?(\d+): \1", "ERROR 7: 7", True),
        (r"(?s)begin.*end", "begin\nend", True),
        (r"(?x) time \s+ out  # a comment", "time   out", True),
        (r"\bnot found\b", "page not found.", True),
    ],
)
def test_re_syntax_means_what_it_means_in_re(pattern: str, text: str, found: bool) -> None:
    assert Message([pattern])(subject(text)) is found


def test_a_pattern_the_engine_refuses_is_a_load_error() -> None:
    with pytest.raises(ValueError, match=r"bad regex '\(unclosed': missing \)"):
        PolicyRegex("(unclosed")
