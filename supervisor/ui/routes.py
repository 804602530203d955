"""The console's pages: a FastAPI router over :class:`~supervisor.api.control.Control`.

Every page reads what the JSON API reads, and the actions here (answering an
approval, re-delivering a dead letter) are the same calls as ``spanvisor
approvals approve|deny`` and ``POST /v1/dead-letters/{id}/redeliver``. Pages
are server-rendered and work without JavaScript; a form that changes
something goes through a confirmation page first.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment
from markupsafe import Markup

from supervisor.act.store_rows import IncidentCounts
from supervisor.api.control import Control, ControlError
from supervisor.records import RUN_STATUSES
from supervisor.ui.charts import breaker_strip, incidents_chart
from supervisor.ui.forms import read_form
from supervisor.ui.sessions import COOKIE, Session, Sessions, csrf_matches
from supervisor.ui.timeline import KINDS, run_timeline

__all__ = ["Console", "NeedLogin", "Refused", "Viewer", "router"]

#: A note and a name, as the JSON API bounds them.
MAX_NOTE = 2000
MAX_BY = 200
#: Runs read for one page when a text filter is given (the JSON API's own bound).
RUNS_READ = 1000
RUNS_SHOWN = 200
_APPROVAL_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
#: The incidents chart's windows: (query value, words, seconds, buckets).
WINDOWS = (
    ("6h", "last 6 h", 6 * 3600.0, 24),
    ("24h", "last 24 h", 86_400.0, 24),
    ("7d", "last 7 d", 7 * 86_400.0, 28),
)
#: The breakers' strips cover this much; the newest changes listed in words per breaker.
BREAKER_WINDOW_S = 6 * 3600.0
BREAKER_CHANGES_LISTED = 5


@dataclass(frozen=True, slots=True)
class Console:
    """What the pages need: the control operations, the token, logins, templates."""

    control: Control
    token: str
    sessions: Sessions
    templates: Environment
    #: A URL with ``{trace_id}`` (None: no trace links).
    trace_url: str | None
    #: Whether the cookie is sent over HTTPS only (tests of plain-HTTP browsers turn it off).
    secure_cookie: bool = True


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who asks: a logged-in browser (its session) or a client with the bearer token."""

    session: Session | None


class NeedLogin(Exception):
    """No session and no token: the login page (303)."""


