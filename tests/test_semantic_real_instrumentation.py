"""Failures real frameworks hide, and semantic checks, on spans of real agent runs.

Each flavor is a real agent instrumented as its ecosystem instruments it
(:mod:`tests.real_corpus`): a hand-written tool loop on the ``openai`` client
under opentelemetry-instrumentation-openai-v2 with content capture on and off
(its default), OpenInference and OpenLLMetry; a LangGraph ``ToolNode`` graph
under OpenInference's LangChain instrumentation (outputs shown, and hidden by
``hide_outputs``) and OpenLLMetry's; an OpenAI Agents SDK agent under
OpenInference (with and without the SDK's sensitive data, with its default
and with a custom ``failure_error_function``). Every run's spans go through
the pipeline as one OTLP request, as an exporter sends them.

* healthy runs (tools that answer, some honestly about errors; the model's
  turns that only call tools; outputs not recorded): no failure at all, with
  the built-in policy and with a small verifier policy (the issue measured 28
  false positives over about 900 spans with such a policy; 210 over these 1,008 before);
* an empty final answer: found by the built-in policy wherever the answer was
  recorded, and nowhere it was not;
* tools that raise or swallow their errors: classed by their exception's type
  (``PermissionError`` → permission, ...), a ``ValidationError`` or
  ``JSONDecodeError`` by whose data it was (the model's arguments → an invalid
  tool call, a backend's → the tool's error).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from policies import load_policy
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.normalize import read_spans
from supervisor.testing import FakeProvider
from tests import real_corpus as corpus
from tests.screening import assert_early_reads_agree

HEALTHY_RUNS = 12
#: The checks the issue ran: an answer, a tool's output and the run's answer, not empty.
VERIFIERS = """\
version: 1
verifiers:
  - {name: answer-not-empty, match: {role: [llm]}, output_empty: true}
  - {name: tool-output-not-empty, match: {role: [tool]}, output_empty: true}
  - {name: final-answer, final_answer_empty: true}
"""

OPENAI_LOOP = ("openai_v2", "openai_v2_off", "openinference", "openllmetry")
LANGGRAPH = ("lg_openinference", "lg_openinference_hidden", "lg_openllmetry")
AGENTS_SDK = ("sdk", "sdk_hidden", "sdk_custom")
FLAVORS = OPENAI_LOOP + LANGGRAPH + AGENTS_SDK
#: Flavors whose spans carry no outputs: what an output was cannot be known there.
NOT_RECORDED = frozenset({"openai_v2_off", "lg_openinference_hidden", "sdk_hidden"})

#: Runs with one fault each, by name: what the model does, then its last word.
FAULTS: dict[str, list[corpus.Step]] = {
    **{f: [("call", f"read_file:{f}"), ("answer", "Sorry.")] for f in corpus.FAILURES},
    "bad_args": [("bad_args", "read_file"), ("answer", "Sorry.")],
    "bad_args_handled": [("bad_args", "lookup"), ("answer", "Sorry.")],
    "empty_answer": [("call", "get_weather"), ("answer", "")],
}
#: The hand-written loop parses the model's arguments itself, before any tool span.
_LOOP_FAULTS = [name for name in FAULTS if not name.startswith("bad_args")]


def _custom_failure(_context: Any, error: Exception) -> str:
    """A ``failure_error_function`` as the SDK's docs show one: the error, for the model."""
    return f"Error: {error!r}"


def _build(flavor: str, fake: FakeProvider, scripts: list[list[corpus.Step]]) -> list[bytes]:
    service = f"agent-{flavor}"
    if flavor in OPENAI_LOOP:
        return corpus.openai_loop(flavor, fake, scripts, service)
    if flavor in LANGGRAPH:
        return corpus.langgraph(flavor.removeprefix("lg_"), fake, scripts, service)
    return corpus.agents_sdk(
        fake,
        scripts,
        service,
        sensitive=flavor != "sdk_hidden",
        failure_error_function=_custom_failure if flavor == "sdk_custom" else None,
    )


