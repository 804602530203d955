"""A fleet sidecar killed for good: another one takes over its remediation and its command.

Two real ``spanvisor run`` processes share one PostgreSQL schema
(``database_url``), with heartbeats shortened through the settings'
variables. Sidecar A gets two failures: an LLM timeout, remediated by
``retry_step`` after a long durable sleep, and a server error, retried at
once by a webhook command whose delivery the agent's endpoint holds
unanswered. A is killed (SIGKILL) mid-sleep and mid-delivery and never comes
back. What is pinned:

* B takes A over within ``instance_dead_after_s`` plus a few heartbeats
  (``/v1/stats`` ``fleet``), once;
* the command A had claimed is delivered by B long before A's claim
  (``CLAIM_S``) would have run out;
* the remediation resumes on B, keeps its sleep's wake-up time, sends its
  ``retry_step`` once, and ends ``succeeded`` when the run recovers;
* A, started again under its id while the remediation still sleeps on B,
  is alive again and runs nothing of it.

The measured takeover time is printed (``-s`` shows it).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from supervisor.act.store import CLAIM_S
from supervisor.testing.sidecar_process import wait_until
from tests.postgres import fresh_schema
from tests.test_dispatch import Answer, Delivery, WebhookReceiver
from tests.test_exactly_once import Sidecar
from tests.test_remediation_crash import (
    RECOVERED_SPAN,
    TRIGGER_SPAN,
    WORKFLOW,
    llm_request,
    remediation_policy,
)

pytestmark = pytest.mark.slow

HEARTBEAT_S, DEAD_AFTER_S = 0.5, 3.0
DELAY_S = 30.0  # the remediation's sleep: B starts, A dies and comes back, inside it
SECRET = "fleet-takeover-webhook-secret"
OTHER_TRACE = "1bf7651916cd43dd8448eb211c80319d"
OTHER_SPAN = "c7ad6b7169203332"
POLICY = remediation_policy(
    DELAY_S,
    rest="""\
  - name: retry_the_rest
    match: {class: [transient, model, permanent, semantic]}
    action: retry
    wait: {type: fixed, seconds: 0}
    honour_retry_after: false
""",
)


def server_error() -> bytes:
    """A failing LLM span of another run: a server error, not a timeout."""
    request = ExportTraceServiceRequest.FromString(llm_request(OTHER_SPAN, failed=True))
    span = request.resource_spans[0].scope_spans[0].spans[0]
    span.trace_id = bytes.fromhex(OTHER_TRACE)
    span.status.CopyFrom(
        Status(code=Status.STATUS_CODE_ERROR, message="InternalServerError: Error code: 500")
    )
    return bytes(request.SerializeToString())


def is_remediations(delivery: Delivery) -> bool:
    return "remediation_id" in delivery.json().get("params", {})


class Agent:
    """The agent's webhook: the first command not from a remediation is held unanswered."""

    def __init__(self) -> None:
        self.held = False

    def __call__(self, delivery: Delivery) -> Answer:
        if not is_remediations(delivery) and not self.held:
            self.held = True
            return Answer(200, hang_s=120)  # past the test: the teardown ends it
        return Answer(200)


