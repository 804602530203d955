"""The control API in process: tokens, input checks, and each route over real parts.

The app runs over a real :class:`~supervisor.api.control.Control` (an in-memory
store, the built-in policy, a real governor), so a route answers what the
sidecar would.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.api.control import Control
from supervisor.api.server import build_control_app, ensure_token
from supervisor.judge.pipeline import Outcome
from supervisor.records import Action, Decision, ErrorEvidence, Failure, FailureClass, Role
from supervisor.settings import AgentDelivery, PullChannel

AUTH = {"Authorization": "Bearer t0k3n"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class _Listed:
    """Recent failures as a plain list (what the route shows of them is the point here)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def page(
        self, limit: int, before: int | None = None
    ) -> tuple[list[dict[str, Any]], int | None]:
        end = len(self.items) if before is None else before
        start = max(0, end - limit)
        return self.items[start:end], start or None


@pytest.fixture
def parts() -> tuple[TestClient, Actor, Governor]:
    store = Store.open(":memory:")
    policy = load_policy(
        text="version: 1\n"
        "policies:\n"
        "  - {name: fb, match: {kind: unavailable}, action: fallback,\n"
        '     chain: {"openai:*": ["openai:gpt-4o", "openai:gpt-4o-mini"]}}\n'
        "  - {name: esc, match: {kind: auth}, action: escalate}\n"
    )
    governor = Governor(policy)
    actor = Actor(store, {"agent": AgentDelivery(pull=PullChannel(visibility_s=30))})
    items: list[dict[str, Any]] = [{"n": i} for i in range(5)]
    control = Control(
        store=store,
        actor=actor,
        governor=governor,
        policy=lambda: policy,
        failures=_Listed(items),
        stats=lambda: {"pipeline": {"processed_spans": 7}},
        ready=lambda: True,
        reload=lambda: {"reloaded": False, "source": "<string>", "error": "no file"},
    )
    return TestClient(build_control_app(token="t0k3n", control=control)), actor, governor


def _outcome(action: Action, *, span: str = "00000000000000b1", kind: str = "auth") -> Outcome:
    failure = Failure(
        trace_id="a" * 32,
        span_id=span,
        parent_span_id="",
        service="agent",
        span_name="chat gpt-4o",
        run_id="run-1",
        role=Role.LLM,
        failure_class=FailureClass.PERMANENT,
        kind=kind,
        dependency="openai:gpt-4o",
        rule="builtin.provider.auth",
        message="Incorrect API key provided; $(touch /tmp/x) `id`",
        evidence=ErrorEvidence(status_error=True, http_status=401),
        received_ns=1,
    )
    return Outcome(failure, Decision(action=action, policy="esc", reason="permanent/auth"))


