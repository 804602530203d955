"""The operator surface of remediations: control API routes and ``spanvisor remediations``.

The routes run over a real :class:`~supervisor.api.control.Control` (an in-memory
store, a real governor) whose remediations are a fake with an in-memory
runner: DBOS itself is started by the remediation runner's own tests. The
fake runner refuses to be called on an event loop's thread, as the real one
must not be (it blocks for up to 10 s). The CLI is driven through ``main``
against the app served by uvicorn on a real socket, as an operator's shell
would reach a sidecar.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from policies import load_policy
from policies._governor import Governor
from supervisor.act.actor import Actor
from supervisor.act.failure_log import RecentFailures
from supervisor.act.store import Store
from supervisor.api.control import Control
from supervisor.api.server import build_control_app
from supervisor.cli.verbs import main
from supervisor.errors import ConfigError

TOKEN = "t0k3n"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RUNNING = "rem_" + "a1" * 12
DONE = "rem_" + "b2" * 12
FAILED = "rem_" + "c3" * 12
UNKNOWN = "rem_" + "d4" * 12
TRACE = "5e" * 16
FINISHED = {"SUCCESS", "ERROR", "CANCELLED"}


def _remediation(
    rid: str, status: str, outcome: str | None, created_at: float, trace_id: str | None
) -> dict[str, Any]:
    summary = {
        "id": rid,
        "status": status,
        "outcome": outcome,
        "reason": "the dependency answered again" if outcome == "succeeded" else None,
        "trace_id": trace_id,
        "created_at": created_at,
        "updated_at": created_at + 5,
        "recovery_attempts": 0,
        "error": "RuntimeError: boom" if status == "ERROR" else None,
        "executor_id": "sidecar-a",
    }
    request = {
        "id": rid,
        "trace_id": TRACE,
        "remediator": "switch-model",
        "use": "fallback",
        "tools": ["send_command", "breaker_states"],
        "budget": {"steps": 10, "tool_calls": 5, "deadline_s": 300.0, "tokens": 0},
        "params": {},
        "verify_window_s": 60.0,
        "on_unresolved": "escalate",
        "trigger": {
            "trace_id": "0af7651916cd43dd8448eb211c80319c",
            "span_id": "b7ad6b7169203331",
            "service": "agent",
            "run_id": "run-7",
            "class": "transient",
            "kind": "unavailable",
            "dependency": "openai:gpt-4o",
            "rule": "builtin.provider.unavailable",
            "message": "503 overloaded\x1b[31m; $(touch /tmp/x)",
            "span_name": "chat gpt-4o",
            "params": {"remediator": "switch-model"},
        },
        "dispatched_at": created_at,
    }
    steps = [
        {
            "n": 1,
            "name": "breaker_states",
            "output": [{"dependency": "openai:gpt-4o"}],
            "error": None,
        },
        {
            "n": 2,
            "name": "tool:send_command",
            "output": {"ok": True, "refused": False, "error": "", "value": {"command_id": "c1"}},
            "error": None,
        },
        {
            "n": 3,
            "name": "tool:restart_run",
            "output": {"ok": False, "refused": True, "error": "not allowed", "value": None},
            "error": None,
        },
        {"n": 5, "name": "verify", "output": None, "error": "TimeoutError: no answer"},
    ]
    return {**summary, "request": request, "steps": steps}


class FakeRunner:
    """``DurableRunner``'s operator views over a dict; refuses to run on an event loop."""

    def __init__(self) -> None:
        now = time.time()
        self.items: dict[str, dict[str, Any]] = {
            FAILED: _remediation(FAILED, "ERROR", None, now - 7200, None),
            DONE: _remediation(DONE, "SUCCESS", "succeeded", now - 300, TRACE),
            RUNNING: _remediation(RUNNING, "PENDING", None, now - 12, None),
        }
        self.stopped = False
        self.calls: list[str] = []

    def _called(self, what: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"runner.{what} called on the event loop's thread")
        if self.stopped:
            raise ConfigError("the remediation runner is not running")
        self.calls.append(what)

    def list(
        self, limit: int = 50, status: str | None = None, created_before: float | None = None
    ) -> list[dict[str, Any]]:
        self._called("list")
        found = sorted(self.items.values(), key=lambda r: r["created_at"], reverse=True)
        return [
            {k: v for k, v in r.items() if k not in ("request", "steps")}
            for r in found
            if (status is None or r["status"] == status)
            and (created_before is None or r["created_at"] <= created_before)
        ][:limit]

    def show(self, remediation_id: str) -> dict[str, Any] | None:
        self._called("show")
        found = self.items.get(remediation_id)
        return None if found is None else json.loads(json.dumps(found))

    def cancel(self, remediation_id: str) -> bool:
        self._called("cancel")
        found = self.items.get(remediation_id)
        if found is None or found["status"] in FINISHED:
            return False
        found["status"] = "CANCELLED"
        return True


