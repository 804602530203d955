"""The command contract: what each command carries so that an agent acts without guessing.

The failures come from real spans where it matters: the ``openai`` client,
instrumented by ``opentelemetry-instrumentation-openai-v2``, calling
:class:`FakeProvider` on loopback, judged by the real pipeline and governor,
stored by the real actor in a real store. The planner itself is pure, so the
pause variants are also checked on decisions made by hand (the shape the
governor's decisions have). Time is an injected clock: nothing sleeps.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from policies import Governor, load_policy
from remediators.builtin import Escalate, LoopBreaker, Rewind
from remediators.gateway import RecordingGateway
from remediators.testing import FakeContext
from supervisor.act.actor import Actor
from supervisor.act.commands import plan_commands
from supervisor.act.store import ApprovalError, Store, StoredCommand
from supervisor.judge.pipeline import Outcome, Pipeline
from supervisor.records import (
    Action,
    AttrValue,
    CommandType,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
    model_dependency,
    split_model_dependency,
)
from supervisor.settings import AgentDelivery, PullChannel
from supervisor.testing import FakeProvider, Reply
from tests.test_normalize_real_instrumentation import SERVICE, _instrumented

POLICY = """
version: 1
policies:
  - name: to_mini
    match: {kind: rate_limit, dependency: "openai:gpt-4o"}
    action: fallback
    chain: {"openai:gpt-4o": ["openai:gpt-4o", "openai:gpt-4o-mini"]}
  - name: ask_a_person
    match: {kind: auth}
    action: escalate
