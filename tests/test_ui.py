"""The operator console (/ui): logins, CSRF, security headers, escaping, approvals,
the incidents' chart, the breakers' history, and a dead letter re-delivered.

In process over a real :class:`~supervisor.api.control.Control` (an in-memory
store, a real governor and actor), through the control API's own app, so the
console is mounted as the sidecar mounts it; the escaping and the approval
round trip also run against a real sidecar in process (real sockets), its
failing span sent over OTLP/HTTP as an agent sends it. Pages are parsed with
:mod:`html.parser`, as a browser would build elements from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator, Mapping
from html.parser import HTMLParser
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.api.control import Control
from supervisor.api.server import build_control_app
from supervisor.app import BackgroundSidecar
from supervisor.forward.breaker_history import BreakerHistory
from supervisor.records import Action
from supervisor.runs import RunView
from supervisor.settings import AgentDelivery, PullChannel, load_settings
from supervisor.ui.app import HEADERS, ConsoleOptions
from supervisor.ui.sessions import Sessions
from supervisor.wiring import build_sidecar
from tests.postgres import fresh_schema
from tests.test_api import _outcome
from tests.test_cli_operator import _failures, _send
from tests.test_console_data import dead_letter_sidecar, failing_once
from tests.test_dispatch import WebhookReceiver

TOKEN = "t0k3n-for-the-console"
BASE = "https://testserver"  # the session cookie is Secure: a client sends it over HTTPS only
PAGES = [
    "/ui/runs",
    "/ui/runs/run-1",
    "/ui/approvals",
    "/ui/incidents",
    "/ui/breakers",
    "/ui/remediations",
    "/ui/dead-letters",
]
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
JS_URL = "javascript:alert(3)"


class Page(HTMLParser):
    """A page's elements (tag, attributes) and its text, as a browser would see them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.script_text: list[str] = []
        self._in: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        self._in.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if self._in and self._in[-1] == tag:
            self._in.pop()

    def handle_data(self, data: str) -> None:
        if self._in and self._in[-1] in ("script", "style"):
            self.script_text.append(data)
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a
            for t, a in self.elements
            if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def _no_inline_code(page: Page, where: str) -> None:
    for tag, attrs in page.elements:
        assert tag != "style", where
        assert "style" not in attrs, (where, tag, attrs)
        assert not [a for a in attrs if a.startswith("on")], (where, tag, attrs)
        if tag == "script":
            assert attrs.get("src", "").startswith("/ui/static/"), (where, attrs)
    assert not "".join(page.script_text).strip(), where


def _control(store: Store, history: BreakerHistory | None = None) -> Control:
    policy = load_policy(
        text="version: 1\npolicies:\n  - {name: esc, match: {kind: auth}, action: escalate}\n"
    )
    actor = Actor(store, {"agent": AgentDelivery(pull=PullChannel(visibility_s=30))})
    return Control(
        store=store,
        actor=actor,
        governor=Governor(policy, on_breaker_change=history),
        policy=lambda: policy,
        failures=RecentFailures(100),
        stats=dict,
        ready=lambda: True,
        reload=dict,
        breaker_history=history,
    )


@pytest.fixture
def control() -> Control:
    return _control(Store.open(":memory:"))


@pytest.fixture
def client(control: Control) -> TestClient:
    app = build_control_app(token=TOKEN, control=control, console=ConsoleOptions())
    return TestClient(app, base_url=BASE, follow_redirects=False)


def _login(client: TestClient) -> str:
    """Log in; the session's CSRF token (read from a page's logout form)."""
    answer = client.post("/ui/login", data={"token": TOKEN})
    assert (answer.status_code, answer.headers["location"]) == (303, "/ui/runs")
    page = Page(client.get("/ui/runs").text)
    [csrf] = [a["value"] for t, a in page.elements if t == "input" and a.get("name") == "csrf"]
    return csrf


def test_pages_lead_to_the_login_page_until_logged_in(client: TestClient) -> None:
    assert client.get("/ui").headers["location"] == "/ui/runs"
    for path in PAGES:
        answer = client.get(path)
        assert (answer.status_code, answer.headers["location"]) == (303, "/ui/login"), path
    login = Page(client.get("/ui/login").text)
    assert login.find("input", name="token", id="token", type="password")
    assert login.find("button", id="login")