class Refused(Exception):
    """A request the console refuses, with the status and the sentence to show."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def console(request: Request) -> Console:
    found: Console = request.app.state.console
    return found


def viewer(request: Request) -> Viewer:
    """The session of the cookie, or the bearer token; else to the login page."""
    ui = console(request)
    given = request.headers.get("authorization")
    if given is not None:
        if not hmac.compare_digest(given.encode(), f"Bearer {ui.token}".encode()):
            raise Refused(401, "Missing or wrong bearer token.")
        return Viewer(session=None)
    session = ui.sessions.get(request.cookies.get(COOKIE))
    if session is None:
        raise NeedLogin
    return Viewer(session=session)


Ui = Annotated[Console, Depends(console)]
Who = Annotated[Viewer, Depends(viewer)]
router = APIRouter()


def render(
    request: Request, name: str, who: Viewer | None, status: int = 200, **values: Any
) -> HTMLResponse:
    ui = console(request)
    page = ui.templates.get_template(name).render(
        request_path=request.url.path,
        request_url=str(request.url.path) + (f"?{request.url.query}" if request.url.query else ""),
        csrf=who.session.csrf if who is not None and who.session is not None else "",
        logged_in=who is not None and who.session is not None,
        **values,
    )
    return HTMLResponse(page, status_code=status)


async def posted(request: Request, who: Viewer) -> dict[str, str]:
    """A form's fields, once its CSRF token is checked (a browser's session posts it).

    A bearer client needs none: a browser never adds the header to a form
    another site makes it send.
    """
    fields = await read_form(request)
    if who.session is not None and not csrf_matches(who.session, fields.get("csrf")):
        raise Refused(
            403,
            "This form is missing its security token, or it is stale: reload"
            " the page and send it again.",
        )
    return fields


def _see(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303)


# -- login ---------------------------------------------------------------------------


@router.get("/")
async def home(_: Who) -> Response:
    return _see("/ui/runs")


@router.get("/login")
async def login_form(request: Request) -> Response:
    return render(request, "login.html", None)


@router.post("/login")
async def login(request: Request, ui: Ui) -> Response:
    fields = await read_form(request)
    given = fields.get("token", "")
    if not hmac.compare_digest(given.encode(), ui.token.encode()):
        return render(request, "login.html", None, 401, error="That token is not this sidecar's.")
    session = ui.sessions.open()
    answer = _see("/ui/runs")
    answer.set_cookie(
        COOKIE,
        session.id,
        max_age=int(ui.sessions.ttl_s),
        path="/ui",
        secure=ui.secure_cookie,
        httponly=True,
        samesite="strict",
    )
    return answer


@router.post("/logout")
async def logout(request: Request, ui: Ui, who: Who) -> Response:
    await posted(request, who)
    if who.session is not None:
        ui.sessions.close(who.session.id)
    answer = _see("/ui/login")
    answer.delete_cookie(
        COOKIE, path="/ui", secure=ui.secure_cookie, httponly=True, samesite="strict"
    )
    return answer


# -- runs ----------------------------------------------------------------------------


@router.get("/runs")
async def runs(
    request: Request,
    *,
    ui: Ui,
    who: Who,
    status: Annotated[str, Query(max_length=16)] = "",
    service: Annotated[str, Query(max_length=256)] = "",
    text: Annotated[str, Query(max_length=256)] = "",
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> Response:
    needle = text.strip().lower()
    found = await ui.control.run_list(
        status=status or None,
        service=service or None,
        limit=RUNS_READ if needle else 100,
        cursor=cursor,
    )
    listed = found["runs"]
    if needle:
        listed = [
            r for r in listed if needle in f"{r['run_id']}\n{r['service']}\n{r['step']}".lower()
        ]
    return render(
        request,
        "runs.html",
        who,
        runs=listed[:RUNS_SHOWN],
        cut=len(listed) > RUNS_SHOWN,
        tracking=found["tracking"],
        fleet=found.get("fleet", False),
        next_cursor=found["next_cursor"],
        filters={"status": status, "service": service, "text": text},
        statuses=RUN_STATUSES,
    )


@router.get("/runs/{run_id:path}")
async def run_page(request: Request, ui: Ui, who: Who, run_id: str) -> Response:
    if not run_id or len(run_id) > 512:
        raise Refused(404, "No such run.")
    timeline = await run_timeline(ui.control, run_id)
    trace_link = (
        ui.trace_url.replace("{trace_id}", timeline.trace_id)
        if ui.trace_url and timeline.trace_id
        else None
    )
    return render(request, "run.html", who, timeline=timeline, trace_link=trace_link, kinds=KINDS)


# -- approvals -------------------------------------------------------------------------


@router.get("/approvals")
async def approvals(
    request: Request,
    ui: Ui,
    who: Who,
    answered: Annotated[str, Query(max_length=128)] = "",
) -> Response:
    control = ui.control
    pending = (await control.stored(control.approvals, "pending", 100))["approvals"]
    recent = (await control.stored(control.approvals, None, 100))["approvals"]
    flash = None
    if answered and _APPROVAL_ID.fullmatch(answered):
        # Said from the store, not from the link: a crafted link cannot fake an answer.
        try:
            flash = await control.stored(control.approval, answered)
        except ControlError:
            flash = None
    return render(
        request,
        "approvals.html",
        who,
        pending=pending,
        answered=[a for a in recent if a["status"] != "pending"],
        flash=flash,
    )


def _by(fields: dict[str, str]) -> str:
    """Who acts: the name given on the form, or "ui"."""
    by = fields.get("by", "").strip() or "ui"
    if len(by) > MAX_BY:
        raise Refused(400, f"The name is longer than {MAX_BY} characters.")
    return by


def _answer_fields(fields: dict[str, str]) -> tuple[str, str, str]:
    action = fields.get("action", "")
    if action not in ("approve", "deny"):
        raise Refused(400, "Choose approve or deny.")
    note = fields.get("note", "")
    if len(note) > MAX_NOTE:
        raise Refused(400, f"The note is longer than {MAX_NOTE} characters.")
    return action, note, _by(fields)


@router.post("/approvals/{approval_id}/confirm")
async def confirm_answer(request: Request, ui: Ui, who: Who, approval_id: str) -> Response:
    fields = await posted(request, who)
    action, note, by = _answer_fields(fields)
    found = await ui.control.stored(ui.control.approval, approval_id)
    if found["status"] != "pending":
        raise Refused(
            409,
            f"Approval request {approval_id} is already {found['status']}"
            + (f" by {found['answered_by']}" if found.get("answered_by") else "")
            + ": nothing to answer.",
        )
    return render(request, "confirm.html", who, approval=found, action=action, note=note, by=by)


@router.post("/approvals/{approval_id}/answer")
async def answer(request: Request, ui: Ui, who: Who, approval_id: str) -> Response:
    fields = await posted(request, who)
    action, note, by = _answer_fields(fields)
    await ui.control.answer(approval_id, approved=action == "approve", by=by, note=note)
    return _see(f"/ui/approvals?answered={approval_id}")


# -- incidents, breakers, remediations, dead letters -----------------------------------


def _class_totals(counts: IncidentCounts) -> list[tuple[str, int]]:
    """Incidents per failure class, most first (the chart's summary in words)."""
    totals: dict[str, int] = {}
    for series in counts.series:
        name = series.failure_class or "unclassified"
        totals[name] = totals.get(name, 0) + series.total
    return sorted(totals.items(), key=lambda item: (-item[1], item[0]))


@router.get("/incidents")
async def incidents(
    request: Request,
    ui: Ui,
    who: Who,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    window: Annotated[str, Query(max_length=8)] = "24h",
) -> Response:
    chosen = next((w for w in WINDOWS if w[0] == window), None)
    if chosen is None:
        raise Refused(400, "The window must be one of " + ", ".join(w[0] for w in WINDOWS) + ".")
    found = await ui.control.stored(ui.control.incidents, 100, cursor)
    counts = await ui.control.incident_counts(window_s=chosen[2], buckets=chosen[3])
    return render(
        request,
        "incidents.html",
        who,
        incidents=found["incidents"],
        next_cursor=found["next_cursor"],
        # The chart's names are escaped inside it (charts.text): the markup is the chart's.
        chart=Markup(incidents_chart(counts)),  # noqa: S704
        counts=counts,
        class_totals=_class_totals(counts),
        windows=WINDOWS,
        window=chosen,
    )


@router.get("/breakers")
async def breakers(request: Request, ui: Ui, who: Who) -> Response:
    found = ui.control.breakers()
    timelines = ui.control.breaker_timelines(
        [b["dependency"] for b in found["breakers"]], window_s=BREAKER_WINDOW_S
    )
    history = {
        name: {
            # The strip's names are escaped inside it (charts.text).
            "strip": Markup(breaker_strip(timeline)),  # noqa: S704
            "changes": list(reversed(timeline.transitions[-BREAKER_CHANGES_LISTED:])),
            "seen": len(timeline.transitions),
        }
        for name, timeline in timelines.items()
    }
    return render(request, "breakers.html", who, board=found, history=history)


@router.get("/remediations")
async def remediations(
    request: Request, ui: Ui, who: Who, cursor: Annotated[str | None, Query(max_length=512)] = None
) -> Response:
    found = await ui.control.remediation_list(status=None, limit=50, cursor=cursor)
    return render(request, "remediations.html", who, found=found)


@router.get("/remediations/{remediation_id}")
async def remediation(request: Request, ui: Ui, who: Who, remediation_id: str) -> Response:
    found = await ui.control.remediation(remediation_id)
    return render(request, "remediation.html", who, remediation=found)


@router.get("/dead-letters")
async def dead_letters(
    request: Request,
    ui: Ui,
    who: Who,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    redelivered: Annotated[str, Query(max_length=128)] = "",
) -> Response:
    found = await ui.control.stored(ui.control.dead_letters, 100, cursor)
    flash = None
    if redelivered and _APPROVAL_ID.fullmatch(redelivered):
        # Said from the store, not from the link: a crafted link cannot fake a re-delivery.
        try:
            flash = await ui.control.stored(ui.control.command, redelivered)
        except ControlError:
            flash = None
    return render(
        request,
        "dead_letters.html",
        who,
        dead_letters=found["dead_letters"],
        next_cursor=found["next_cursor"],
        flash=flash if flash is not None and flash.get("redeliveries") else None,
    )


@router.post("/dead-letters/{command_id}/confirm")
async def confirm_redelivery(request: Request, ui: Ui, who: Who, command_id: str) -> Response:
    fields = await posted(request, who)
    by = _by(fields)
    found = await ui.control.stored(ui.control.command, command_id)
    if found["status"] != "dead":
        raise Refused(
            409, f"Command {command_id} is {found['status']}, not a dead letter: nothing to send."
        )
    return render(request, "confirm_redelivery.html", who, command=found, by=by)


@router.post("/dead-letters/{command_id}/redeliver")
async def redeliver(request: Request, ui: Ui, who: Who, command_id: str) -> Response:
    fields = await posted(request, who)
    await ui.control.redeliver(command_id, by=_by(fields))
    return _see(f"/ui/dead-letters?redelivered={quote(command_id, safe='')}")
