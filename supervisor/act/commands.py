"""From a decision to the commands, and the approval request, it leads to.

Pure: the same failure and decision always plan the same commands with the
same ids and idempotency keys (:func:`supervisor.records.command_key`), which
is what lets the store refuse a second command for a span judged twice.

What each action asks of the agent:

========== ==================================================================
retry      ``retry_step``, not before ``now + delay_s`` (the sidecar keeps the
           delay; the agent is never asked to block)
fallback   ``switch_fallback`` to ``params.to`` (with ``model`` and
           ``provider``: what the agent's SDK calls it)
fail_fast  ``abort_run``; when it is because the dependency's breaker is
           open, ``pause_run`` now and, at the pause's deadline (by default
           when the breaker may half-open), ``resume_run``: the run is not
           lost to an outage
escalate   ``pause_run`` now, and an approval request; the answer reaches the
           agent later as ``approval_result`` (:func:`approval_result`); no
           answer by the pause's deadline sends its outcome instead
           (:func:`pause_timed_out`)
remediate  nothing yet: remediators are dispatched by their own runner
none       nothing
========== ==================================================================

Every command's params are completed by :func:`agent_params`, here and for
the commands remediators send, so an agent never has to guess: the step a
``retry_step``, ``resume_run`` or ``rewind_run`` is about, the model of a
``switch_fallback``, and every ``pause_run``'s ``timeout_s`` and
``on_timeout`` (``resume`` or ``abort``). A decision that pauses may carry
``pause_timeout_s`` and ``on_timeout``; without them a breaker's pause lasts
until the breaker may half-open and then resumes, an escalation's lasts an
hour and then aborts.

A decision made in observe mode plans nothing: it is stored and traced only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from supervisor.records import (
    Action,
    AttrValue,
    Command,
    CommandType,
    Decision,
    Failure,
    command_key,
    split_model_dependency,
)

__all__ = [
    "ESCALATION_PAUSE",
    "PAUSE_OUTCOMES",
    "PauseTimeout",
    "agent_params",
    "approval_result",
    "failure_summary",
    "incident_key",
    "pause_timed_out",
    "plan_commands",
    "proposal",
]

OnTimeout = Literal["resume", "abort"]
#: What a pause may do when its deadline passes unanswered.
PAUSE_OUTCOMES: Final[tuple[OnTimeout, ...]] = ("resume", "abort")
#: The command the sidecar sends for each outcome.
_OUTCOME_COMMAND: Final[Mapping[str, CommandType]] = {
    "resume": CommandType.RESUME_RUN,
    "abort": CommandType.ABORT_RUN,
}
#: The longest pause a decision may ask for (a week: beyond, nobody is waiting).
MAX_PAUSE_S: Final = 7 * 86_400.0


@dataclass(frozen=True, slots=True)
class PauseTimeout:
    """How long a pause lasts, and what happens to the run when it passes unanswered."""

    timeout_s: float
    on_timeout: OnTimeout

    @property
    def command(self) -> CommandType:
        """The command the run gets when the pause times out."""
        return _OUTCOME_COMMAND[self.on_timeout]

    def params(self) -> dict[str, AttrValue]:
        return {"timeout_s": self.timeout_s, "on_timeout": self.on_timeout}

    @classmethod
    def asked(cls, params: Mapping[str, Any], default: PauseTimeout) -> PauseTimeout:
        """The pause a decision's ``pause_timeout_s`` / ``on_timeout`` ask for, else ``default``.

        A value that is not usable (not a positive finite number, an unknown
        outcome) falls back to the default's, part by part: a pause always
        has a deadline and an outcome.
        """
        asked = params.get("pause_timeout_s")
        timeout = default.timeout_s
        if (
            isinstance(asked, (int, float))
            and not isinstance(asked, bool)
            and math.isfinite(asked)
            and asked > 0
        ):
            timeout = min(float(asked), MAX_PAUSE_S)
        outcome = params.get("on_timeout")
        on_timeout = outcome if outcome in PAUSE_OUTCOMES else default.on_timeout
        return cls(round(timeout, 3), on_timeout)


#: The decision params that ask for a pause's deadline (not for the commands after it).
_PAUSE_ASKS: Final = frozenset({"pause_timeout_s", "on_timeout"})

#: An escalation's pause when the decision names none: a person has an hour, then the
#: run is aborted (resuming a run nobody approved would do what was held for approval).
ESCALATION_PAUSE: Final = PauseTimeout(3600.0, "abort")


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


def agent_params(
    kind: CommandType,
    params: Mapping[str, AttrValue],
    *,
    step: str,
    pause: PauseTimeout = ESCALATION_PAUSE,
) -> dict[str, AttrValue]:
    """``params`` with what the agent needs to act on a ``kind`` command without guessing.

    ``step`` is the name of the step the failure was found at (its span's
    name; ``""`` when unknown). Values already in ``params`` win, except
    where they would leave the agent guessing:

    * ``retry_step``, ``resume_run``: ``step`` when known;
    * ``rewind_run``: ``step`` (go back to the checkpoint before it), or
      ``null`` with ``step_known: false`` when the sidecar does not know it;
    * ``switch_fallback``: ``model`` and ``provider`` read from ``to`` (the
      dependency key, :func:`supervisor.records.split_model_dependency`);
    * ``pause_run``: ``timeout_s`` and ``on_timeout`` (``pause`` when
      ``params`` has no usable ones).
    """
    done = dict(params)
    if kind in (CommandType.RETRY_STEP, CommandType.RESUME_RUN):
        if step and not done.get("step"):
            done["step"] = step
    elif kind is CommandType.REWIND_RUN:
        named = done.get("step")
        found = named if isinstance(named, str) and named else step
        done["step"] = found or None
        done["step_known"] = bool(found)
    elif kind is CommandType.SWITCH_FALLBACK:
        target = done.get("to")
        split = split_model_dependency(target) if isinstance(target, str) else None
        if split is not None:
            provider, model = split
            done["provider"] = provider
            done["model"] = model
    elif kind is CommandType.PAUSE_RUN:
        given = {
            "pause_timeout_s": done.get("timeout_s", done.get("pause_timeout_s")),
            "on_timeout": done.get("on_timeout"),
        }
        done.pop("pause_timeout_s", None)
        done.update(PauseTimeout.asked(given, pause).params())
    return done


def _command(
    failure: Failure,
    kind: CommandType,
    params: Mapping[str, AttrValue],
    *,
    not_before: float,
    now: float,
    step: str,
    pause: PauseTimeout = ESCALATION_PAUSE,
) -> Command:
    key = command_key(failure.trace_id, failure.span_id, failure.rule, step)
    params = agent_params(kind, params, step=failure.span_name, pause=pause)
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
        if isinstance(reopens, (int, float)) and not isinstance(reopens, bool) and reopens >= 0:
            # Until the breaker may half-open, then resume (the default when the decision
            # names no pause of its own): the outcome is sent at the deadline either way.
            pause = PauseTimeout.asked(decision.params, PauseTimeout(float(reopens), "resume"))
            paused = _command(
                failure,
                CommandType.PAUSE_RUN,
                params,
                not_before=now,
                now=now,
                step="pause",
                pause=pause,
            )
            outcome = {k: v for k, v in params.items() if k not in _PAUSE_ASKS}
            outcome["after_pause"] = paused.id
            return [
                paused,
                _command(
                    failure,
                    pause.command,
                    outcome,
                    not_before=now + pause.timeout_s,
                    now=now,
                    # "resume" keeps the key commands of this kind always had.
                    step="resume" if pause.on_timeout == "resume" else "pause_timeout",
                ),
            ]
        return [
            _command(failure, CommandType.ABORT_RUN, params, not_before=now, now=now, step="abort")
        ]
    if action is Action.ESCALATE:
        if params.get("run_ended"):
            return []  # its turn ended: nothing runs to pause; the person is still asked
        held = {**params, "awaiting": "approval"}
        pause = escalation_pause(decision)
        return [
            _command(
                failure,
                CommandType.PAUSE_RUN,
                held,
                not_before=now,
                now=now,
                step="pause",
                pause=pause,
            )
        ]
    return []


def escalation_pause(decision: Decision) -> PauseTimeout:
    """How long an escalation's pause waits for a person, and what happens then."""
    return PauseTimeout.asked(decision.params, ESCALATION_PAUSE)