class FakeRemediations:
    """``supervisor.remediation.engine.Remediations`` as the control API sees it."""

    def __init__(self, runner: FakeRunner | None, why: str = "") -> None:
        self.runner = runner
        self.why = why

    def describe(self) -> dict[str, Any]:
        return {
            "running": self.runner is not None,
            **({"state": "unused", "why": self.why} if self.why else {}),
            "database": "sqlite:////tmp/remediations.sqlite" if self.runner else None,
            "undispatched": 0,
            "watched": 1,
            "active": 1,
        }


def _control(remediations: FakeRemediations | None, **overrides: Any) -> Control:
    store = Store.open(":memory:")
    policy = load_policy(text="version: 1\npolicies: []\n")
    fields: dict[str, Any] = {
        "store": store,
        "actor": Actor(store, {}),
        "governor": Governor(policy),
        "policy": lambda: policy,
        "failures": RecentFailures(10),
        "stats": lambda: {"pipeline": {"processed_spans": 7}},
        "ready": lambda: True,
        "reload": lambda: {"reloaded": False},
        "remediations": remediations,
        **overrides,
    }
    return Control(**fields)


def _app(remediations: FakeRemediations | None) -> FastAPI:
    return build_control_app(token=TOKEN, control=_control(remediations))


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner()


@pytest.fixture
def client(runner: FakeRunner) -> TestClient:
    return TestClient(_app(FakeRemediations(runner)))


# -- the API ---------------------------------------------------------------------