Runs = dict[str, dict[str, list[bytes]]]


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    """Every flavor's healthy runs and fault runs; each instrumentation once (they are global)."""
    out: Runs = {}
    with FakeProvider() as fake:
        for flavor in FLAVORS:
            faults = _LOOP_FAULTS if flavor in OPENAI_LOOP else list(FAULTS)
            healthy = [corpus.healthy_script(run) for run in range(HEALTHY_RUNS)]
            batches = _build(flavor, fake, healthy + [FAULTS[name] for name in faults])
            out[flavor] = {
                "healthy": batches[:HEALTHY_RUNS],
                **{name: [b] for name, b in zip(faults, batches[HEALTHY_RUNS:], strict=True)},
            }
    yield out


def _judge(batches: list[bytes], policy_text: str | None = None) -> list[Outcome]:
    policy = load_policy(text=policy_text) if policy_text is not None else load_policy()
    pipeline = Pipeline(policy)
    outcomes: list[Outcome] = []
    for n, payload in enumerate(batches):
        assert_early_reads_agree(payload)  # the screens pass every span the record fails
        outcomes += pipeline.process_payload(payload, received_ns=1_700_000_000_000_000_000 + n)
    return outcomes


def _seen(outcomes: list[Outcome]) -> list[tuple[str, str, str, str]]:
    return [
        (o.failure.role.value, o.failure.rule, o.failure.failure_class.value, o.failure.kind)
        for o in outcomes
    ]


# -- healthy runs: no false positives ---------------------------------------------------------


def test_healthy_real_runs_show_no_failure_under_a_small_verifier_policy(
    runs: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    spans = 0
    found: Counter[tuple[str, str]] = Counter()
    for flavor in FLAVORS:
        batches = runs[flavor]["healthy"]
        spans += sum(len(read_spans(b)) for b in batches)
        for policy in (VERIFIERS, None):
            for o in _judge(batches, policy):
                found[(flavor, o.failure.rule)] += 1
    with capsys.disabled():
        print(f"\nsemantic corpus: {spans} spans, {sum(found.values())} false positives")
    assert spans >= 850
    assert dict(found) == {}


def test_the_corpus_holds_what_used_to_be_taken_for_failures(runs: Runs) -> None:
    """Outputs not recorded, turns that only call tools, tools that talk about errors."""
    records = [
        (flavor, span.record())
        for flavor in FLAVORS
        for payload in runs[flavor]["healthy"]
        for span in read_spans(payload)
    ]
    not_recorded = {f for f, r in records if r.role.value == "llm" and not r.output_recorded}
    calls_only = {f for f, r in records if r.calls_tools and not r.output_text}
    about_errors = {f for f, r in records if r.output_text.startswith("Error rates fell")}
    assert not_recorded == NOT_RECORDED
    assert calls_only == set(FLAVORS) - NOT_RECORDED
    assert about_errors == set(FLAVORS) - NOT_RECORDED


# -- an empty final answer --------------------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_empty_final_answer_is_found_by_default_where_it_was_recorded(
    runs: Runs, flavor: str
) -> None:
    seen = _seen(_judge(runs[flavor]["empty_answer"]))
    expected = (
        []
        if flavor in NOT_RECORDED
        else [("llm", "verifier.builtin.final_answer", "semantic", "verification_failed")]
    )
    assert seen == expected


# -- tool faults ------------------------------------------------------------------------------

_P, _T, _M = "permanent", "transient", "model"
#: fault -> (rule, class, kind) where the span says what the exception was.
BY_TYPE: dict[str, tuple[str, str, str]] = {
    "permission": ("builtin.python.permission", _P, "permission"),
    "not_found": ("builtin.python.not_found", _P, "not_found"),
    "timeout": ("builtin.python.timeout", _T, "timeout"),
    "connection": ("builtin.python.connection", _T, "connection"),
    "backend_json": ("builtin.parse.tool_data", _P, "tool_error"),
    "backend_schema": ("builtin.parse.tool_data", _P, "tool_error"),
}
#: The Agents SDK's default failure_error_function redacts the error: a tool error is all.
_REDACTED = ("builtin.tool.error", _T, "tool_error")


