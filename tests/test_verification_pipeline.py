"""Semantic verifiers in the pipeline: successful spans whose output fails a check."""

from __future__ import annotations

import json

from policies import load_policy
from supervisor.judge.pipeline import Pipeline
from tests.test_runs import llm, payload, span, tool

POLICY = """\
version: 1
verifiers:
  - name: answer_is_json
    match: {service: ["agent"], role: [llm]}
    output_json_schema: {type: object, required: [answer]}
  - name: search_found_something
    match: {role: [tool], span_name: ["execute_tool search"]}
    output_empty: true
"""


def test_outputs_that_fail_a_verifier_are_semantic_failures_at_their_span() -> None:
    pipeline = Pipeline(load_policy(text=POLICY))
    good = llm(json.dumps({"answer": 42}))
    bad = llm("the answer is 42")
    empty = tool("search", {"q": "x"}, **{"gen_ai.tool.call.result": ""})
    other = llm("not json", **{"gen_ai.request.model": "gpt-4o"})
    outcomes = pipeline.process_payload(payload(good, bad, empty), received_ns=10**12)
    found = {(o.failure.span_id, o.failure.rule) for o in outcomes}
    assert found == {
        (bad.span_id.hex(), "verifier.answer_is_json"),
        (empty.span_id.hex(), "verifier.search_found_something"),
    }
    failure = next(o.failure for o in outcomes if o.failure.rule == "verifier.answer_is_json")
    assert (failure.failure_class.value, failure.kind) == ("semantic", "verification_failed")
    assert "answer_is_json" in failure.message
    # Another service's spans are not looked at.
    assert pipeline.process_payload(payload(other, service="batch"), received_ns=10**12) == []


def test_a_root_span_with_an_empty_final_answer_fails_final_answer_empty() -> None:
    policy = load_policy(
        text="""\
version: 1
verifiers:
  - name: answered
    final_answer_empty: true
"""
    )
    root = span(
        "agent run",
        {"openinference.span.kind": "AGENT", "output.value": ""},
        parent=False,
    )
    outcomes = Pipeline(policy).process_payload(payload(root), received_ns=10**12)
    assert [o.failure.rule for o in outcomes] == ["verifier.answered"]


def test_a_reloaded_policy_is_asked_again_which_spans_it_verifies() -> None:
    """Which verifiers want a span is memoized per policy, not kept across a reload."""
    pipeline = Pipeline(load_policy(text="version: 1\n"))
    assert pipeline.process_payload(payload(llm("not json")), received_ns=10**12) == []
    pipeline.policy = load_policy(text=POLICY)
    outcomes = pipeline.process_payload(payload(llm("not json")), received_ns=10**12)
    assert [o.failure.rule for o in outcomes] == ["verifier.answer_is_json"]


def test_many_span_names_keep_the_memo_bounded_and_right() -> None:
    policy = load_policy(
        text="""\
version: 1
verifiers:
  - name: found_something
    match: {role: [tool], span_name: ["execute_tool search*"]}
    output_empty: true
"""
    )
    pipeline = Pipeline(policy)
    names = [f"search{n}" for n in range(5000)] + ["other", "search0"]
    spans = [tool(name, {"q": "x"}, **{"gen_ai.tool.call.result": ""}) for name in names]
    outcomes = pipeline.process_payload(payload(*spans), received_ns=10**12)
    flagged = {o.failure.span_id for o in outcomes}
    assert flagged == {s.span_id.hex() for s in spans if s.name != "execute_tool other"}
    memo = pipeline._wants
    assert sum(len(by_name) for by_name in memo._by_service.values()) <= 4096