def proposal(failure: Failure, decision: Decision) -> dict[str, Any]:
    """The approval request of an escalation: what failed, where, what is proposed and why."""
    proposed = decision.params.get("proposed_action")
    action = proposed if isinstance(proposed, str) else CommandType.RETRY_STEP.value
    pause = escalation_pause(decision)
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
        # The store keeps the deadline (created_at + timeout_s) and expires the request.
        **_no_answer(pause, ended=bool(decision.params.get("run_ended"))),
    }


def _no_answer(pause: PauseTimeout, *, ended: bool) -> dict[str, Any]:
    """What happens to an escalation nobody answers: its run's outcome, none if it ended."""
    if ended:  # nothing was paused, and nothing is sent to a run that ended
        return {
            "timeout": {"timeout_s": pause.timeout_s, "on_timeout": ""},
            "on_no_answer": f"no answer within {pause.timeout_s:g} s: the request expires;"
            " the run had ended, so nothing is sent",
        }
    return {
        "timeout": pause.params(),
        "on_no_answer": (
            f"no answer within {pause.timeout_s:g} s: the request expires and the run gets"
            f" {pause.command.value}"
        ),
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


def pause_timed_out(
    failure_like: Mapping[str, Any],
    *,
    approval_id: str,
    incident: str,
    on_timeout: str,
    timeout_s: float,
    proposal_body: Mapping[str, Any],
    now: float,
) -> Command:
    """The outcome a run gets when its approval request expired unanswered.

    ``resume_run`` or ``abort_run`` (``on_timeout``); its key derives from the
    incident, so however often the expiry is handled it is one command.
    ``after_pause`` names the pause it ends: an agent whose own timer already
    ended that pause drops it.
    """
    where = proposal_body.get("where", {})
    trace_id = str(where.get("trace_id", ""))
    span_id = str(where.get("span_id", ""))
    rule = str(failure_like.get("rule", ""))
    key = command_key(trace_id, span_id, incident, "pause_timeout")
    pause_key = command_key(trace_id, span_id, rule, "pause")
    kind = _OUTCOME_COMMAND.get(on_timeout, CommandType.ABORT_RUN)
    params: dict[str, AttrValue] = {
        "approval_id": approval_id,
        "after_pause": f"cmd_{pause_key[:24]}",
        "reason": f"no answer to approval request {approval_id} within {timeout_s:g} s",
    }
    return Command(
        id=f"cmd_{key[:24]}",
        idempotency_key=key,
        type=kind,
        service=str(where.get("service", "")),
        run_id=str(where.get("run_id", "")),
        trigger_trace_id=trace_id,
        trigger_span_id=span_id,
        failure=dict(failure_like),
        params=agent_params(kind, params, step=str(failure_like.get("span_name") or "")),
        not_before=now,
        created_at=now,
    )
