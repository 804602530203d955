"""The operator console (/ui) in Chromium, against a real ``spanvisor run`` process.

* An escalation approved in the console: the LangGraph example agent
  (``examples/langgraph_agent.py``, the harness of ``test_e2e_langgraph``: its
  sidecar, its fake provider, its scenario ``approvals``) meets a 401, which
  the sidecar escalates; a person logs in with the token, finds the paused run,
  approves it on the approvals page with a note, through the confirmation,
  and the run goes on to the end. The answer is recorded as the CLI's would be.
* Hostile span content: spans whose service, span name, attribute values,
  model and error message are markup and ``javascript:`` URLs, sent over
  OTLP with the OpenTelemetry SDK, make incidents, an approval, an open
  breaker and dead letters; every page shows them as text, runs no script,
  opens no dialog, sends its Content Security Policy and breaks none of it;
  and shows no time from 1970 (a monotonic reading taken for a date).
* Cross-site: a page elsewhere that posts an answer while the person is
  logged in answers nothing.
* Re-delivery: a dead letter sent again from the dead letters page, through
  its confirmation.
* Live refresh: a run that begins while the runs page is open appears on it
  (htmx, under the same CSP), its markup-like name still text.
* The keyboard: logging in and reaching the approvals page with Tab and Enter.
* Without JavaScript: logging in, finding a run and denying its request.

The browser is the system's Chromium (see ``tests/browser.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from playwright.sync_api import Page, Response, expect

from supervisor.testing.fake_provider import Reply
from supervisor.testing.sidecar_process import SidecarProcess, wait_until
from tests.browser import (  # noqa: F401 - browser, console(_without_js): fixtures
    Console,
    as_assertions,
    browser,
    console,
    console_without_js,
    login,
)
from tests.test_e2e_langgraph import (
    MODELS,
    SERVICES,
    TOKEN,
    Stack,
    explained,
    in_step,
    stack,  # noqa: F401 - the fixture: a sidecar and the fake provider, for the module
    start_agent,
)

pytestmark = pytest.mark.slow

#: What every /ui response says, word for word (the console's security contract).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
NOTE = "checked the key with the provider <b>rotated</b>"

# -- (a) an escalation approved in the console --------------------------------------------------


def pending_approval(sidecar: SidecarProcess, service: str) -> dict[str, Any] | None:
    found = sidecar.get("/v1/approvals", status="pending")["approvals"]
    return next((a for a in found if a["service"] == service), None)


def run_status(sidecar: SidecarProcess, run_id: str) -> str:
    runs = sidecar.get("/v1/runs", limit=1000)["runs"]
    return next((str(r["status"]) for r in runs if r["run_id"] == run_id), "")


def test_a_person_approves_an_escalation_in_the_console_and_the_run_goes_on(
    stack: Stack,  # noqa: F811 - the fixture imported above
    console: Console,  # noqa: F811
) -> None:
    service, api = SERVICES["approvals"], stack.sidecar.api
    stack.fake.burst(
        Reply.unauthorized(),
        model=MODELS["approvals"],
        when=in_step("approvals", 0, "user"),
        name="401",
    )
    agent = start_agent(stack, "approvals")
    try:
        with explained(stack, agent), as_assertions():
            approval = wait_until(
                lambda: pending_approval(stack.sidecar, service), 25, "the 401's approval request"
            )
            approval_id, run_id = approval["id"], approval["run_id"]
            wait_until(
                lambda: run_status(stack.sidecar, run_id) == "paused", 10, "the run to pause"
            )
            page = console.new_page()
            login(page, api, TOKEN)

            # The paused run is on the runs page, and its row leads to its page.
            row = page.locator(f'#runs tr[data-run-id="{run_id}"]')
            for shown in (service, "paused"):
                expect(row).to_contain_text(shown)
            row.locator("a.run-link").click()
            expect(page.locator("#run-title")).to_contain_text(run_id)
            expect(page.locator('#timeline li[data-kind="approval"]')).not_to_have_count(0)

            page.locator("#nav").get_by_role("link", name=re.compile("approvals", re.I)).click()
            page.wait_for_url(f"{api}/ui/approvals")
            request = page.locator(f'article[data-approval-id="{approval_id}"]')
            for shown in (service, run_id):
                expect(request).to_contain_text(shown)
            request.locator('textarea[name="note"]').fill(NOTE)
            request.locator('button[name="action"][value="approve"]').click()

            # The confirmation says what will happen; nothing is answered before it.
            expect(page.locator("#confirm-form")).to_be_visible()
            assert stack.sidecar.get(f"/v1/approvals/{approval_id}")["status"] == "pending"
            page.click("#confirm-yes")
            page.wait_for_url(re.compile(rf"{re.escape(api)}/ui/approvals(\?.*)?$"))
            expect(page.locator("#flash")).to_be_visible()
            expect(page.locator("#flash")).to_contain_text(re.compile("approved", re.I))

            answered = stack.sidecar.get(f"/v1/approvals/{approval_id}")
            assert (answered["status"], answered["answered_by"], answered["note"]) == (
                "approved",
                "ui",
                NOTE,
            )

            # The run goes on: the agent gets the approval and finishes its thread.
            agent.finish(timeout_s=40)
            assert agent.returncode == 0
            thread = agent.thread()
            assert thread["status"] == "completed"
            assert [(c["type"], c["action"]) for c in thread["commands"]] == [
                ("pause_run", "wait"),
                ("approval_result", "continue"),
            ]
            assert [(f["step"], f["status_code"]) for f in thread["failures"]] == [(0, 401)]

            # And the console lists the request as answered, with the person's note.
            page.reload()
            expect(page.locator(f'article[data-approval-id="{approval_id}"]')).to_have_count(0)
            answer = page.locator("tr", has_text=approval_id)
            for shown in ("approved", "ui", NOTE):
                expect(answer).to_contain_text(shown)
    finally:
        agent.finish(timeout_s=30)


# -- (b) hostile span content ------------------------------------------------------------------

#: Markup and URLs that would run a script if the console rendered them as HTML or links.
HOSTILE = (
    "<script>window.__pwned=1</script>",
    '<img src=x onerror="window.__pwned=1">',
    "javascript:window.__pwned=1",
    '<svg onload="window.__pwned=1"></svg>',
)
HOSTILE_SERVICE = f"evil-agent {HOSTILE[1]}"
HOSTILE_MODEL = f"gpt-evil {HOSTILE[3]}"
HOSTILE_RUN = f"run {HOSTILE[1]}"
#: Every page of the console that lists things (the run pages are found from the runs page).
PAGES = (
    "/ui/runs",
    "/ui/incidents",
    "/ui/approvals",
    "/ui/breakers",
    "/ui/remediations",
    "/ui/dead-letters",
)
HOSTILE_POLICY = """\
version: 1
policies:
  - name: hostile.auth_needs_a_person
    match: {kind: auth}
    action: escalate