def test_generated_token_is_written_for_the_user_only(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "token"

    token = ensure_token(None, path)

    assert len(token) >= 32
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_configured_token_is_used_and_nothing_is_written(tmp_path: Path) -> None:
    assert ensure_token("given", tmp_path / "token") == "given"
    assert not (tmp_path / "token").exists()


def test_routes_need_the_bearer_token(parts: tuple[TestClient, Actor, Governor]) -> None:
    client, _, _ = parts

    for method, path in [
        ("GET", "/v1/stats"),
        ("GET", "/v1/threads"),
        ("GET", "/v1/incidents"),
        ("GET", "/v1/approvals"),
        ("POST", "/v1/approvals/x/approve"),
        ("GET", "/v1/breakers"),
        ("POST", "/v1/breakers/openai:gpt-4o/isolate"),
        ("POST", "/v1/decide"),
        ("POST", "/v1/policy/reload"),
        ("GET", "/v1/commands?service=agent"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "t0k3n"}):
            answer = client.request(method, path, headers=headers)
            assert (answer.status_code, answer.json()) == (
                401,
                {"error": "missing or wrong bearer token"},
            ), (method, path, headers)
    ok = client.get("/v1/stats", headers=AUTH)
    assert (ok.status_code, ok.json()) == (200, {"pipeline": {"processed_spans": 7}})
    assert client.get("/healthz").json() == {"status": "ok"}
    described = client.get("/openapi.json").json()
    assert {"/v1/decide", "/v1/approvals/{approval_id}/approve", "/v1/commands"} <= set(
        described["paths"]
    )


def test_liveness_stays_up_and_readiness_says_degraded_while_the_store_fails() -> None:
    store = Store.open(":memory:")
    reasons: list[str] = []
    control = Control(
        store=store,
        actor=Actor(store, {}),
        governor=Governor(load_policy()),
        policy=load_policy,
        failures=RecentFailures(10),
        stats=dict,
        ready=lambda: True,
        reload=dict,
        degraded=lambda: list(reasons),
    )
    client = TestClient(build_control_app(token="t0k3n", control=control))
    assert client.get("/readyz").json() == {"status": "ok"}
    reasons.append("store failing since 2026-12-05T21:00:00Z (OperationalError: full)")
    live, ready = client.get("/healthz"), client.get("/readyz")
    assert (live.status_code, live.json()["status"]) == (200, "degraded")
    assert (ready.status_code, ready.json()) == (503, {"status": "degraded", "degraded": reasons})


def test_inputs_are_checked_with_clear_errors(parts: tuple[TestClient, Actor, Governor]) -> None:
    client, _, _ = parts

    assert client.get("/v1/failures?limit=2", headers=AUTH).json()["failures"] == [
        {"n": 3},
        {"n": 4},
    ]
    for bad in ("/v1/failures?limit=abc", "/v1/failures?limit=0", "/v1/incidents?limit=5000"):
        answer = client.get(bad, headers=AUTH)
        assert answer.status_code == 400 and "limit" in answer.json()["error"], bad
    answer = client.post("/v1/decide", headers=AUTH, json={"message": "x"})
    assert answer.status_code == 400 and "dependency" in answer.json()["error"]
    # An agent's question is read liberally: a field the sidecar does not know is
    # ignored; a known field of the wrong type is still refused, saying which.
    answer = client.post("/v1/decide", headers=AUTH, json={"dependency": "x", "oops": 1})
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/decide", headers=AUTH, json={"dependency": "x", "attempt": "many"})
    assert answer.status_code == 400 and "attempt" in answer.json()["error"]
    answer = client.get("/v1/commands?service=ghost", headers=AUTH)
    assert answer.status_code == 404 and "pull" in answer.json()["error"]


def test_decide_answers_with_delay_and_breaker(parts: tuple[TestClient, Actor, Governor]) -> None:
    client, _, governor = parts
    question = {
        "dependency": "openai:gpt-4o",
        "exception_type": "openai.RateLimitError",
        "message": "Rate limit reached for gpt-4o. Please try again in 1.5s.",
        "status_code": 429,
        "attempt": 1,
    }

    answer = client.post("/v1/decide", headers=AUTH, json=question).json()

    assert (answer["action"], answer["delay_s"], answer["kind"]) == ("retry", 1.5, "rate_limit")
    assert answer["breaker"] == {"dependency": "openai:gpt-4o", "state": "closed"}
    client.post("/v1/breakers/openai:gpt-4o/isolate", headers=AUTH)
    answer = client.post("/v1/decide", headers=AUTH, json=question).json()
    assert (answer["action"], answer["fallback_to"]) == ("fallback", "openai:gpt-4o-mini")
    assert answer["breaker"]["state"] == "isolated"
    assert governor.breaker_state("openai:gpt-4o").value == "isolated"


def test_breakers_isolate_and_close_by_hand(parts: tuple[TestClient, Actor, Governor]) -> None:
    client, _, _ = parts

    assert client.get("/v1/breakers/tool:search", headers=AUTH).json()["state"] == "closed"
    isolated = client.post("/v1/breakers/http:api.example.com/isolate", headers=AUTH).json()
    assert isolated["state"] == "isolated"
    listed = client.get("/v1/breakers", headers=AUTH).json()["breakers"]
    assert [(b["dependency"], b["state"]) for b in listed] == [("http:api.example.com", "isolated")]
    closed = client.post("/v1/breakers/http:api.example.com/close", headers=AUTH).json()
    assert closed["state"] == "closed"


def test_escalation_is_approved_once_and_the_agent_gets_the_result(
    parts: tuple[TestClient, Actor, Governor],
) -> None:
    client, actor, _ = parts
    actor.record([_outcome(Action.ESCALATE)])

    [pending] = client.get("/v1/approvals?status=pending", headers=AUTH).json()["approvals"]
    assert pending["what"]["kind"] == "auth" and pending["where"]["run_id"] == "run-1"
    assert "approve" in pending["on_approve"] or "approval_result" in pending["on_approve"]
    [paused] = client.get("/v1/commands?service=agent", headers=AUTH).json()["commands"]
    assert paused["type"] == "pause_run"
    assert "$(touch /tmp/x) `id`" in paused["failure"]["message"]  # data, kept verbatim

    approved = client.post(
        f"/v1/approvals/{pending['id']}/approve", headers=AUTH, json={"by": "ops", "note": "ok"}
    )
    assert (approved.status_code, approved.json()["status"]) == (200, "approved")
    again = client.post(f"/v1/approvals/{pending['id']}/deny", headers=AUTH)
    assert again.status_code == 409 and "already answered" in again.json()["error"]
    unknown = client.post("/v1/approvals/apr_nope/approve", headers=AUTH)
    assert unknown.status_code == 404

    [result] = client.get("/v1/commands?service=agent", headers=AUTH).json()["commands"]
    assert (result["type"], result["params"]["approved"]) == ("approval_result", True)
    ack = client.post(f"/v1/commands/{result['id']}/ack", headers=AUTH, json={"service": "agent"})
    assert ack.json() == {"id": result["id"], "status": "delivered"}
    twice = client.post(f"/v1/commands/{result['id']}/ack", headers=AUTH, json={"service": "agent"})
    assert twice.status_code == 409


def test_the_same_span_recorded_twice_makes_one_command(
    parts: tuple[TestClient, Actor, Governor],
) -> None:
    client, actor, _ = parts

    actor.record([_outcome(Action.ESCALATE)])
    actor.record([_outcome(Action.ESCALATE)])

    assert len(client.get("/v1/incidents", headers=AUTH).json()["incidents"]) == 1
    assert len(client.get("/v1/commands/log", headers=AUTH).json()["commands"]) == 1
    assert actor.store.duplicates == 1


def test_threads_lists_each_threads_cpu_time(parts: tuple[TestClient, Actor, Governor]) -> None:
    client, _, _ = parts
    answer = client.get("/v1/threads", headers=AUTH)
    assert answer.status_code == 200
    body = answer.json()
    assert set(body) == {"supported", "process_cpu_s", "listed_cpu_s", "threads"}
    if body["supported"]:
        assert "MainThread" in {t["name"] for t in body["threads"]}


def test_an_ack_without_a_body_says_which_field_it_needs(
    parts: tuple[TestClient, Actor, Governor],
) -> None:
    client, actor, _ = parts
    actor.record([_outcome(Action.ESCALATE)])
    [paused] = client.get("/v1/commands?service=agent", headers=AUTH).json()["commands"]
    path = f"/v1/commands/{paused['id']}/ack"

    bare = client.post(path, headers=AUTH)
    assert bare.status_code == 400
    assert bare.json() == {
        "error": 'an ack needs a JSON body naming the service: {"service": "<service>"}'
    }
    empty = client.post(path, headers=AUTH, json={})
    assert (empty.status_code, empty.json()) == (400, {"error": "service: Field required"})
    listed = client.post(path, headers=AUTH, json=["agent"])
    assert listed.status_code == 400 and listed.json()["error"].startswith("the request body")
    garbled = client.post(
        path, headers={**AUTH, "Content-Type": "application/json"}, content=b"{service"
    )
    assert garbled.json() == {"error": "the request body is not valid JSON"}
    assert client.post(path, headers=AUTH, json={"service": "agent"}).status_code == 200


def test_a_breakers_times_are_unix_seconds_not_the_boards_clock(
    parts: tuple[TestClient, Actor, Governor],
) -> None:
    """The board keeps a monotonic clock; people (and the console) read dates."""
    client, _, governor = parts
    before = time.time()
    governor.board.trip("openai:gpt-4o", "outage")
    after = time.time()

    [listed] = client.get("/v1/breakers", headers=AUTH).json()["breakers"]
    one = client.get("/v1/breakers/openai:gpt-4o", headers=AUTH).json()

    for found in (listed, one):
        assert found["state"] == "open"
        assert before - 1 <= found["opened_at"] <= after + 1
        assert found["reopens_at"] > found["opened_at"]