"""
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def provider() -> Any:
    with FakeProvider() as fake:
        yield fake


def _judged(provider: FakeProvider, reply: Reply, model: str = "gpt-4o") -> list[Outcome]:
    """One real instrumented call that fails with ``reply``, judged by the real pipeline."""
    policy = load_policy(text=POLICY)
    pipeline = Pipeline(policy, governor=Governor(policy))
    provider.script(reply)
    with _instrumented("openai_v2") as exporter:
        client = openai.OpenAI(base_url=provider.base_url, api_key="sk-fake", max_retries=0)
        with pytest.raises(openai.APIError):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello?"}]
            )
        payload = encode_spans(exporter.get_finished_spans()).SerializeToString()
    return pipeline.process_payload(payload, time.time_ns())


def _actor(clock: Clock, store: Store | None = None) -> Actor:
    return Actor(
        store or Store.open(":memory:"),
        {SERVICE: AgentDelivery(pull=PullChannel())},
        clock=clock,
    )


def _body(stored: StoredCommand) -> dict[str, Any]:
    return stored.to_json()


# -- switch_fallback: the model as the SDK calls it ------------------------------------------


def test_switch_fallback_names_the_model_the_sdk_calls_beside_the_dependency_key(
    provider: FakeProvider,
) -> None:
    outcomes = _judged(provider, Reply.rate_limited(model="gpt-4o"))
    assert [o.decision.action for o in outcomes] == [Action.FALLBACK]

    stored = _actor(Clock()).record(outcomes)

    assert [s.command.type for s in stored] == [CommandType.SWITCH_FALLBACK]
    params = _body(stored[0])["params"]
    assert (params["to"], params["model"], params["provider"]) == (
        "openai:gpt-4o-mini",
        "gpt-4o-mini",
        "openai",
    )


def test_a_dependency_key_is_read_back_where_it_is_spelt() -> None:
    assert split_model_dependency("openai:gpt-4o-mini") == ("openai", "gpt-4o-mini")
    # A model name may hold colons of its own; a provider name never does.
    assert split_model_dependency("ollama:llama3:8b") == ("ollama", "llama3:8b")
    assert split_model_dependency("aws.bedrock:anthropic.claude-3-haiku-v1:0") == (
        "aws.bedrock",
        "anthropic.claude-3-haiku-v1:0",
    )
    assert split_model_dependency(model_dependency("", "gpt-4o")) == ("", "gpt-4o")
    for not_a_model in ("tool:search", "http:api.example.com", "", "gpt-4o"):
        assert split_model_dependency(not_a_model) is None, not_a_model
    for provider, model in (("openai", "gpt-4o"), ("ollama", "llama3:8b"), ("anthropic", "")):
        assert split_model_dependency(model_dependency(provider, model)) == (provider, model)


# -- pause_run: a deadline and an outcome, always ---------------------------------------------


def _failure(span_name: str = "chat gpt-4o") -> Failure:
    return Failure(
        trace_id="ab" * 16,
        span_id="cd" * 8,
        parent_span_id="",
        service=SERVICE,
        span_name=span_name,
        run_id="run-1",
        role=Role.LLM,
        failure_class=FailureClass.TRANSIENT,
        kind="unavailable",
        dependency="openai:gpt-4o",
        rule="builtin.http_5xx",
        message="503",
        evidence=ErrorEvidence(status_error=True, http_status=503),
        received_ns=0,
    )


def test_a_breaker_pause_lasts_until_the_breaker_may_half_open_then_resumes() -> None:
    decision = Decision(Action.FAIL_FAST, "p", {"breaker_reopens_in_s": 30.0, "breaker": "open"})

    pause, resume = plan_commands(_failure(), decision, T0)

    assert pause.type is CommandType.PAUSE_RUN and pause.not_before == T0
    assert (pause.params["timeout_s"], pause.params["on_timeout"]) == (30.0, "resume")
    assert resume.type is CommandType.RESUME_RUN and resume.not_before == T0 + 30.0
    assert resume.params["after_pause"] == pause.id
    assert resume.params["step"] == "chat gpt-4o"
    assert "on_timeout" not in resume.params and "timeout_s" not in resume.params


def test_a_decision_that_names_its_pause_gets_that_deadline_and_outcome() -> None:
    decision = Decision(
        Action.FAIL_FAST,
        "p",
        {"breaker_reopens_in_s": 30.0, "pause_timeout_s": 12.5, "on_timeout": "abort"},
    )

    pause, outcome = plan_commands(_failure(), decision, T0)

    assert (pause.params["timeout_s"], pause.params["on_timeout"]) == (12.5, "abort")
    assert "pause_timeout_s" not in pause.params
    assert outcome.type is CommandType.ABORT_RUN and outcome.not_before == T0 + 12.5
    assert outcome.params["after_pause"] == pause.id

    # Unusable values fall back to the default, part by part: never a pause without both.
    unusable: list[dict[str, AttrValue]] = [
        {"pause_timeout_s": -1, "on_timeout": "later"},
        {"pause_timeout_s": "soon"},
        {"pause_timeout_s": float("nan")},
    ]
    for bad in unusable:
        odd = Decision(Action.FAIL_FAST, "p", {"breaker_reopens_in_s": 9.0, **bad})
        paused = plan_commands(_failure(), odd, T0)[0]
        assert (paused.params["timeout_s"], paused.params["on_timeout"]) == (9.0, "resume")
    escalated = plan_commands(_failure(), Decision(Action.ESCALATE, "p", {"on_timeout": "x"}), T0)
    assert (escalated[0].params["timeout_s"], escalated[0].params["on_timeout"]) == (
        3600.0,
        "abort",
    )


def test_an_unanswered_escalation_expires_at_its_deadline_and_aborts_the_run_once(
    provider: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    actor = _actor(clock)
    outcomes = _judged(provider, Reply.unauthorized())
    assert [o.decision.action for o in outcomes] == [Action.ESCALATE]

    [pause] = actor.record(outcomes)
    assert pause.command.type is CommandType.PAUSE_RUN
    params = _body(pause)["params"]
    assert (params["timeout_s"], params["on_timeout"], params["awaiting"]) == (
        3600.0,
        "abort",
        "approval",
    )
    [approval] = actor.store.approvals()
    shown = approval.to_json()
    assert (shown["status"], shown["expires_at"], shown["on_timeout"]) == (
        "pending",
        T0 + 3600.0,
        "abort",
    )
    assert "abort_run" in shown["on_no_answer"]

    clock.now = T0 + 3599.0
    assert actor.expire_approvals() == []
    clock.now = T0 + 3600.0
    with caplog.at_level("WARNING", logger="spanvisor.act"):
        [expired] = actor.expire_approvals()
    assert expired.status == "expired" and expired.answered_by == "timeout"
    assert "expired unanswered" in caplog.text
    outcome = [c for c in actor.store.commands() if c.command.type is CommandType.ABORT_RUN]
    assert len(outcome) == 1 and outcome[0].status == "pending"
    assert outcome[0].command.params["after_pause"] == pause.command.id
    assert outcome[0].command.params["approval_id"] == approval.id
    assert outcome[0].command.run_id == pause.command.run_id

    # Once: the timer running again, or a person answering late, changes nothing.
    clock.now = T0 + 7200.0
    assert actor.expire_approvals() == []
    with pytest.raises(ApprovalError, match="expired"):
        actor.answer(approval.id, approved=True, by="late", note="")
    assert len(actor.store.commands()) == 2


def test_an_answer_before_the_deadline_leaves_nothing_to_expire(provider: FakeProvider) -> None:
    clock = Clock()
    actor = _actor(clock)
    actor.record(_judged(provider, Reply.unauthorized()))
    [approval] = actor.store.approvals()

    clock.now = T0 + 60.0
    actor.answer(approval.id, approved=True, by="ops", note="go on")
    clock.now = T0 + 4000.0

    assert actor.expire_approvals() == []
    types = sorted(c.command.type.value for c in actor.store.commands())
    assert types == ["approval_result", "pause_run"]


def test_an_answer_after_the_deadline_is_refused_even_before_the_timer_runs(
    provider: FakeProvider,
) -> None:
    clock = Clock()
    actor = _actor(clock)
    actor.record(_judged(provider, Reply.unauthorized()))
    [approval] = actor.store.approvals()

    clock.now = T0 + 3600.5
    with pytest.raises(ApprovalError, match="expired"):
        actor.answer(approval.id, approved=True, by="ops", note="")
    assert [a.status for a in actor.expire_approvals()] == ["expired"]


def test_a_store_made_before_deadlines_gets_them_and_keeps_its_approvals(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE approvals (
            id TEXT PRIMARY KEY, incident_key TEXT NOT NULL UNIQUE, service TEXT NOT NULL,
            run_id TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
            created_at REAL NOT NULL, answered_at REAL,
            answered_by TEXT NOT NULL DEFAULT '', note TEXT NOT NULL DEFAULT '');
        INSERT INTO approvals (id, incident_key, service, run_id, status, body, created_at)
            VALUES ('apr_old', 'k', 's', 'r', 'pending', '{}', 1.0);
        """
    )
    old.commit()
    old.close()

    store = Store.open(path)
    try:
        [kept] = store.approvals()
        assert (kept.id, kept.status, kept.expires_at, kept.on_timeout) == (
            "apr_old",
            "pending",
            None,
            "",
        )
        actor = _actor(Clock(), store)
        assert actor.expire_approvals(now=T0 * 2) == []  # no deadline: never expires
    finally:
        store.close()