breakers:
  default: {fail_max: 2, reset_timeout_s: 600}
"""


@dataclass
class Hostile:
    sidecar: SidecarProcess
    approval_id: str


def send_hostile_spans(
    sidecar: SidecarProcess,
    run: str = HOSTILE_RUN,
    statuses: tuple[int, ...] = (503, 503, 503, 401),
) -> None:
    """LLM calls of ``run`` answered with ``statuses``, every text field hostile.

    By default three 503s (the breaker opens) and a 401 (escalated).
    """
    provider = TracerProvider(resource=Resource.create({"service.name": HOSTILE_SERVICE}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{sidecar.otlp_endpoint}/v1/traces"))
    )
    tracer = provider.get_tracer("hostile")
    try:
        for status in statuses:
            span = tracer.start_span(f"chat {HOSTILE[0]}", kind=SpanKind.CLIENT)
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.system": "openai",
                    "gen_ai.request.model": HOSTILE_MODEL,
                    "gen_ai.conversation.id": run,
                    "http.response.status_code": status,
                    "user.note": " ".join(HOSTILE),
                    "link.like": HOSTILE[2],
                }
            )
            if status >= 400:
                message = f"Error code: {status} - {HOSTILE[2]} {HOSTILE[0]}"
                span.set_attribute("error.type", str(status))
                span.add_event(
                    "exception",
                    {"exception.type": "openai.APIStatusError", "exception.message": message},
                )
                span.set_status(Status(StatusCode.ERROR, message))
            span.end()
    finally:
        provider.shutdown()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("console-hostile")
    # Commands for the service wait to be pulled, which nobody does: dead letters in 1 s.
    settings = {"agents": {HOSTILE_SERVICE: {"pull": {"ttl_s": 1}}}}
    with SidecarProcess(settings, tmp, policy=HOSTILE_POLICY) as sidecar:
        send_hostile_spans(sidecar)

        def approval() -> str | None:
            found = sidecar.get("/v1/approvals", status="pending")["approvals"]
            return next((a["id"] for a in found if a["service"] == HOSTILE_SERVICE), None)

        approval_id = wait_until(approval, 20, "the hostile 401's approval request")
        wait_until(
            lambda: any(b["state"] == "open" for b in sidecar.get("/v1/breakers")["breakers"]),
            20,
            "the hostile dependency's breaker to open",
        )
        wait_until(lambda: sidecar.get("/v1/dead-letters")["dead_letters"], 20, "a dead letter")
        yield Hostile(sidecar, approval_id)


def visit(page: Page, url: str, console: Console) -> str:  # noqa: F811
    """Go to ``url``; :func:`checked`."""
    return checked(page, page.goto(url), console)


def checked(page: Page, response: Response | None, console: Console) -> str:  # noqa: F811
    """The page's text, once its headers are right and nothing in it ran or became markup."""
    url = page.url
    assert response is not None and response.status == 200, (url, response and response.status)
    headers = response.headers
    assert headers.get("content-security-policy") == CSP, url
    assert headers.get("x-content-type-options") == "nosniff", url
    assert page.evaluate("typeof window.__pwned") == "undefined", f"a script ran on {url}"
    # Nothing hostile became an element: no inline script, image, handler, style or link.
    for selector in (
        "script:not([src])",
        "img[src='x']",
        "[onerror]",
        "[onload]",
        "[style]",
        "a[href^='javascript:' i]",
    ):
        assert page.locator(selector).count() == 0, f"{selector} on {url}"
    assert console.watched.dialogs == [], url
    return page.inner_text("body")


