"""Inline decisions: what ``POST /v1/decide`` answers an agent that asks directly.

An agent that caught an error asks before retrying. The question is turned
into the same span record a failing span would make (the dependency names
the role: ``provider:model`` an LLM call, ``tool:<name>`` a tool, ``http:<host>``
an HTTP call), so the same classification rules, decision entries and
governor (breakers, retry budget, restart intensity) answer, and a policy
behaves the same inline and from spans.

The question does not count as an observed failure: the agent's own span
will report the call, and counting both would trip breakers twice as fast.
It does count as a call for the retry budget, which only loosens the budget
a little for agents that also export spans.
Each question gets a fresh id, so jitter spreads agents that ask at once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from policies import Governor, Policy
from supervisor.normalize.evidence import build_evidence
from supervisor.records import Action, Failure, Role, SpanRecord, split_model_dependency

MAX_TEXT = 8 * 1024


@dataclass(frozen=True, slots=True)
class Question:
    """One ``/v1/decide`` request, validated."""

    dependency: str
    exception_type: str = ""
    message: str = ""
    status_code: int | None = None
    service: str = ""
    run_id: str = ""
    attempt: int = 1


def _role_of(dependency: str) -> tuple[Role, str, str, str]:
    """(role, provider, model, tool name) that a dependency key names."""
    model = split_model_dependency(dependency)
    if model is not None:
        return Role.LLM, model[0], model[1], ""
    prefix, sep, rest = dependency.partition(":")
    if sep and prefix == "tool":
        return Role.TOOL, "", "", rest
    if sep and prefix == "http":
        return Role.HTTP, "", "", ""
    return Role.OTHER, "", "", ""


def decide(policy: Policy, governor: Governor | None, question: Question) -> dict[str, Any]:
    """The decision for ``question`` as the API returns it."""
    role, provider, model, tool = _role_of(question.dependency)
    now_ns = time.time_ns()
    evidence = build_evidence(
        status_error=True,
        status_message="",
        exception=(question.exception_type[:256], question.message[:MAX_TEXT]),
        error_type="",
        http_status=question.status_code,
        grpc_code=None,
        finish_reasons=(),
        invalid_tool_calls=(),
        swallowed=None,
        attrs={},
        now_ns=now_ns,
    )
    ids = uuid.uuid4().hex
    service = question.service or "inline"
    record = SpanRecord(
        trace_id=ids,
        span_id=ids[:16],
        parent_span_id="",
        name="inline decide",
        service=service,
        kind=3,
        start_ns=now_ns,
        end_ns=now_ns,
        role=role,
        dependency=question.dependency,
        provider=provider,
        model=model,
        tool_name=tool,
        session_id=question.run_id,
        error=evidence,
    )
    verdict = policy.classify(record)
    assert verdict is not None  # the record carries evidence: the catch-all matches at least
    failure = Failure(
        trace_id=record.trace_id,
        span_id=record.span_id,
        parent_span_id="",
        service=service,
        span_name=record.name,
        run_id=question.run_id or record.trace_id,
        role=role,
        failure_class=verdict.failure_class,
        kind=verdict.kind,
        dependency=verdict.dependency or question.dependency,
        rule=verdict.rule,
        message=(question.message or question.exception_type)[:300],
        evidence=evidence,
        received_ns=now_ns,
    )
    decision = policy.decide(failure, attempt=question.attempt)
    if governor is not None:
        # The question is a call of the dependency for its budget (an agent that only
        # asks, exporting no spans, would otherwise get only the budget's floor).
        governor.budget.record_call(failure.breaker_key)
        decision = governor.review(failure, decision)
    params = dict(decision.params)
    delay = params.get("delay_s")
    to = params.get("to")
    state = governor.breaker_state(failure.breaker_key).value if governor is not None else "closed"
    return {
        "action": decision.action.value,
        "delay_s": float(delay) if isinstance(delay, (int, float)) else 0.0,
        "reason": decision.reason,
        "policy": decision.policy,
        "class": failure.failure_class.value,
        "kind": failure.kind,
        "rule": failure.rule,
        "dependency": failure.dependency,
        "params": _plain(params),
        "fallback_to": to if decision.action is Action.FALLBACK and isinstance(to, str) else None,
        "breaker": {"dependency": failure.dependency, "state": state},
        "observe_only": decision.observe_only,
    }


def _plain(value: object) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value