# -- rewind_run, retry_step: the step ----------------------------------------------------------


def _trigger(span_name: str) -> Any:
    from remediators.base import Trigger

    return Trigger(
        trace_id="ab" * 16,
        span_id="cd" * 8,
        service=SERVICE,
        run_id="run-1",
        failure_class="semantic",
        kind="verification_failed",
        dependency="tool:lookup_order",
        rule="verify.order",
        message="the order id is not in the answer",
        span_name=span_name,
        params={"occurrence": 2, "repeats": 3, "repeated_call": "lookup_order"},
    )


@pytest.mark.parametrize("remediator", [Rewind, LoopBreaker])
def test_rewind_run_names_the_step_to_go_back_to(remediator: Any) -> None:
    import asyncio

    gateway = RecordingGateway()
    ctx = FakeContext(_trigger("execute_tool lookup_order"), gateway, remediator.tools)
    asyncio.run(remediator({}).run(ctx))
    [sent] = [c for c in gateway.commands.values() if c["command"] == "rewind_run"]
    assert sent["params"]["step"] == "execute_tool lookup_order"
    assert sent["params"]["step_known"] is True


def test_a_rewind_whose_step_is_unknown_says_so() -> None:
    import asyncio

    gateway = RecordingGateway()
    ctx = FakeContext(_trigger(""), gateway, Rewind.tools)
    asyncio.run(Rewind({}).run(ctx))
    [sent] = list(gateway.commands.values())
    assert "step" in sent["params"] and sent["params"]["step"] is None
    assert sent["params"]["step_known"] is False


def test_the_escalate_remediators_pause_states_its_deadline_and_outcome() -> None:
    import asyncio

    gateway = RecordingGateway()
    ctx = FakeContext(_trigger("chat gpt-4o"), gateway, Escalate.tools)
    asyncio.run(Escalate({"timeout_s": 120, "on_timeout": "retry_step"}).run(ctx))
    [pause] = [c for c in gateway.commands.values() if c["command"] == "pause_run"]
    assert (pause["params"]["timeout_s"], pause["params"]["on_timeout"]) == (120.0, "resume")