def test_hostile_span_content_is_shown_as_text_and_never_runs(
    hostile: Hostile,
    console: Console,  # noqa: F811
) -> None:
    api = hostile.sidecar.api
    page = console.new_page()
    login(page, api, hostile.sidecar.token)
    # The session is a cookie no script can read, sent to nothing but the console.
    [session] = [c for c in console.context.cookies() if c["name"] == "spanvisor_session"]
    assert (session["httpOnly"], session["secure"], session["sameSite"], session["path"]) == (
        True,
        True,
        "Strict",
        "/ui",
    )
    assert session["value"] != hostile.sidecar.token
    assert "spanvisor_session" not in page.evaluate("document.cookie")

    texts: dict[str, str] = {}
    for path in PAGES:
        texts[path] = visit(page, f"{api}{path}", console)
    page.goto(f"{api}/ui/runs")
    run_pages = [
        href
        for href in page.locator("#runs a.run-link").evaluate_all("els => els.map(e => e.href)")
        if href
    ]
    assert run_pages, "the runs page links no run"
    for href in run_pages:
        texts[urlsplit(href).path] = visit(page, href, console)
    # The confirmation of an answer shows what is approved: hostile too.
    page.goto(f"{api}/ui/approvals")
    request = page.locator(f'article[data-approval-id="{hostile.approval_id}"]')
    with page.expect_navigation() as confirmation:
        request.locator('button[name="action"][value="approve"]').click()
    expect(page.locator("#confirm-form")).to_be_visible()
    texts["confirm"] = checked(page, confirmation.value, console)

    # What was sent is shown, as the text it is.
    everything = "\n".join(texts.values())
    for hostile_text in HOSTILE:
        assert hostile_text in everything, f"{hostile_text!r} is shown on no page"
    assert HOSTILE_SERVICE in texts["/ui/runs"]
    assert HOSTILE_SERVICE in texts["/ui/incidents"]
    assert HOSTILE_SERVICE in texts["/ui/approvals"]
    assert HOSTILE_MODEL in texts["/ui/breakers"]
    assert any(HOSTILE[0] in text for path, text in texts.items() if path.startswith("/ui/runs/"))

    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert console.watched.dialogs == []
    assert console.watched.page_errors == []
    own = [v for v in console.watched.csp_violations if is_own(v, api)]
    assert own == [], f"the console's own assets break its CSP: {own}"
    assert console.watched.csp_violations == [], "hostile content reached the page as markup"
    csp_errors = [e for e in console.watched.console_errors if "Content Security Policy" in e]
    assert csp_errors == []
    # Every time shown is a wall-clock one (a monotonic reading shows as 1970).
    from_1970 = [path for path, text in texts.items() if "1970-01-01" in text]
    assert from_1970 == [], "a time from 1970: a monotonic reading shown as a date"
    # Answering was not confirmed: the request still waits.
    assert hostile.sidecar.get(f"/v1/approvals/{hostile.approval_id}")["status"] == "pending"


