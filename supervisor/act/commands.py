"""From a decision to the commands, and the approval request, it leads to.

Pure: the same failure and decision always plan the same commands with the
same ids and idempotency keys (:func:`supervisor.records.command_key`), which
is what lets the store refuse a second command for a span judged twice.

What each action asks of the agent:

========== ==================================================================
retry      ``retry_step``, not before ``now + delay_s`` (the sidecar keeps the
           delay; the agent is never asked to block)
fallback   ``switch_fallback`` to ``params.to``
fail_fast  ``abort_run``; when it is because the dependency's breaker is
           open, ``pause_run`` now and ``resume_run`` when the breaker may
           half-open instead: the run is not lost to an outage
escalate   ``pause_run`` now, and an approval request; the answer reaches the
           agent later as ``approval_result`` (:func:`approval_result`)
remediate  nothing yet: remediators are dispatched by their own runner
none       nothing
========== ==================================================================

A decision made in observe mode plans nothing: it is stored and traced only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.records import (
    Action,
    AttrValue,
    Command,
    CommandType,
    Decision,
    Failure,
    command_key,
)

__all__ = ["approval_result", "failure_summary", "incident_key", "plan_commands", "proposal"]


def incident_key(failure: Failure) -> str:
    """The incident's idempotency key: trace id, span id and the rule that classified it."""
    return command_key(failure.trace_id, failure.span_id, failure.rule)


def failure_summary(failure: Failure) -> dict[str, AttrValue]:
    """What a command says of the failure that caused it."""
    return {
        "class": failure.failure_class.value,
        "kind": failure.kind,
        "dependency": failure.dependency,
        "rule": failure.rule,
        "message": failure.message,
        "span_name": failure.span_name,
    }


def _command(
    failure: Failure,
    kind: CommandType,
    params: Mapping[str, AttrValue],
    *,
    not_before: float,
    now: float,
    step: str,
) -> Command:
    key = command_key(failure.trace_id, failure.span_id, failure.rule, step)
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=kind,
        service=failure.service,
        run_id=failure.run_id,
        trigger_trace_id=failure.trace_id,
        trigger_span_id=failure.span_id,
        failure=failure_summary(failure),
        params=dict(params),
        not_before=not_before,
        created_at=now,
    )


def plan_commands(failure: Failure, decision: Decision, now: float) -> list[Command]:
    """The commands ``decision`` sends to the failing run's agent (see the module table)."""
    if decision.observe_only:
        return []
    base: dict[str, AttrValue] = {"dependency": failure.dependency, "reason": decision.reason}
    params = {**base, **decision.params}
    action = decision.action
    if action is Action.RETRY:
        delay = decision.params.get("delay_s")
        wait = float(delay) if isinstance(delay, (int, float)) and delay > 0 else 0.0
        return [
            _command(
                failure,
                CommandType.RETRY_STEP,
                params,
                not_before=now + wait,
                now=now,
                step="retry",
            )
        ]
    if action is Action.FALLBACK:
        return [
            _command(
                failure,
                CommandType.SWITCH_FALLBACK,
                params,
                not_before=now,
                now=now,
                step="fallback",
            )
        ]
    if action is Action.FAIL_FAST:
        reopens = decision.params.get("breaker_reopens_in_s")
        if isinstance(reopens, (int, float)) and reopens >= 0:
            return [
                _command(
                    failure, CommandType.PAUSE_RUN, params, not_before=now, now=now, step="pause"
                ),
                _command(
                    failure,
                    CommandType.RESUME_RUN,
                    params,
                    not_before=now + float(reopens),
                    now=now,
                    step="resume",
                ),
            ]
        return [
            _command(failure, CommandType.ABORT_RUN, params, not_before=now, now=now, step="abort")
        ]
    if action is Action.ESCALATE:
        if params.get("run_ended"):
            return []  # its turn ended: nothing runs to pause; the person is still asked
        pause = {**params, "awaiting": "approval"}
        return [
            _command(failure, CommandType.PAUSE_RUN, pause, not_before=now, now=now, step="pause")
        ]
    return []


def proposal(failure: Failure, decision: Decision) -> dict[str, Any]:
    """The approval request of an escalation: what failed, where, what is proposed and why."""
    proposed = decision.params.get("proposed_action")
    action = proposed if isinstance(proposed, str) else CommandType.RETRY_STEP.value
    return {
        "what": failure_summary(failure),
        "where": {
            "service": failure.service,
            "run_id": failure.run_id,
            "trace_id": failure.trace_id,
            "span_id": failure.span_id,
            "span_name": failure.span_name,
        },
        "proposal": {"command": action, "params": dict(decision.params)},
        "why": decision.reason,
        "on_approve": f"the run gets approval_result(approved=true) and resumes with {action}",
        "on_deny": "the run gets approval_result(approved=false) and should abort",
    }


def approval_result(
    failure_like: Mapping[str, Any],
    *,
    approval_id: str,
    incident: str,
    approved: bool,
    by: str,
    note: str,
    proposal_body: Mapping[str, Any],
    now: float,
) -> Command:
    """The ``approval_result`` command sent once a person answered an approval request."""
    where = proposal_body.get("where", {})
    trace_id = str(where.get("trace_id", ""))
    span_id = str(where.get("span_id", ""))
    key = command_key(trace_id, span_id, incident, "approval_result")
    params: dict[str, AttrValue] = {
        "approval_id": approval_id,
        "approved": approved,
        "answered_by": by,
        "note": note,
        "proposal": dict(proposal_body.get("proposal", {})),
    }
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=CommandType.APPROVAL_RESULT,
        service=str(where.get("service", "")),
        run_id=str(where.get("run_id", "")),
        trigger_trace_id=trace_id,
        trigger_span_id=span_id,
        failure=dict(failure_like),
        params=params,
        not_before=now,
        created_at=now,
    )