@pytest.mark.parametrize("fault", list(BY_TYPE))
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_tool_that_raises_is_classed_by_its_exception_type(
    runs: Runs, flavor: str, fault: str
) -> None:
    expected = _REDACTED if flavor in ("sdk", "sdk_hidden") else BY_TYPE[fault]
    assert _seen(_judge(runs[flavor][fault])) == [("tool", *expected)]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_error_a_tool_caught_and_returned_is_found(runs: Runs, flavor: str) -> None:
    outcomes = _judge(runs[flavor]["caught"])
    if flavor in NOT_RECORDED:  # the output is all there is, and it was not recorded
        assert outcomes == []
        return
    assert _seen(outcomes) == [("tool", "builtin.text.connection", _T, "connection")]
    evidence = outcomes[0].failure.evidence
    assert evidence is not None and evidence.swallowed


@pytest.mark.parametrize("flavor", ["lg_openinference", "lg_openllmetry"])
def test_a_tool_message_with_status_error_is_found_whatever_its_text(
    runs: Runs, flavor: str
) -> None:
    """LangChain's handle_tool_error: an OK span whose ToolMessage says status="error"."""
    outcomes = _judge(runs[flavor]["tool_exception"])
    assert _seen(outcomes) == [("tool", "builtin.tool.error", _T, "tool_error")]
    evidence = outcomes[0].failure.evidence
    assert evidence is not None
    assert (evidence.swallowed, evidence.status_error, evidence.exception_message) == (
        True,
        False,
        "the archive is offline",
    )


@pytest.mark.parametrize("flavor", ["lg_openinference", "lg_openllmetry", "sdk_custom"])
def test_arguments_the_model_wrote_that_the_tool_refused_are_an_invalid_tool_call(
    runs: Runs, flavor: str
) -> None:
    outcomes = _judge(runs[flavor]["bad_args"])
    assert _seen(outcomes) == [("tool", "builtin.llm.invalid_tool_call", _M, "invalid_tool_call")]
    evidence = outcomes[0].failure.evidence
    assert evidence is not None and evidence.invalid_tool_calls == ("bad_arguments:read_file",)


@pytest.mark.parametrize("flavor", ["lg_openinference", "lg_openllmetry"])
def test_arguments_a_langchain_tool_refused_itself_are_an_invalid_tool_call(
    runs: Runs, flavor: str
) -> None:
    """handle_validation_error: an OK span, ToolMessage status "error", LangChain's own words."""
    outcomes = _judge(runs[flavor]["bad_args_handled"])
    assert _seen(outcomes) == [("tool", "builtin.llm.invalid_tool_call", _M, "invalid_tool_call")]
    evidence = outcomes[0].failure.evidence
    assert evidence is not None
    assert (evidence.swallowed, evidence.invalid_tool_calls) == (True, ("bad_arguments:lookup",))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_tool_that_answers_is_no_failure(runs: Runs, flavor: str) -> None:
    assert _judge(runs[flavor]["fine"]) == []


def test_the_cheap_look_for_an_empty_output_passes_every_span_that_says_nothing(
    runs: Runs,
) -> None:
    """Spans wanted only by emptiness checks are normalized when the view says they may be empty."""
    said_nothing = 0
    for flavor in FLAVORS:
        for batches in runs[flavor].values():
            for payload in batches:
                for span in read_spans(payload):
                    if span.record().says_nothing:
                        said_nothing += 1
                        assert span.may_say_nothing, (flavor, span.name)
    assert said_nothing >= len(FLAVORS) - len(NOT_RECORDED)