def is_own(violation: dict[str, Any], api: str) -> bool:
    """A violation by the console's own scripts (an eval, a style they inject).

    An inline script or handler is reported with the page as its source,
    whoever wrote it: the selectors of :func:`checked` tell template from span.
    """
    static = f"{api}/ui/static/"
    return any(str(violation.get(k) or "").startswith(static) for k in ("source", "blocked"))


def test_the_runs_page_refreshes_itself_and_what_it_swaps_in_stays_text(
    hostile: Hostile,
    console: Console,  # noqa: F811
) -> None:
    api = hostile.sidecar.api
    page = console.new_page()
    login(page, api, hostile.sidecar.token)
    # A run that begins while the page is open, named like markup with a slash in it.
    run = f"live {HOSTILE[3]}"
    send_hostile_spans(hostile.sidecar, run, statuses=(200,))
    row = page.locator("#runs tr[data-run-id]").filter(has_text=run)
    expect(row).to_have_count(1, timeout=15_000)  # htmx's refresh, every 5 s: no reload
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("#runs svg[onload], #runs [onload]").count() == 0
    assert console.watched.csp_violations == []
    assert console.watched.page_errors == []
    assert console.watched.dialogs == []

    with page.expect_navigation() as opened:
        row.locator("a.run-link").click()
    checked(page, opened.value, console)
    expect(page.locator("#run-title")).to_contain_text(run)


def test_a_form_on_another_site_cannot_answer_an_approval(
    hostile: Hostile,
    console: Console,  # noqa: F811
) -> None:
    """A logged-in person visits a page elsewhere that posts an answer to the console."""
    api = hostile.sidecar.api
    page = console.new_page()
    login(page, api, hostile.sidecar.token)
    target = f"{api}/ui/approvals/{hostile.approval_id}/answer"
    attack = f"""<!doctype html><form id="f" method="post" action="{target}">
      <input name="action" value="approve"><input name="note" value="forged">
    </form><script>document.getElementById('f').submit()</script>"""
    page.route(
        "http://elsewhere.example/**",
        lambda route: route.fulfill(status=200, content_type="text/html", body=attack),
    )
    with page.expect_navigation(url=re.compile(re.escape(api))) as landed:
        page.goto("http://elsewhere.example/prize")
    response = landed.value
    # The session cookie (SameSite=Strict) does not go with it: the console asks who it is.
    assert response is not None
    assert (response.status, page.url) == (200, f"{api}/ui/login") or response.status == 403
    # And nothing was answered.
    assert hostile.sidecar.get(f"/v1/approvals/{hostile.approval_id}")["status"] == "pending"


