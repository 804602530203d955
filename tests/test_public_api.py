"""The public surface other work builds on, pinned: change it on purpose or not at all."""

from __future__ import annotations

import argparse
import dataclasses

import policies
import supervisor.testing
from supervisor import records
from supervisor.act.failure_log import outcome_json
from supervisor.cli.verbs import build_parser
from supervisor.judge.pipeline import Outcome


def test_policies_exports() -> None:
    assert sorted(policies.__all__) == [
        "Admission",
        "AdmissionLimitSpec",
        "AdmissionServiceSpec",
        "AdmissionSpec",
        "BUILTIN_REMEDIATORS",
        "BreakerChange",
        "BreakerState",
        "Capacity",
        "Cascade",
        "CascadeTally",
        "DetectorSettings",
        "Forecast",
        "Governor",
        "Limit",
        "ModelInfo",
        "ModelTable",
        "Policy",
        "RUN_KINDS",
        "RemediatorBudgetSpec",
        "RemediatorSpec",
        "RunSpend",
        "SERVICE_BUDGET_RULE",
        "ServiceBudgetSpec",
        "ServiceOutlook",
        "ServiceSpend",
        "SharedStorage",
        "SloSpec",
        "SloTracker",
        "VerificationFailure",
        "VerifierSet",
        "WindowCounter",
        "cascade_calls",
        "counts_for_breaker",
        "json_schema",
        "load_policy",
        "regex_timeouts",
        "window_buckets",
    ]


def test_client_exports() -> None:
    import supervisor.client

    assert sorted(supervisor.client.__all__) == sorted(
        [
            "Advice",
            "BreakerOpen",
            "FallbackAdvised",
            "Guard",
            "GuardedAttempt",
            "LocalPolicy",
            "SeenCommands",
            "SignatureError",
            "SupervisorClient",
            "SupervisorClientError",
            "exception_type_name",
            "guard",
            "verify_webhook",
        ]
    )


def test_command_contract() -> None:
    assert [t.value for t in records.CommandType] == [
        "retry_step",
        "resume_run",
        "rewind_run",
        "switch_fallback",
        "pause_run",
        "abort_run",
        "inject_guidance",
        "compact_context",
        "approval_result",
    ]
    command = records.Command(
        id="cmd_1",
        idempotency_key="k",
        type=records.CommandType.RETRY_STEP,
        service="s",
        run_id="r",
        trigger_trace_id="t",
        trigger_span_id="p",
        failure={},
        params={},
        not_before=0.0,
        created_at=0.0,
    )
    assert set(command.to_json()) == {
        "id",
        "idempotency_key",
        "type",
        "service",
        "run_id",
        "trigger",
        "failure",
        "params",
        "not_before",
        "created_at",
    }


def test_testing_fakes_exports() -> None:
    assert sorted(supervisor.testing.__all__) == [
        "FakeProvider",
        "FaultPlan",
        "KeyCounts",
        "PublishedLimit",
        "RecordedRequest",
        "Reply",
        "ToolCall",
    ]


def test_cli_verbs() -> None:
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(verbs.choices) == sorted(
        [
            "run",
            "init",
            "validate",
            "replay",
            "explain",
            "schema",
            "demo",
            "incidents",
            "approvals",
            "breakers",
            "commands",
            "reload",
            "remediations",
            "runs",
        ]
    )


def test_vocabulary() -> None:
    assert [c.value for c in records.FailureClass] == [
        "transient",
        "model",
        "permanent",
        "semantic",
    ]
    assert [a.value for a in records.Action] == [
        "retry",
        "fallback",
        "fail_fast",
        "escalate",
        "remediate",
        "none",
    ]
    assert [r.value for r in records.Role] == ["llm", "tool", "agent", "chain", "http", "other"]
    # approval_required: an agent asks a person; budget_forecast: a cap reached soon
    assert len(records.BUILTIN_KINDS) == 23


def test_replay_jsonl_keys() -> None:
    evidence = records.ErrorEvidence(status_error=True)
    failure = records.Failure(
        trace_id="0" * 31 + "1",
        span_id="0" * 15 + "1",
        parent_span_id="",
        service="s",
        span_name="n",
        run_id="r",
        role=records.Role.LLM,
        failure_class=records.FailureClass.TRANSIENT,
        kind="timeout",
        dependency="openai:gpt-4o",
        rule="builtin.x",
        message="m",
        evidence=evidence,
        received_ns=0,
    )
    decision = records.Decision(action=records.Action.RETRY, policy="p")

    keys = set(outcome_json(Outcome(failure, decision)))

    assert {
        "trace_id",
        "span_id",
        "service",
        "span_name",
        "class",
        "kind",
        "dependency",
        "rule",
        "action",
    } <= keys


def test_records_are_immutable() -> None:
    assert dataclasses.fields(records.Failure)
    assert records.Failure.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert records.Decision.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert records.ErrorEvidence.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert records.SpanRecord.__dataclass_params__.frozen  # type: ignore[attr-defined]