def test_a_wrong_token_is_refused_and_the_right_one_opens_a_session(client: TestClient) -> None:
    wrong = client.post("/ui/login", data={"token": "not-it"})
    assert wrong.status_code == 401
    assert "not this sidecar" in Page(wrong.text).all_text
    assert "set-cookie" not in wrong.headers

    right = client.post("/ui/login", data={"token": TOKEN})
    cookie = right.headers["set-cookie"]
    name_value, *flags = [part.strip() for part in cookie.split(";")]
    name, value = name_value.split("=", 1)
    assert name == "spanvisor_session" and TOKEN not in value and len(value) >= 32
    lowered = {f.lower() for f in flags}
    assert {"httponly", "secure", "path=/ui", "samesite=strict"} <= lowered, cookie
    assert client.get("/ui/runs").status_code == 200


def test_the_bearer_token_works_without_a_session(control: Control) -> None:
    app = build_control_app(token=TOKEN, control=control, console=ConsoleOptions())
    bare = TestClient(app, base_url=BASE, follow_redirects=False)
    for path in PAGES:
        answer = bare.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, path
    refused = bare.get("/ui/runs", headers={"Authorization": "Bearer nope"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")


def test_every_post_needs_its_sessions_csrf_token(client: TestClient, control: Control) -> None:
    control.actor.record([_outcome(Action.ESCALATE)])
    [pending] = control.store.approvals(status="pending")
    csrf = _login(client)
    for path, fields in [
        (f"/ui/approvals/{pending.id}/confirm", {"action": "approve"}),
        (f"/ui/approvals/{pending.id}/answer", {"action": "approve"}),
        ("/ui/logout", {}),
    ]:
        for given in ({}, {"csrf": "forged"}, {"csrf": ""}):
            answer = client.post(path, data={**fields, **given})
            assert answer.status_code == 403, (path, given)
    assert control.store.approval(pending.id).status == "pending"  # type: ignore[union-attr]
    out = client.post("/ui/logout", data={"csrf": csrf})
    assert (out.status_code, out.headers["location"]) == (303, "/ui/login")
    assert client.get("/ui/runs").status_code == 303  # the session is gone


def test_every_answer_carries_the_security_headers_and_no_inline_code(
    client: TestClient, control: Control
) -> None:
    control.actor.record([_outcome(Action.ESCALATE)])
    anonymous = [client.get(p) for p in ("/ui", "/ui/runs", "/ui/login", "/ui/nope")]
    anonymous.append(client.post("/ui/login", data={"token": "x"}))
    _login(client)
    answers = [*anonymous, *(client.get(p) for p in PAGES)]
    answers += [client.get("/ui/static/console.css"), client.get("/ui/static/htmx.min.js")]
    answers.append(client.get("/ui/remediations/rem_00"))  # an error page (409: none running)
    for answer in answers:
        where = f"{answer.request.method} {answer.request.url.path} {answer.status_code}"
        for header, value in HEADERS.items():
            assert answer.headers.get(header) == value, (where, header)
        if answer.headers.get("content-type", "").startswith("text/html"):
            page = Page(answer.text)
            _no_inline_code(page, where)
            assert page.find("meta", name="viewport"), where
    nav = Page(client.get("/ui/runs").text)
    assert nav.find("nav", id="nav")
    links = {a.get("href") for t, a in nav.elements if t == "a"}
    assert {p for p in PAGES if p != "/ui/runs/run-1"} <= links


def test_approving_takes_two_steps_and_answers_once(client: TestClient, control: Control) -> None:
    control.actor.record([_outcome(Action.ESCALATE)])
    [pending] = control.store.approvals(status="pending")
    csrf = _login(client)
    page = Page(client.get("/ui/approvals").text)
    assert page.find("article", data_approval_id=pending.id)
    assert page.find("button", name="action", value="approve")
    assert page.find("button", name="action", value="deny")
    assert page.find("textarea", name="note")

    confirm = client.post(
        f"/ui/approvals/{pending.id}/confirm",
        data={"csrf": csrf, "action": "approve", "note": "go ahead", "by": "ops"},
    )
    assert confirm.status_code == 200
    asked = Page(confirm.text)
    [form] = asked.find("form", id="confirm-form")
    assert form["action"] == f"/ui/approvals/{pending.id}/answer"
    assert asked.find("button", id="confirm-yes")
    assert control.store.approval(pending.id).status == "pending"  # type: ignore[union-attr]
    sent = {
        a["name"]: a.get("value", "")
        for t, a in asked.elements
        if t == "input" and a.get("type") == "hidden"
    }

    answered = client.post(form["action"], data=sent)
    assert (answered.status_code, answered.headers["location"]) == (
        303,
        f"/ui/approvals?answered={pending.id}",
    )
    done = control.store.approval(pending.id)
    assert done is not None
    assert (done.status, done.answered_by, done.note) == ("approved", "ops", "go ahead")
    flash = Page(client.get(answered.headers["location"]).text)
    assert flash.find("p", id="flash")
    assert f"{pending.id} is approved by ops" in flash.all_text

    again = client.post(form["action"], data={**sent, "action": "deny"})
    assert again.status_code == 409
    assert "already answered" in Page(again.text).all_text
    stale = client.post(f"/ui/approvals/{pending.id}/confirm", data=sent)
    assert stale.status_code == 409 and "already approved" in Page(stale.text).all_text
    results = [c for c in control.store.commands() if c.command.type.value == "approval_result"]
    assert [c.command.params["approved"] for c in results] == [True]


class _Runs:
    """Runs listed as the tracker lists them, over fixed views."""

    def __init__(self, views: list[RunView]) -> None:
        self.views = sorted(views, key=lambda v: v.last_seen_at, reverse=True)

    def snapshot(
        self,
        limit: int = 100,
        now: float | None = None,
        *,
        before: tuple[float, str] | None = None,
        service: str | None = None,
        status: str | None = None,
    ) -> list[RunView]:
        found = [
            v
            for v in self.views
            if (service is None or v.service == service) and (status is None or v.status == status)
        ]
        return found[:limit]

    def stats(self) -> dict[str, int]:
        return {"tracked": len(self.views)}

    def find(self, run_id: str) -> RunView | None:
        return next((v for v in self.views if v.run_id == run_id), None)


def _run(run_id: str, service: str, status: str, step: str, at: float) -> RunView:
    return RunView(
        run_id=run_id,
        service=service,
        status=status,
        started_at=at - 60,
        last_seen_at=at,
        idle_s=5.0,
        spans=10,
        llm_calls=3,
        tool_calls=4,
        errors=1 if status == "failing" else 0,
        input_tokens=100,
        output_tokens=20,
        step=step,
        spans_per_minute=10.0,
        cost_usd=0.0123,
    )


def test_runs_are_filtered_by_status_service_and_text(control: Control) -> None:
    control.runs = _Runs(
        [
            _run("sess-a", "checkout", "running", "chat gpt-4o", 1_000.0),
            _run("sess-b", "checkout", "failing", "execute_tool search", 1_010.0),
            _run("sess-c", "billing", "stalled", "execute_tool refund", 1_020.0),
        ]
    )
    app = build_control_app(token=TOKEN, control=control, console=ConsoleOptions())
    client = TestClient(app, base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"})

    def listed(query: str) -> list[str]:
        page = Page(client.get(f"/ui/runs{query}").text)
        assert page.find("form", id="run-filters") and page.find("table", id="runs")
        return [a["data-run-id"] for t, a in page.elements if t == "tr" and "data-run-id" in a]

    assert listed("") == ["sess-c", "sess-b", "sess-a"]
    assert listed("?status=failing") == ["sess-b"]
    assert listed("?service=checkout") == ["sess-b", "sess-a"]
    assert listed("?text=TOOL") == ["sess-c", "sess-b"]
    assert listed("?service=checkout&text=search") == ["sess-b"]
    bad = client.get("/ui/runs?status=nonsense")
    assert bad.status_code == 400 and "status must be one of" in Page(bad.text).all_text
    run = Page(client.get("/ui/runs/sess-b").text)
    assert run.find("h1", id="run-title") and run.find("ol", id="timeline")
    assert [a["data-kind"] for t, a in run.elements if t == "li" and "data-kind" in a] == [
        "span",
        "span",
    ]
    assert not run.find("a", id="trace-link")  # no ui_trace_url


@pytest.mark.parametrize("where", ["sqlite", "postgresql"])
def test_a_runs_timeline_holds_its_failures_decisions_commands_and_approvals(
    where: str,
) -> None:
    with contextlib.ExitStack() as stack:
        target = ":memory:" if where == "sqlite" else stack.enter_context(fresh_schema())
        store = Store.open(target)
        stack.callback(store.close)
        control = _control(store)
        control.actor.record([_outcome(Action.ESCALATE)])
        [pending] = store.approvals(status="pending")
        control.actor.answer(pending.id, approved=True, by="ops", note="")
        app = build_control_app(token=TOKEN, control=control, console=ConsoleOptions())
        client = TestClient(app, base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"})

        run = Page(client.get("/ui/runs/run-1").text)

    kinds = [a["data-kind"] for t, a in run.elements if t == "li" and "data-kind" in a]
    # No tracker here: no spans; the failure comes from its stored incident.
    assert sorted(kinds) == ["approval", "command", "command", "decision", "failure"]
    assert "does not track this run" in run.all_text
    assert "approval_result" in run.all_text and "pause_run" in run.all_text


def test_a_timeline_says_once_why_it_shows_no_remediations() -> None:
    app_control = _control(Store.open(":memory:"))
    app_control.actor.record(
        [_outcome(Action.REMEDIATE, span=f"00000000000000c{n}", kind="auth") for n in range(3)]
    )
    app = build_control_app(token=TOKEN, control=app_control, console=ConsoleOptions())
    bearer = TestClient(app, base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"})

    page = Page(bearer.get("/ui/runs/run-1").text)

    notes = [n for n in page.text if "Remediations are not shown" in n]
    assert notes == ["Remediations are not shown: remediations are not running on this sidecar"]
    kinds = [a["data-kind"] for t, a in page.elements if t == "li" and "data-kind" in a]
    assert kinds.count("decision") == 3 and "remediation" not in kinds


def test_sessions_expire_and_are_bounded() -> None:
    now = [1_000.0]
    sessions = Sessions(60.0, max_sessions=2, clock=lambda: now[0])
    first, second = sessions.open(), sessions.open()
    third = sessions.open()
    assert sessions.get(first.id) is None and sessions.get(second.id) == second
    now[0] += 61
    assert sessions.get(third.id) is None and sessions.get(None) is None


def test_the_console_is_absent_unless_enabled(control: Control) -> None:
    app = build_control_app(token=TOKEN, control=control)
    plain = TestClient(app, base_url=BASE, follow_redirects=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert plain.get("/ui", headers=auth).status_code == 404
    assert plain.get("/ui/runs", headers=auth).status_code == 404
    assert "/ui" not in str(plain.get("/openapi.json").json()["paths"])


# -- a real sidecar: a span's hostile text on every page, and the approval's command ------


def _hostile_failure() -> bytes:
    span = Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"),
        name=f"chat {IMG}",
        attributes=[
            KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat")),
            KeyValue(key="gen_ai.system", value=AnyValue(string_value="openai")),
            KeyValue(key="gen_ai.request.model", value=AnyValue(string_value=JS_URL)),
            KeyValue(key="session.id", value=AnyValue(string_value=SCRIPT)),
            KeyValue(key="error.type", value=AnyValue(string_value="AuthenticationError")),
        ],
        status=Status(
            code=Status.STATUS_CODE_ERROR,
            message=f"Error code: 401 {SCRIPT} {IMG} see {JS_URL}",
        ),
    )
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value=f"agent{SCRIPT}"))
    )
    resource.scope_spans.add().spans.append(span)
    return request.SerializeToString()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[BackgroundSidecar, str]]:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "version: 1\npolicies:\n  - {name: ask, match: {kind: auth}, action: escalate}\n"
    )
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": TOKEN,
            "policy": str(policy_file),
            "state_path": str(tmp_path / "state.db"),
            "ui_trace_url": "http://localhost:16686/trace/{trace_id}",
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy(policy_file)))
    ports = background.start()
    try:
        yield background, f"http://127.0.0.1:{ports.api}"
    finally:
        background.stop()