def test_a_dead_letter_is_redelivered_through_its_confirmation(
    hostile: Hostile,
    console: Console,  # noqa: F811
) -> None:
    sidecar, api = hostile.sidecar, hostile.sidecar.api
    letter = sidecar.get("/v1/dead-letters")["dead_letters"][0]
    page = console.new_page()
    login(page, api, sidecar.token)
    page.goto(f"{api}/ui/dead-letters")
    row = page.locator("#dead-letters tr").filter(has_text=letter["id"])
    row.locator('input[name="by"]').fill("on-call")
    with page.expect_navigation() as confirmation:
        row.get_by_role("button", name=re.compile("re-deliver", re.I)).click()
    checked(page, confirmation.value, console)  # it shows the command: hostile text
    expect(page.locator("#confirm-form")).to_be_visible()
    assert commands_by_id(sidecar)[letter["id"]]["redeliveries"] == 0

    page.click("#confirm-yes")
    page.wait_for_url(re.compile(rf"{re.escape(api)}/ui/dead-letters(\?.*)?$"))
    expect(page.locator("#flash")).to_contain_text(letter["id"])
    redelivered = commands_by_id(sidecar)[letter["id"]]
    assert (redelivered["redeliveries"], redelivered["redelivered_by"]) == (1, "on-call")


def commands_by_id(sidecar: SidecarProcess) -> dict[str, dict[str, Any]]:
    found = sidecar.get("/v1/commands/log", service=HOSTILE_SERVICE, limit=1000)["commands"]
    return {c["id"]: c for c in found}


# -- (c) the keyboard --------------------------------------------------------------------------

#: Most Tab presses to reach an element: a page with more before it has lost a keyboard user.
MAX_TABS = 40


def tab_to(page: Page, test: str, what: str) -> None:
    """Press Tab until ``test`` (a JS expression on ``el``, the focused element) holds."""
    for _ in range(MAX_TABS):
        page.keyboard.press("Tab")
        if page.evaluate(f"(() => {{ const el = document.activeElement; return !!({test}); }})()"):
            return
    raise AssertionError(f"{MAX_TABS} Tab presses never reached {what} on {page.url}")


def test_the_keyboard_alone_logs_in_and_reaches_the_approvals_page(
    hostile: Hostile,
    console: Console,  # noqa: F811
) -> None:
    api = hostile.sidecar.api
    page = console.new_page()
    page.goto(f"{api}/ui/login")
    tab_to(page, "el.id === 'token'", "the token field")
    page.keyboard.type(hostile.sidecar.token)
    page.keyboard.press("Enter")
    page.wait_for_url(f"{api}/ui/runs")

    tab_to(page, "el.tagName === 'A' && new URL(el.href).pathname === '/ui/approvals'", "the link")
    focus = page.evaluate(
        "(() => { const s = getComputedStyle(document.activeElement);"
        " return [s.outlineStyle, s.boxShadow]; })()"
    )
    assert focus != ["none", "none"], "the focused link shows no focus"
    page.keyboard.press("Enter")
    page.wait_for_url(f"{api}/ui/approvals")
    tab_to(
        page,
        "el.tagName === 'BUTTON' && el.value === 'approve'",
        "an approval's approve button",
    )


# -- (d) without JavaScript ------------------------------------------------------------------


def test_without_javascript_a_person_still_logs_in_and_answers(
    hostile: Hostile,
    console_without_js: Console,  # noqa: F811
) -> None:
    sidecar, api = hostile.sidecar, hostile.sidecar.api
    run = "no-js run"
    send_hostile_spans(sidecar, run, statuses=(401,))

    def pending() -> str | None:
        found = sidecar.get("/v1/approvals", status="pending")["approvals"]
        return next((a["id"] for a in found if a["run_id"] == run), None)

    approval_id = wait_until(pending, 20, "the approval of the run without JavaScript")
    page = console_without_js.new_page()
    login(page, api, sidecar.token)
    expect(page.locator("#runs tr[data-run-id]").filter(has_text=run)).to_have_count(1)
    page.locator("#nav").get_by_role("link", name=re.compile("approvals", re.I)).click()
    request = page.locator(f'article[data-approval-id="{approval_id}"]')
    request.locator('textarea[name="note"]').fill("denied without a script")
    request.locator('button[name="action"][value="deny"]').click()
    page.click("#confirm-yes")
    page.wait_for_url(re.compile(rf"{re.escape(api)}/ui/approvals(\?.*)?$"))
    expect(page.locator("#flash")).to_be_visible()
    answered = sidecar.get(f"/v1/approvals/{approval_id}")
    assert (answered["status"], answered["note"]) == ("denied", "denied without a script")