def test_remediation_routes_need_the_bearer_token(client: TestClient, runner: FakeRunner) -> None:
    for method, path in [
        ("GET", "/v1/remediations"),
        ("GET", f"/v1/remediations/{RUNNING}"),
        ("POST", f"/v1/remediations/{RUNNING}/cancel"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            answer = client.request(method, path, headers=headers)
            assert (answer.status_code, answer.json()) == (
                401,
                {"error": "missing or wrong bearer token"},
            ), (method, path, headers)
    assert runner.calls == []
    assert runner.items[RUNNING]["status"] == "PENDING"
    described = client.get("/openapi.json").json()["paths"]
    assert {"/v1/remediations", "/v1/remediations/{remediation_id}/cancel"} <= set(described)


def test_remediations_are_listed_newest_first_and_filtered(
    client: TestClient, runner: FakeRunner
) -> None:
    answer = client.get("/v1/remediations", headers=AUTH)

    assert answer.status_code == 200
    body = answer.json()
    assert body["running"] is True
    assert [r["id"] for r in body["remediations"]] == [RUNNING, DONE, FAILED]
    assert body["remediations"][1]["outcome"] == "succeeded"
    assert "steps" not in body["remediations"][0]
    assert runner.calls == ["list"]  # and off the loop, or the fake would have raised

    pending = client.get("/v1/remediations?status=pending&limit=5", headers=AUTH).json()
    assert [r["id"] for r in pending["remediations"]] == [RUNNING]
    one = client.get("/v1/remediations?limit=1", headers=AUTH).json()
    assert [r["id"] for r in one["remediations"]] == [RUNNING]
    for bad in ("status=RUNNING", "limit=0", "limit=5000", "limit=abc"):
        refused = client.get(f"/v1/remediations?{bad}", headers=AUTH)
        assert refused.status_code == 400, bad
        assert bad.split("=")[0] in refused.json()["error"], bad


def test_one_remediation_is_shown_with_its_request_and_steps(client: TestClient) -> None:
    answer = client.get(f"/v1/remediations/{DONE}", headers=AUTH)

    assert answer.status_code == 200
    shown = answer.json()
    assert (shown["id"], shown["status"], shown["trace_id"]) == (DONE, "SUCCESS", TRACE)
    assert shown["request"]["remediator"] == "switch-model"
    assert shown["request"]["trigger"]["message"] == "503 overloaded\x1b[31m; $(touch /tmp/x)"
    assert [(s["n"], s["name"]) for s in shown["steps"]] == [
        (1, "breaker_states"),
        (2, "tool:send_command"),
        (3, "tool:restart_run"),
        (5, "verify"),
    ]


def test_a_running_remediation_is_cancelled_once(client: TestClient, runner: FakeRunner) -> None:
    answer = client.post(f"/v1/remediations/{RUNNING}/cancel", headers=AUTH)

    assert (answer.status_code, answer.json()) == (200, {"cancelled": True, "id": RUNNING})
    assert runner.items[RUNNING]["status"] == "CANCELLED"
    again = client.post(f"/v1/remediations/{RUNNING}/cancel", headers=AUTH)
    assert again.status_code == 409
    assert "already finished (CANCELLED)" in again.json()["error"]
    done = client.post(f"/v1/remediations/{DONE}/cancel", headers=AUTH)
    assert done.status_code == 409
    assert "already finished (SUCCESS, outcome succeeded)" in done.json()["error"]
    assert runner.items[DONE]["status"] == "SUCCESS"


def test_a_remediation_that_finishes_while_being_cancelled_is_a_conflict(
    client: TestClient, runner: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    def finished_meanwhile(remediation_id: str) -> bool:
        runner.items[remediation_id]["status"] = "SUCCESS"
        return False

    monkeypatch.setattr(runner, "cancel", finished_meanwhile)

    answer = client.post(f"/v1/remediations/{RUNNING}/cancel", headers=AUTH)

    assert answer.status_code == 409 and "already finished" in answer.json()["error"]


def test_unknown_and_malformed_ids_are_refused(client: TestClient, runner: FakeRunner) -> None:
    for method, path in [
        ("GET", f"/v1/remediations/{UNKNOWN}"),
        ("POST", f"/v1/remediations/{UNKNOWN}/cancel"),
    ]:
        answer = client.request(method, path, headers=AUTH)
        assert answer.status_code == 404, path
        assert answer.json() == {"error": f"no remediation '{UNKNOWN}'"}

    calls = len(runner.calls)
    for bad in (
        "apr_1234",
        "rem_",
        "rem_XYZ",
        "REM_abc",
        "rem_" + "a" * 65,
        "rem_1%3Brm",
        "rem_a%0A",
    ):
        for method, path in [
            ("GET", f"/v1/remediations/{bad}"),
            ("POST", f"/v1/remediations/{bad}/cancel"),
        ]:
            answer = client.request(method, path, headers=AUTH)
            assert answer.status_code == 400, path
            assert "rem_ and 1 to 64 lowercase hex digits" in answer.json()["error"]
    assert len(runner.calls) == calls  # refused before the runner is asked


def test_without_remediations_running_the_list_is_empty_and_the_rest_refused() -> None:
    why = "no remediations: the policy in force has no `remediate` action (<string>)"
    for remediations, state, said in (
        (FakeRemediations(None, why), "unused", why),
        (None, "off", "remediations are not running on this sidecar"),
    ):
        client = TestClient(_app(remediations))

        listed = client.get("/v1/remediations", headers=AUTH)
        assert (listed.status_code, listed.json()) == (
            200,
            {
                "remediations": [],
                "running": False,
                "state": state,
                "why": said,
                "next_cursor": None,
            },
        )
        for method, path in [
            ("GET", f"/v1/remediations/{RUNNING}"),
            ("POST", f"/v1/remediations/{RUNNING}/cancel"),
        ]:
            answer = client.request(method, path, headers=AUTH)
            assert answer.status_code == 409, path
            assert answer.json()["error"] == said
        # a malformed id is still a malformed id
        assert client.get("/v1/remediations/nope", headers=AUTH).status_code == 400


def test_a_stopped_runner_is_unavailable(client: TestClient, runner: FakeRunner) -> None:
    runner.stopped = True

    for method, path in [
        ("GET", "/v1/remediations"),
        ("GET", f"/v1/remediations/{RUNNING}"),
        ("POST", f"/v1/remediations/{RUNNING}/cancel"),
    ]:
        answer = client.request(method, path, headers=AUTH)
        assert answer.status_code == 503, path
        assert "remediation runner is not running" in answer.json()["error"]


# -- the CLI, over a real socket ---------------------------------------------------


class _Served:
    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        port = self.sock.getsockname()[1]
        self.remote = ["--api", f"http://127.0.0.1:{port}", "--token", TOKEN]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def served(runner: FakeRunner) -> Iterator[list[str]]:
    served = _Served(_app(FakeRemediations(runner)))
    try:
        yield served.remote
    finally:
        served.stop()


def test_the_cli_lists_remediations_as_a_table_and_as_json(
    served: list[str],
    runner: FakeRunner,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main(["remediations", *served]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "OUTCOME", "INSTANCE", "AGE", "TRACE"]
    rows = [line.split() for line in lines[1:]]
    assert {r[3] for r in rows} == {"sidecar-a"}  # which sidecar of a fleet runs each
    assert [r[0] for r in rows] == [RUNNING, DONE, FAILED]
    assert rows[0][1:3] == ["PENDING", "-"]
    assert rows[1][1:3] == ["SUCCESS", "succeeded"]
    assert rows[1][-1] == TRACE
    assert rows[1][-2] == "5m" and rows[2][-2] == "2h" and rows[0][-2].endswith("s")

    assert main(["remediations", "list", "--json", *served]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["running"] is True
    assert [r["id"] for r in answer["remediations"]] == [RUNNING, DONE, FAILED]

    assert main(["remediations", "--status", "error", "--output", "jsonl", *served]) == 0
    [only] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (only["id"], only["status"]) == (FAILED, "ERROR")

    assert main(["remediations", "--status", "CANCELLED", *served]) == 0
    assert capsys.readouterr().out.strip() == "no remediations in state CANCELLED"

    listed = runner.list  # once the list names remediators, the table shows them
    monkeypatch.setattr(
        runner, "list", lambda *a: [{**r, "remediator": "switch-model"} for r in listed(*a)]
    )
    assert main(["remediations", *served]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "OUTCOME", "REMEDIATOR", "INSTANCE", "AGE", "TRACE"]
    assert lines[1].split()[3] == "switch-model"


def test_the_cli_shows_a_remediation_with_its_steps_and_trace(
    served: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["remediations", "show", DONE, *served]) == 0
    out = capsys.readouterr().out

    assert out.startswith(f"remediation {DONE}  SUCCESS  outcome succeeded\n")
    assert "reason       the dependency answered again" in out
    assert "remediator   switch-model (uses fallback; tools: send_command, breaker_states)" in out
    assert "transient/unavailable on openai:gpt-4o by rule builtin.provider.unavailable" in out
    assert "service agent  run run-7" in out
    assert "span b7ad6b7169203331 (chat gpt-4o) in trace 0af7651916cd43dd8448eb211c80319c" in out
    assert 'message "503 overloaded' in out
    assert "\x1b" not in out and "\\x1b[31m" in out  # span text cannot drive the terminal
    assert "steps (4):" in out
    lines = out.splitlines()
    listed = lines[lines.index("steps (4):") + 1 : lines.index("steps (4):") + 5]
    steps = [line.split(None, 2) for line in listed]
    assert steps == [
        ["1", "breaker_states", '[{"dependency": "openai:gpt-4o"}]'],
        ["2", "tool:send_command", '{"command_id": "c1"}'],
        ["3", "tool:restart_run", "refused: not allowed"],
        ["5", "verify", "error: TimeoutError: no answer"],
    ]
    assert f"trace {TRACE}\n" in out
    assert out.rstrip().endswith(
        f"open trace {TRACE} in Jaeger: the root span links to the triggering span"
    )

    assert main(["remediations", "show", DONE, "--json", *served]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["request"]["trigger"]["run_id"] == "run-7" and len(shown["steps"]) == 4


def test_the_cli_cancels_and_says_why_it_cannot(
    served: list[str], runner: FakeRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["remediations", "cancel", RUNNING, *served]) == 0
    assert capsys.readouterr().out.strip() == f"{RUNNING}: cancelled"
    assert runner.items[RUNNING]["status"] == "CANCELLED"

    assert main(["remediations", "cancel", RUNNING, *served]) == 2
    err = capsys.readouterr().err
    assert "409" in err and "already finished (CANCELLED)" in err

    assert main(["remediations", "show", UNKNOWN, *served]) == 2
    assert f"404: no remediation '{UNKNOWN}'" in capsys.readouterr().err
    assert main(["remediations", "show", "apr_1234", *served]) == 2
    assert "400" in capsys.readouterr().err
    assert main(["remediations", "cancel", *served]) == 2
    assert "needs the remediation's id" in capsys.readouterr().err


def test_the_cli_says_when_remediations_are_not_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    why = "no remediations: the policy in force has no `remediate` action (policy.yaml)"
    served = _Served(_app(FakeRemediations(None, why)))
    try:
        assert main(["remediations", *served.remote]) == 0
        assert capsys.readouterr().out.strip() == why
        assert main(["remediations", "show", RUNNING, *served.remote]) == 2
        err = capsys.readouterr().err
        assert "409" in err and "`remediate` action" in err
    finally:
        served.stop()
    closed = ["--api", "http://127.0.0.1:9", "--token", "x"]
    assert main(["remediations", *closed]) == 2
    assert "cannot reach the control API" in capsys.readouterr().err


def test_the_cli_help_explains_the_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["remediations", "--help"])
    assert stopped.value.code == 0
    text = capsys.readouterr().out
    for needed in ("show", "cancel", "--status", "PENDING", "--json", "--token", "outcome"):
        assert needed in text, needed
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "remediations" in capsys.readouterr().out


def test_remediations_page_through_many_created_at_the_same_time(runner: FakeRunner) -> None:
    # DBOS may keep whole seconds: 40 remediations of one second, and two older ones.
    at = time.time() // 1
    runner.items = {
        f"rem_{n:04x}": _remediation(f"rem_{n:04x}", "SUCCESS", "succeeded", at, None)
        for n in range(40)
    }
    runner.items.update(
        {r: _remediation(r, "ERROR", None, at - 60, None) for r in ("rem_ff01", "rem_ff02")}
    )
    client = TestClient(_app(FakeRemediations(runner)))
    shown: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 5, **({"cursor": cursor} if cursor else {})}
        answer = client.get("/v1/remediations", headers=AUTH, params=params).json()
        shown += [r["id"] for r in answer["remediations"]]
        cursor = answer["next_cursor"]
        if cursor is None:
            break

    assert len(shown) == len(set(shown)) == 42
    assert shown[:40] == sorted(shown[:40], reverse=True)  # equal times: by id
    assert shown[40:] == ["rem_ff02", "rem_ff01"]