class Database:
    """DBOS's tables and the store's, read directly in the fleet's schema."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        try:
            with psycopg.connect(self.url, autocommit=True) as db:
                return list(db.execute(sql, args))
        except psycopg.errors.UndefinedTable:  # DBOS is creating its tables
            return []

    def workflows(self) -> list[tuple[str, str, str]]:
        """(id, status, executor) of every remediation."""
        found = self.rows(
            "SELECT workflow_uuid, status, executor_id FROM workflow_status WHERE name = %s",
            WORKFLOW,
        )
        return [(str(r[0]), str(r[1]), str(r[2])) for r in found]

    def sleep_deadline(self, workflow_id: str) -> float | None:
        found = self.rows(
            "SELECT output FROM operation_outputs WHERE workflow_uuid = %s"
            " AND function_name = 'DBOS.sleep' ORDER BY function_id LIMIT 1",
            workflow_id,
        )
        return float(json.loads(found[0][0])) if found else None

    def claimed_by(self, trace_id: str) -> list[str]:
        found = self.rows(
            "SELECT c.delivered_by FROM commands c JOIN incidents i ON i.key = c.incident_key"
            " WHERE i.trace_id = %s AND c.status = 'pending'",
            trace_id,
        )
        return [str(r[0]) for r in found]


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


def start(tmp_path: Path, name: str, url: str, webhook_url: str) -> Sidecar:
    directory = tmp_path / name
    directory.mkdir()
    settings = {
        "host": "127.0.0.1",
        "api_token": secrets.token_urlsafe(16),
        "state_path": str(directory / "state.db"),
        "database_url": url,
        "instance_id": name,
        "policy_poll_s": 0,
        "agents": {"*": {"webhook": {"url": webhook_url, "secret": SECRET, "timeout_s": 60}}},
    }
    env = {
        "SPANVISOR_INSTANCE_HEARTBEAT_S": str(HEARTBEAT_S),
        "SPANVISOR_INSTANCE_DEAD_AFTER_S": str(DEAD_AFTER_S),
    }
    sidecar = Sidecar(settings, directory, policy=POLICY, name=name, env=env, startup_timeout_s=60)
    return sidecar.start()  # type: ignore[return-value]


def fleet(sidecar: Sidecar) -> dict[str, Any]:
    found: dict[str, Any] = sidecar.stats()["fleet"]
    return found


def test_a_live_sidecar_takes_over_a_killed_ones_remediation_and_claimed_command(
    tmp_path: Path, url: str
) -> None:
    db = Database(url)
    wall = time.time() - time.monotonic()  # Delivery.at (monotonic) to unix seconds
    with WebhookReceiver(Agent()) as receiver:
        a = start(tmp_path, "sidecar-a", url, receiver.url)
        b: Sidecar | None = None
        try:
            a.send([llm_request(TRIGGER_SPAN, failed=True), server_error()])

            def sleeping() -> str | None:
                pending = [w for w, status, _ in db.workflows() if status == "PENDING"]
                return pending[0] if pending and db.sleep_deadline(pending[0]) else None

            rid = wait_until(sleeping, 60, "the remediation's durable sleep on A")
            deadline = db.sleep_deadline(rid)
            assert deadline is not None
            wait_until(
                lambda: [d for d in receiver.seen() if not is_remediations(d)],
                30,
                "A's delivery of the retry command, held by the agent",
            )
            assert db.claimed_by(OTHER_TRACE) == ["sidecar-a"]

            b = start(tmp_path, "sidecar-b", url, receiver.url)
            wait_until(lambda: fleet(b)["alive"] == 2, 30, "B beating beside A")
            assert time.time() < deadline - 12, "A must die well inside the remediation's sleep"
            a.kill()
            killed_at = time.time()

            def taken_over() -> float | None:
                return time.time() if fleet(b)["takeovers"] == 1 else None

            took_at = wait_until(taken_over, 30, "B taking A over")
            takeover_s = took_at - killed_at
            print(f"takeover {takeover_s:.2f} s after kill -9 (dead after {DEAD_AFTER_S:g} s)")

            def delivered_by_b() -> float | None:
                done = [
                    c
                    for c in b.commands("delivered")
                    if "remediation_id" not in c.get("params", {})
                ]
                return time.time() if done and done[0]["delivered_by"] == "sidecar-b" else None

            command_at = wait_until(delivered_by_b, 30, "A's claimed command delivered by B")

            # A comes back under its id while the remediation still sleeps, on B: it beats
            # again, and its DBOS recovers nothing (the remediation is no longer its own).
            a.start()
            wait_until(lambda: a.stats()["remediations"]["running"], 60, "A's remediations")
            wait_until(lambda: fleet(b)["alive"] == 2, 30, "A alive again")
            assert time.time() < deadline, "A must be back before the sleep ends"

            retried = wait_until(
                lambda: [d for d in receiver.seen() if is_remediations(d)],
                DELAY_S + 30,
                "the remediation's retry_step, from B",
            )
            retried_at = retried[0].at + wall
            b.send([llm_request(RECOVERED_SPAN, failed=False)])  # the run recovers

            def outcome() -> dict[str, Any] | None:
                listed = b.get("/v1/remediations", limit=10)["remediations"]
                return next((r for r in listed if r["id"] == rid and r.get("outcome")), None)

            ended = wait_until(outcome, 60, "the remediation's outcome")
            workflows = db.workflows()
            stats = fleet(b)
            back = a.stats()
        finally:
            if b is not None:
                b.stop()
            a.kill()
        seen = receiver.seen()

    assert takeover_s <= DEAD_AFTER_S + 3 * HEARTBEAT_S + 1.0
    assert (stats["takeovers"], stats["alive"], stats["dead"]) == (1, 2, 0)
    assert (back["fleet"]["takeovers"], back["fleet"]["alive"]) == (0, 2)
    assert back["remediations"].get("succeeded", 0) == 0  # it ran nothing of it
    assert stats["remediations_resumed"] == 1 and stats["commands_released"] == 1
    assert command_at - killed_at < CLAIM_S / 4  # not after A's claim ran out
    # Resumed where its sleep was: the retry came when A's sleep would have ended.
    assert deadline - 1.0 <= retried_at <= deadline + 5.0
    assert len(retried) == 1
    assert len([d for d in seen if is_remediations(d)]) == 1  # sent once, by B
    assert (ended["status"], ended["outcome"]) == ("SUCCESS", "succeeded")
    assert [(w, s, e) for w, s, e in workflows if w == rid] == [(rid, "SUCCESS", "sidecar-b")]
