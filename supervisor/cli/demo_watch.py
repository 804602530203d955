"""The demo's watcher: what changed in the sidecar's control API, as events.

:class:`Watcher` polls the same answers an operator gets from ``spanvisor
runs``, ``incidents``, ``commands``, ``remediations``, ``breakers`` and
``approvals``, and turns what changed into :class:`Event` s: a failure
classified, its decision, a command delivered, a remediation started or
ended, a breaker changing state, an approval asked for or answered. It keeps
what it saw (:class:`Seen`) for the demo's checks and summary.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from supervisor.cli.demo_text import Event, clean
from supervisor.cli.demo_text import text_field as _s

#: A dotted module path before an exception's name: ``a.b.RateLimitError: ...``.
_DOTTED = re.compile(r"^(?:[A-Za-z_]\w{0,80}\.){1,12}(?=[A-Za-z_]\w{0,80}:)")


def short_message(message: str) -> str:
    """An error message without the module path of its exception type (the name stays)."""
    return _DOTTED.sub("", message, count=1)


def _decision_text(failure: Mapping[str, Any]) -> str:
    """A decision in a few words: what, its main parameters, the entry, what revised it."""
    found = failure.get("params")
    params: Mapping[str, Any] = found if isinstance(found, dict) else {}
    action = _s(failure, "action")
    delay, attempt, most = params.get("delay_s"), params.get("attempt"), params.get("max_attempts")
    if action == "retry" and isinstance(delay, (int, float)):
        count = f" (attempt {attempt} of {most} failed)" if attempt and most else ""
        what = f"retry in {delay:.1f}s{count}"
    elif action == "fallback":
        what = f"fall back to {params.get('to', '?')}"
    elif action == "remediate":
        what = f"remediate with {params.get('remediator', '?')}"
    elif action == "fail_fast":
        what = "fail fast: abort the run"
    elif action == "escalate":
        what = "escalate: pause the run and ask a person"
    else:
        what = action
    text = f"{what}  (policy {_s(failure, 'policy')})"
    # The governor's revisions follow the policy's own reason after "; ".
    _, _, revised = _s(failure, "reason").partition("; ")
    return f"{text}; revised: {revised}" if revised else text


def command_detail(command: Mapping[str, Any]) -> str:
    """What a command carries that matters to a reader (its target, its list, its answer)."""
    found = command.get("params")
    params: Mapping[str, Any] = found if isinstance(found, dict) else {}
    kind = _s(command, "type")
    if kind == "switch_fallback":
        return f" to {params.get('to', '?')}"
    if kind == "resume_run":
        unverified = params.get("unverified") or []
        listed = ", ".join(str(u) for u in unverified) if isinstance(unverified, list) else ""
        return f" (unverified: {listed or 'none'})"
    if kind == "retry_step" and isinstance(params.get("retry_after_s"), (int, float)):
        return f" (the server asked for {params['retry_after_s']:g}s)"
    if kind == "inject_guidance":
        return f": {params.get('guidance', '')}"
    if kind == "rewind_run":
        target = params.get("tool") or f"{params.get('steps_back', '?')} steps back"
        return f" to before the loop on {target}"
    if kind == "approval_result":
        verdict = "approved" if params.get("approved") is True else "denied"
        return f": {verdict} by {params.get('answered_by', '?')} ({params.get('note', '')})"
    if kind in ("abort_run", "pause_run"):
        why = params.get("reason") or params.get("awaiting") or ""
        return f" ({why})" if why else ""
    return ""


@dataclass
class Seen:
    """Everything the watcher has read, by id (the summary's material)."""

    failures: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    commands: dict[str, dict[str, Any]] = field(default_factory=dict)
    remediations: dict[str, dict[str, Any]] = field(default_factory=dict)
    approvals: dict[str, dict[str, Any]] = field(default_factory=dict)
    breakers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: (seconds since start, dependency, old state, new state), as observed.
    breaker_changes: list[tuple[float, str, str, str]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: The remediator and run of each remediation, from the decisions that started them.
    remediation_of: dict[str, tuple[str, str]] = field(default_factory=dict)


class Watcher:
    """Polls the control API and reports what changed since the last poll as events.

    Each poll makes a handful of bounded GETs (``limit`` is capped by the API);
    a request that fails is skipped until the next poll. The clock gives the
    seconds since the demo started.
    """

    def __init__(self, client: httpx.Client, clock: Callable[[], float]) -> None:
        self.client = client
        self.clock = clock
        self.seen = Seen()
        self.errors = 0

    def _get(self, path: str, key: str, **params: Any) -> list[dict[str, Any]] | None:
        try:
            response = self.client.get(path, params=params)
            response.raise_for_status()
            found = response.json().get(key)
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return None
        return [f for f in found if isinstance(f, dict)] if isinstance(found, list) else None

    def poll(self) -> list[Event]:
        """One round of GETs; the events of what changed, in cause-and-effect order."""
        now = self.clock()
        events: list[Event] = []
        failures = self._get("/v1/failures", "failures", limit=1000)
        if failures is not None:
            events += self._failures(failures, now)
        breakers = self._get("/v1/breakers", "breakers")
        if breakers is not None:
            events += self._breakers(breakers, now)
        approvals = self._get("/v1/approvals", "approvals", limit=200)
        if approvals is not None:
            events += self._approvals(approvals, now)
        remediations = self._get("/v1/remediations", "remediations", limit=200)
        started, ended = ([], []) if remediations is None else self._remediations(remediations, now)
        events += started
        commands = self._get("/v1/commands/log", "commands", limit=1000)
        if commands is not None:
            events += self._commands(commands, now)
        events += ended
        runs = self._get("/v1/runs", "runs", limit=100)
        if runs is not None:
            self.seen.runs = runs
        return events

    def _failures(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for failure in sorted(found, key=lambda f: int(f.get("received_ns") or 0)):
            key = (_s(failure, "trace_id"), _s(failure, "span_id"), _s(failure, "rule"))
            if key in self.seen.failures:
                continue
            self.seen.failures[key] = failure
            run = _s(failure, "run_id")
            params = failure.get("params")
            if isinstance(params, dict) and isinstance(params.get("remediation_id"), str):
                self.seen.remediation_of[params["remediation_id"]] = (
                    str(params.get("remediator", "?")),
                    run,
                )
            events.append(
                Event(
                    now,
                    "failure",
                    run,
                    f"{_s(failure, 'class')}/{_s(failure, 'kind')} on"
                    f" {_s(failure, 'dependency') or _s(failure, 'span_name')}"
                    f"  rule {_s(failure, 'rule')}: {clean(short_message(_s(failure, 'message')))}",
                )
            )
            events.append(Event(now, "decision", run, _decision_text(failure)))
        return events

    def _breakers(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for breaker in found:
            dependency = _s(breaker, "dependency")
            state = _s(breaker, "state")
            before = self.seen.breakers.get(dependency)
            self.seen.breakers[dependency] = breaker
            old = _s(before, "state") if before is not None else "closed"
            if state == old:
                continue
            self.seen.breaker_changes.append((now, dependency, old, state))
            what = {
                "open": "runs that call it move to a fallback",
                "half_open": "the next calls are trials",
                "closed": "the trial calls succeeded: healthy again",
                "isolated": "isolated by an operator",
            }.get(state, state)
            if (old, state) == ("half_open", "open"):
                what = "a trial call failed: open again"
            events.append(Event(now, "breaker", "", f"{dependency} {old} -> {state}: {what}"))
        return events

    def _approvals(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for approval in sorted(found, key=lambda a: float(a.get("created_at") or 0)):
            approval_id = _s(approval, "id")
            before = self.seen.approvals.get(approval_id)
            self.seen.approvals[approval_id] = approval
            status = _s(approval, "status")
            run = _s(approval, "run_id")
            if before is None:
                raw = approval.get("what")
                what: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
                proposal = approval.get("proposal")
                proposed = _s(proposal, "command") if isinstance(proposal, dict) else proposal
                events.append(
                    Event(
                        now,
                        "approval",
                        run,
                        f"{approval_id} asks a person: {_s(what, 'kind')} on"
                        f" {_s(what, 'dependency')}; on approval: {proposed or '?'}",
                    )
                )
            if status != "pending" and (before is None or _s(before, "status") == "pending"):
                events.append(
                    Event(
                        now,
                        "approval",
                        run,
                        f"{approval_id} {status} by {_s(approval, 'answered_by')}"
                        f" ({_s(approval, 'note')})",
                    )
                )
        return events

    def _remediations(
        self, found: list[dict[str, Any]], now: float
    ) -> tuple[list[Event], list[Event]]:
        started: list[Event] = []
        ended: list[Event] = []
        for remediation in sorted(found, key=lambda r: float(r.get("created_at") or 0)):
            rid = _s(remediation, "id")
            before = self.seen.remediations.get(rid)
            self.seen.remediations[rid] = remediation
            name, run = self.seen.remediation_of.get(rid, ("remediation", ""))
            if before is None:
                started.append(Event(now, "remediation", run, f"{name} started ({rid})"))
            outcome = _s(remediation, "outcome")
            if outcome and (before is None or not _s(before, "outcome")):
                reason = _s(remediation, "reason")
                ended.append(
                    Event(now, "remediation", run, f"{name} {outcome}: {reason or '-'} ({rid})")
                )
        return started, ended

    def _commands(self, found: list[dict[str, Any]], now: float) -> list[Event]:
        events: list[Event] = []
        for command in sorted(found, key=lambda c: _s(c, "created_at")):
            command_id = _s(command, "id")
            before = self.seen.commands.get(command_id)
            self.seen.commands[command_id] = command
            status = _s(command, "status")
            if status not in ("delivered", "dead"):
                continue
            if before is not None and _s(before, "status") == status:
                continue
            verb = "delivered" if status == "delivered" else "dead-lettered"
            events.append(
                Event(
                    now,
                    "command",
                    _s(command, "run_id"),
                    f"{_s(command, 'type')} {verb} ({_s(command, 'channel')})"
                    + command_detail(command),
                )
            )
        return events
