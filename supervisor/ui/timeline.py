"""One run's timeline: what the sidecar knows of it, in time order.

Read through :class:`~supervisor.api.control.Control`, as the JSON API reads:

* ``span``: the run's first and latest span, from the run tracker (it keeps
  each run's counts and where it is, not every span: the trace viewer has them);
* ``failure``: failures found in the run's spans, from the recent failures in
  memory and, for older ones, from their stored incidents;
* ``decision``: what the policy decided on each (the stored incidents);
* ``command``: the commands sent to the run (the store);
* ``approval``: the run's approval requests and their answers;
* ``remediation``: remediations its incidents started (the runner, when up).

What cannot be shown, and why, is listed in :attr:`Timeline.notes`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from supervisor.api.control import Control, ControlError
from supervisor.records import remediation_ids

__all__ = ["KINDS", "Item", "Timeline", "run_timeline"]

#: Every kind of item, as ``<li data-kind>`` says it.
KINDS = ("span", "failure", "decision", "command", "remediation", "approval")
#: Rows read per source (incidents, commands, approvals): a page for a person.
PER_SOURCE = 200
#: Recent failures looked through (the route's own bound on one page).
FAILURES_READ = 10_000
#: Remediations asked of the runner (one blocking call each).
MAX_REMEDIATIONS = 20
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class Item:
    """One thing that happened to the run: when, what kind, a title and its facts."""

    at: float
    kind: str
    title: str
    #: A word for the state, shown as text (and coloured by it): ok, warn, bad, info.
    tone: str = "info"
    #: (label, value) pairs, shown as text only.
    facts: tuple[tuple[str, str], ...] = ()
    #: A console page about it (never a URL from a span).
    page: str | None = None


@dataclass(frozen=True, slots=True)
class Timeline:
    run_id: str
    #: The run as ``GET /v1/runs`` lists it (None: not tracked by this sidecar).
    run: dict[str, Any] | None
    items: list[Item]
    #: The latest trace known of the run, for the trace viewer's link ("" if none).
    trace_id: str
    notes: list[str] = field(default_factory=list)


async def run_timeline(control: Control, run_id: str) -> Timeline:
    """Everything known of ``run_id``, oldest first; see the module."""
    notes: list[str] = []
    items: list[Item] = []
    run = await control.run(run_id)
    if run is None:
        notes.append(
            "This sidecar does not track this run now, nor does one of its fleet (it ended"
            " and was dropped, or track_runs is off): its counts and spans are not shown,"
            " only what the store holds."
        )
    else:
        items.extend(_spans(run))
        notes.append(
            "Spans: the sidecar keeps each run's counts and its first and latest span, not"
            " every span; the trace viewer shows them all."
        )
    failures = [
        f for f in control.failure_page(FAILURES_READ, None)["failures"] if f["run_id"] == run_id
    ]
    incidents, commands, approvals = await control.stored(
        control.store.run_history, run_id, PER_SOURCE
    )
    seen = {(f["span_id"], f["rule"]) for f in failures}
    items.extend(_failure(f, f["received_ns"] / 1e9) for f in failures)
    for incident in incidents:
        body = dict(incident.body)
        if (body.get("span_id"), body.get("rule")) not in seen:  # older than those in memory
            items.append(_failure(body, incident.created_at))
        items.append(_decision(body, incident.created_at))
    items.extend(_command(c.to_json(), c.command.created_at) for c in commands)
    items.extend(_approval(a.to_json()) for a in approvals)
    remediated = [i for i in incidents if i.body.get("action") == "remediate"]
    items.extend(await _remediations(control, remediated[:MAX_REMEDIATIONS], notes))
    if len(incidents) >= PER_SOURCE:
        notes.append(f"Only the run's newest {PER_SOURCE} incidents are shown.")
    items.sort(key=lambda item: item.at)
    traces = [str(f.get("trace_id", "")) for f in failures] + [
        str(i.body.get("trace_id", "")) for i in incidents
    ]
    trace_id = (
        run_id
        if _TRACE_ID.fullmatch(run_id)
        else next((t for t in reversed(traces) if _TRACE_ID.fullmatch(t)), "")
    )
    return Timeline(run_id=run_id, run=run, items=items, trace_id=trace_id, notes=notes)


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _spans(run: dict[str, Any]) -> list[Item]:
    first = Item(
        at=float(run["started_at"]),
        kind="span",
        title="first span seen",
        facts=(("service", _text(run["service"])),),
    )
    latest = Item(
        at=float(run["last_seen_at"]),
        kind="span",
        title="latest span",
        tone="bad" if run["status"] in ("failing", "stalled") else "info",
        facts=(
            ("step", _text(run["step"]) or "-"),
            ("status", _text(run["status"])),
            ("spans so far", _text(run["spans"])),
        ),
    )
    return [first, latest]


def _failure(found: dict[str, Any], at: float) -> Item:
    return Item(
        at=at,
        kind="failure",
        title=f"{_text(found.get('class'))}/{_text(found.get('kind'))}",
        tone="bad",
        facts=(
            ("span", _text(found.get("span_name"))),
            ("span id", _text(found.get("span_id"))),
            ("dependency", _text(found.get("dependency")) or "-"),
            ("rule", _text(found.get("rule"))),
            ("message", _text(found.get("message"))),
        ),
    )


def _decision(body: dict[str, Any], at: float) -> Item:
    observed = " (observe only)" if body.get("observe_only") else ""
    return Item(
        at=at,
        kind="decision",
        title=f"{_text(body.get('action'))}{observed}",
        tone="warn" if body.get("action") not in (None, "none") else "info",
        facts=(
            ("policy", _text(body.get("policy")) or "-"),
            ("reason", _text(body.get("reason"))),
        ),
    )


def _command(command: dict[str, Any], at: float) -> Item:
    status = _text(command.get("status"))
    facts = [
        ("status", status),
        ("channel", _text(command.get("channel")) or "none"),
        ("attempts", _text(command.get("attempts"))),
    ]
    if command.get("last_error"):
        facts.append(("last error", _text(command["last_error"])))
    return Item(
        at=at,
        kind="command",
        title=_text(command.get("type")),
        tone={"delivered": "ok", "dead": "bad"}.get(status, "warn"),
        facts=tuple(facts),
    )


def _approval(approval: dict[str, Any]) -> Item:
    status = _text(approval.get("status"))
    facts = [("status", status)]
    if approval.get("answered_by"):
        facts.append(("answered by", _text(approval["answered_by"])))
    if approval.get("note"):
        facts.append(("note", _text(approval["note"])))
    return Item(
        at=float(approval.get("created_at") or 0.0),
        kind="approval",
        title=f"approval request {_text(approval.get('id'))}",
        tone={"approved": "ok", "pending": "warn"}.get(status, "bad"),
        facts=tuple(facts),
        page="/ui/approvals",
    )


async def _remediations(control: Control, incidents: list[Any], notes: list[str]) -> list[Item]:
    found: list[Item] = []
    for incident in incidents:
        body = incident.body
        rid, _ = remediation_ids(
            str(body.get("trace_id", "")), str(body.get("span_id", "")), str(body.get("rule", ""))
        )
        try:
            shown = await control.remediation(rid)
        except ControlError as exc:
            if exc.status != 404:  # the runner is not up, or did not answer: say it once
                notes.append(f"Remediations are not shown: {exc}")
                break
            notes.append(f"Remediation {rid} is not known to the runner.")
            continue
        found.append(
            Item(
                at=float(shown.get("created_at") or incident.created_at),
                kind="remediation",
                title=f"remediation {rid}",
                tone={"SUCCESS": "ok", "ERROR": "bad", "CANCELLED": "bad"}.get(
                    _text(shown.get("status")), "warn"
                ),
                facts=(
                    ("status", _text(shown.get("status"))),
                    ("outcome", _text(shown.get("outcome")) or "-"),
                ),
                page=f"/ui/remediations/{rid}",
            )
        )
    return found