def _until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_span_text_is_shown_as_text_never_as_markup_or_links(
    sidecar: tuple[BackgroundSidecar, str],
) -> None:
    background, api = sidecar
    sent = httpx.post(
        f"http://127.0.0.1:{background.ports.otlp_http}/v1/traces",
        content=_hostile_failure(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert sent.status_code == 200
    store = background.sidecar.store
    _until(lambda: store.approvals(status="pending"))
    with httpx.Client(base_url=api, follow_redirects=False) as browser:
        login = browser.post("/ui/login", data={"token": TOKEN})
        session = re.match(r"spanvisor_session=([^;]+)", login.headers["set-cookie"])
        assert session is not None
        cookie = {"Cookie": f"spanvisor_session={session.group(1)}"}
        runs = Page(browser.get("/ui/runs", headers=cookie).text)
        assert len(runs.find("tr", data_run_id=SCRIPT)) == 1
        [link] = [a for t, a in runs.elements if t == "a" and "run-link" in a.get("class", "")]
        assert link["href"] == "/ui/runs/" + quote(SCRIPT, safe="")
        pages = {"/ui/runs": runs}
        for path in (link["href"], "/ui/approvals", "/ui/incidents", "/ui/dead-letters"):
            answer = browser.get(path, headers=cookie)
            assert answer.status_code == 200, path
            pages[path] = Page(answer.text)
    run = pages[link["href"]]
    assert run.find("h1", id="run-title")
    assert SCRIPT in run.all_text and IMG in run.all_text and JS_URL in run.all_text
    kinds = [a["data-kind"] for t, a in run.elements if t == "li" and "data-kind" in a]
    assert {"span", "failure", "decision", "approval"} <= set(kinds)
    [trace] = run.find("a", id="trace-link")
    assert trace["href"] == "http://localhost:16686/trace/0af7651916cd43dd8448eb211c80319c"
    for path, page in pages.items():
        _no_inline_code(page, path)
        assert not page.find("img"), path
        hrefs = [a.get("href", "") for t, a in page.elements if t == "a"]
        assert not [h for h in hrefs if "javascript" in h.lower()], (path, hrefs)
        assert SCRIPT in page.all_text or path == "/ui/dead-letters", path


def test_a_console_answer_sends_the_agent_its_approval_result(
    sidecar: tuple[BackgroundSidecar, str],
) -> None:
    background, api = sidecar
    httpx.post(
        f"http://127.0.0.1:{background.ports.otlp_http}/v1/traces",
        content=_hostile_failure(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    store = background.sidecar.store
    _until(lambda: store.approvals(status="pending"))
    [pending] = store.approvals(status="pending")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=api, follow_redirects=False, headers=bearer) as client:
        confirm = client.post(f"/ui/approvals/{pending.id}/confirm", data={"action": "deny"})
        assert confirm.status_code == 200 and Page(confirm.text).find("form", id="confirm-form")
        done = client.post(f"/ui/approvals/{pending.id}/answer", data={"action": "deny"})
        assert done.status_code == 303
        again = client.post(f"/ui/approvals/{pending.id}/answer", data={"action": "deny"})
        assert again.status_code == 409
        log = client.get("/v1/commands/log").json()["commands"]
    [result] = [c for c in log if c["type"] == "approval_result"]
    assert (result["params"]["approved"], result["params"]["answered_by"]) == (False, "ui")


def test_a_sidecar_serves_no_console_when_it_is_turned_off(tmp_path: Path) -> None:
    settings = load_settings(
        overrides={
            "otlp_grpc_port": 0,
            "otlp_http_port": 0,
            "api_port": 0,
            "api_token": TOKEN,
            "state_path": str(tmp_path / "state.db"),
            "ui_enabled": False,
        }
    )
    background = BackgroundSidecar(build_sidecar(settings, load_policy()))
    ports = background.start()
    try:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        for path in ("/ui", "/ui/runs", "/ui/login"):
            answer = httpx.get(f"http://127.0.0.1:{ports.api}{path}", headers=bearer)
            assert answer.status_code == 404, path
    finally:
        background.stop()


# -- the incidents' chart, the breakers' history --------------------------------------------


def _bearer(control: Control) -> TestClient:
    app = build_control_app(token=TOKEN, control=control, console=ConsoleOptions())
    return TestClient(
        app, base_url=BASE, follow_redirects=False, headers={"Authorization": f"Bearer {TOKEN}"}
    )


class _Answer(Protocol):
    """A page as httpx or the test client answers it."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def text(self) -> str: ...


def _secure(answer: _Answer, where: str) -> Page:
    """The page, once its security headers are checked and it has no inline code."""
    for header, value in HEADERS.items():
        assert answer.headers.get(header) == value, (where, header)
    page = Page(answer.text)
    _no_inline_code(page, where)
    assert not page.find("img"), where
    return page


def test_the_incidents_page_charts_the_stored_incidents_by_class_and_kind(
    control: Control,
) -> None:
    control.actor.record([_outcome(Action.ESCALATE, span=f"00000000000000a{n}") for n in range(3)])
    hostile = [_outcome(Action.ESCALATE, span=f"00000000000000c{n}", kind=IMG) for n in range(2)]
    control.actor.record(hostile)
    with control.store.transaction() as db:  # a class no classifier makes: markup
        db.execute(
            "UPDATE incidents SET body = json_set(body, '$.class', ?)"
            " WHERE json_extract(body, '$.kind') = ?",
            (SCRIPT, IMG),
        )
    client = _bearer(control)

    for query, words in [("", "last 24 h"), ("?window=6h", "last 6 h"), ("?window=7d", "last 7 d")]:
        answer = client.get(f"/ui/incidents{query}")
        assert answer.status_code == 200, query
        page = _secure(answer, query)
        [svg] = page.find("svg", id="incidents-chart")
        assert svg["role"] == "img" and "5 incidents" in svg["aria-label"]
        assert len([a for t, a in page.elements if t == "tr" and "data-incident" in a]) == 5
        [summary] = [t for t in page.text if t.startswith("5 incidents in the ")]
        assert summary == f"5 incidents in the {words}, by class: permanent 3, {SCRIPT} 2.", query
        assert f"{SCRIPT} / {IMG} (2)" in page.all_text  # the legend, as text
        assert "permanent / auth (3)" in page.all_text
        [current] = [a for t, a in page.elements if t == "a" and a.get("aria-current") == "true"]
        assert current["href"] == "/ui/incidents?window=" + (query[8:] or "24h")
        assert page.find("table", id="incidents")
    links = [a["href"] for t, a in page.elements if t == "a" and "window=" in a.get("href", "")]
    assert links == [
        "/ui/incidents?window=6h",
        "/ui/incidents?window=24h",
        "/ui/incidents?window=7d",
    ]
    bad = client.get("/ui/incidents?window=1y")
    assert bad.status_code == 400 and "window must be one of" in Page(bad.text).all_text


def test_incident_counts_run_off_the_loop_and_are_kept_a_few_seconds(control: Control) -> None:
    loop_thread = threading.get_ident()
    ran_in = asyncio.run(control.store.call_in_thread(threading.get_ident))
    assert ran_in != loop_thread
    control.actor.record([_outcome(Action.ESCALATE)])
    client = _bearer(control)
    for _ in range(3):
        assert client.get("/ui/incidents").status_code == 200
    assert control.recent_counts.reads == 1  # one count for three refreshes
    client.get("/ui/incidents?window=6h")
    assert control.recent_counts.reads == 2  # another window, another count


def test_the_breakers_page_shows_each_breakers_strip_and_its_changes() -> None:
    history = BreakerHistory()
    control = _control(Store.open(":memory:"), history)
    for _ in range(10):
        control.governor.observe("tool:search", ok=False)
    control.governor.observe(f"tool:{SCRIPT}", ok=False)  # one failure: still closed
    assert control.breaker("tool:search")["state"] == "open"

    answer = _bearer(control).get("/ui/breakers")

    page = _secure(answer, "/ui/breakers")
    assert page.find("tr", data_dependency="tool:search")
    assert page.find("tr", data_dependency=f"tool:{SCRIPT}")
    strips = [a for t, a in page.elements if t == "svg" and a.get("role") == "img"]
    assert len(strips) == 2
    assert any("open now; 1 changes seen" in s["aria-label"] for s in strips)
    changes = ["".join(t).strip() for t in _items(answer.text, "transitions")]
    assert len(changes) == 1 and re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: closed → open \(.+\)", changes[0]
    ), changes
    assert "No change seen here in the last 6 hours." in page.all_text  # the quiet one


def _items(html: str, list_class: str) -> list[list[str]]:
    """The text of each ``<li>`` of the lists of class ``list_class``."""

    class Items(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.found: list[list[str]] = []
            self.depth = 0
            self.inside = False

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "ol" and list_class in (dict(attrs).get("class") or "").split():
                self.inside = True
            elif tag == "li" and self.inside:
                self.found.append([])

        def handle_endtag(self, tag: str) -> None:
            if tag == "ol":
                self.inside = False

        def handle_data(self, data: str) -> None:
            if self.inside and self.found:
                self.found[-1].append(data)

    parser = Items()
    parser.feed(html)
    return parser.found


# -- a dead letter re-delivered from the console, to a real webhook receiver -------------------


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with failing_once() as running:
        yield running


@pytest.fixture
def webhook_sidecar(tmp_path: Path, receiver: WebhookReceiver) -> Iterator[BackgroundSidecar]:
    with dead_letter_sidecar(tmp_path, receiver, TOKEN) as running:
        yield running


def test_a_dead_letter_is_redelivered_in_two_steps_and_sent_again(
    webhook_sidecar: BackgroundSidecar, receiver: WebhookReceiver
) -> None:
    store = webhook_sidecar.sidecar.store
    _send(webhook_sidecar, _failures(1))  # an escalation pauses the run: a command by webhook
    _until(lambda: store.commands(status="dead"))
    [dead] = store.commands(status="dead")
    command_id = dead.command.id
    api = f"http://127.0.0.1:{webhook_sidecar.ports.api}"
    with httpx.Client(base_url=api, follow_redirects=False) as browser:
        login = browser.post("/ui/login", data={"token": TOKEN})
        session = re.match(r"spanvisor_session=([^;]+)", login.headers["set-cookie"])
        assert session is not None
        browser.headers["Cookie"] = f"spanvisor_session={session.group(1)}"
        listed = _secure(browser.get("/ui/dead-letters"), "/ui/dead-letters")
        assert listed.find("tr", data_command_id=command_id)
        [form] = listed.find("form", action=f"/ui/dead-letters/{command_id}/confirm")
        [csrf] = [
            a["value"] for t, a in listed.elements if t == "input" and a.get("name") == "csrf"
        ][:1]
        confirm_path = form["action"]

        for given in ({}, {"csrf": "forged"}):
            assert browser.post(confirm_path, data={"by": "ops", **given}).status_code == 403
        confirm = browser.post(confirm_path, data={"csrf": csrf, "by": "ops"})
        assert confirm.status_code == 200
        asked = _secure(confirm, confirm_path)
        [yes_form] = asked.find("form", id="confirm-form")
        assert yes_form["action"] == f"/ui/dead-letters/{command_id}/redeliver"
        assert asked.find("button", id="confirm-yes")
        for fact in ("pause_run", "agent", "500 Internal Server Error: not now", "ops"):
            assert fact in asked.all_text, fact
        [attempts] = [n for n, t in enumerate(asked.text) if t == "Attempts"]
        assert asked.text[attempts + 1] == "1"
        sent = {
            a["name"]: a.get("value", "")
            for t, a in asked.elements
            if t == "input" and a.get("type") == "hidden"
        }
        assert store.command(command_id).status == "dead"  # type: ignore[union-attr]

        refused = browser.post(yes_form["action"], data={"by": "ops"})
        assert refused.status_code == 403
        assert store.command(command_id).status == "dead"  # type: ignore[union-attr]
        done = browser.post(yes_form["action"], data=sent)
        assert (done.status_code, done.headers["location"]) == (
            303,
            f"/ui/dead-letters?redelivered={command_id}",
        )
        _until(lambda: len(receiver.acknowledged()) == 1)
        assert receiver.keys() == [dead.command.idempotency_key] * 2
        _until(lambda: (store.command(command_id) or dead).status == "delivered")
        flash = _secure(browser.get(done.headers["location"]), "flash")
        [said] = flash.find("p", id="flash")
        assert said and f"Command {command_id} is delivered again, re-delivered by ops." in (
            flash.all_text
        )
        assert not flash.find("tr", data_command_id=command_id)

        again = browser.post(yes_form["action"], data=sent)
        assert again.status_code == 409 and "not a dead letter" in Page(again.text).all_text
        stale = browser.post(confirm_path, data=sent)
        assert stale.status_code == 409 and "not a dead letter" in Page(stale.text).all_text
        unknown = browser.post("/ui/dead-letters/cmd_nope/confirm", data=sent)
        assert unknown.status_code == 404
        _secure(unknown, "404")
        forged = Page(browser.get("/ui/dead-letters?redelivered=cmd_nope").text)
        assert not forged.find("p", id="flash")
    [record] = [c for c in store.commands() if c.command.id == command_id]
    assert (record.redelivered_by, record.redeliveries) == ("ops", 1)
