"""Two real ``spanvisor run`` processes sharing one PostgreSQL store (``database_url``).

Both receive the same failing spans over OTLP/HTTP (as when an exporter's
retry reaches another instance behind a load balancer), and both deliver to
one webhook receiver. What is pinned: each failure is one incident and one
command, delivered once, whichever sidecar judged it; either sidecar's API
lists the other's incidents and commands, named by instance; remediations
(DBOS) are kept in the same database and schema, and one waiting for approval
on one sidecar goes on when the other sidecar's API answers it.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from bench.kill_acknowledged import POLICY
from bench.spans import make_requests
from supervisor.testing.sidecar_process import wait_until
from tests.postgres import fresh_schema
from tests.test_dispatch import Answer, WebhookReceiver
from tests.test_exactly_once import FAILURES, SECRET, Sidecar, expected_keys
from tests.test_remediation_crash import TRIGGER_SPAN, llm_request

pytestmark = pytest.mark.slow


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_schema() as found:
        yield found


def tables(url: str) -> set[str]:
    """The tables of the schema ``url`` puts first."""
    with psycopg.connect(url) as db:
        return {
            row[0]
            for row in db.execute(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema()"
            )
        }


def start(tmp_path: Path, name: str, url: str, webhook_url: str, policy: str = POLICY) -> Sidecar:
    directory = tmp_path / name
    directory.mkdir()
    settings = {
        "host": "127.0.0.1",
        "api_token": secrets.token_urlsafe(16),
        "state_path": str(directory / "state.db"),  # its own ingest log and run journal
        "database_url": url,
        "instance_id": name,
        "policy_poll_s": 0,
        "seen_failure_spans": 1,
        "agents": {"*": {"webhook": {"url": webhook_url, "secret": SECRET}, "max_attempts": 5}},
    }
    return Sidecar(settings, directory, policy=policy, name=name, startup_timeout_s=15).start()


def test_two_sidecars_on_one_database_store_and_deliver_each_failure_once(
    tmp_path: Path, url: str
) -> None:
    payloads = make_requests(2, 40, failure_rate=0.25, seed=3)
    # Each answer takes a while: the commands stay pending, in flight, for long enough
    # that the other sidecar's dispatcher looks for due commands meanwhile.
    with WebhookReceiver(lambda delivery: Answer(200, hang_s=1.5)) as receiver:
        a = start(tmp_path, "sidecar-a", url, receiver.url)
        try:
            b = start(tmp_path, "sidecar-b", url, receiver.url)
            try:
                # Their remediations (DBOS) share the database too, in the same schema.
                wait_until(lambda: "workflow_status" in tables(url), 20, "DBOS's tables")
                a.send(payloads)
                b.send(payloads)
                wait_until(
                    lambda: Counter(c["status"] for c in b.commands()) == {"delivered": FAILURES},
                    30,
                    "every command delivered",
                )
                incidents_a, incidents_b = a.incidents(), b.incidents()
                commands = a.commands()
                duplicates = sum(s.stats()["delivery"]["duplicate_incidents"] for s in (a, b))
            finally:
                b.stop()
        finally:
            a.stop()
        seen = receiver.seen()

    assert len(incidents_a) == FAILURES
    assert incidents_a == incidents_b  # one store: each lists the other's incidents
    assert duplicates == FAILURES  # the failures judged twice were refused once each
    assert {i["judged_by"] for i in incidents_a} <= {"sidecar-a", "sidecar-b"}
    assert len(commands) == FAILURES
    assert {c["delivered_by"] for c in commands} <= {"sidecar-a", "sidecar-b"}
    keys = Counter(d.key for d in seen)
    assert set(keys) == expected_keys(incidents_a)
    assert keys.most_common(1)[0][1] == 1  # each command reached the agent once


ESCALATE = """\
version: 1
breakers: {enabled: false}
retry_budget: {enabled: false}
restart_intensity: {enabled: false}
policies:
  - name: ask
    match: {class: [transient, model, permanent, semantic]}
    action: escalate
"""


def test_an_approval_opened_by_one_sidecar_is_answered_through_the_other_once(
    tmp_path: Path, url: str
) -> None:
    payloads = make_requests(2, 40, failure_rate=0.25, seed=3)
    with WebhookReceiver() as receiver:
        a = start(tmp_path, "sidecar-a", url, receiver.url, ESCALATE)
        try:
            b = start(tmp_path, "sidecar-b", url, receiver.url, ESCALATE)
            try:
                a.send(payloads)
                b.send(payloads)  # the same failures: no second request for any
                wait_until(
                    lambda: len(b.get("/v1/approvals", limit=1000)["approvals"]) == FAILURES,
                    20,
                    "an approval request per failure",
                )
                pending = b.get("/v1/approvals", status="pending", limit=1000)["approvals"]
                first = pending[0]["id"]
                a.post(f"/v1/approvals/{first}/approve", {"by": "oncall", "note": "go"})
                seen_by_b = b.get(f"/v1/approvals/{first}")
                with pytest.raises(httpx.HTTPStatusError) as again:
                    b.post(f"/v1/approvals/{first}/deny", {"by": "someone else"})
                still = a.get(f"/v1/approvals/{first}")
                total = len(a.get("/v1/approvals", limit=1000)["approvals"])
            finally:
                b.stop()
        finally:
            a.stop()

    assert len(pending) == FAILURES == total
    assert (seen_by_b["status"], seen_by_b["answered_by"], seen_by_b["answered_on"]) == (
        "approved",
        "oncall",
        "sidecar-a",
    )
    assert seen_by_b["judged_by"] in {"sidecar-a", "sidecar-b"}
    assert again.value.response.status_code == 409
    assert "already answered: approved" in again.value.response.text
    assert still["status"] == "approved"


ASK = """\
version: 1
breakers: {enabled: false}
retry_budget: {enabled: false}
restart_intensity: {enabled: false}
remediators:
  ask:
    use: escalate
    params: {timeout_s: 120, on_timeout: none}
    verify_window_s: 0
    on_unresolved: none
policies:
  - name: ask_a_person
    match: {kind: timeout}
    action: remediate
    remediator: ask
"""


def test_a_remediation_waiting_on_one_sidecar_goes_on_when_the_other_approves(
    tmp_path: Path, url: str
) -> None:
    with WebhookReceiver() as receiver:
        a = start(tmp_path, "sidecar-a", url, receiver.url, ASK)
        try:
            b = start(tmp_path, "sidecar-b", url, receiver.url, ASK)
            try:
                a.send([llm_request(TRIGGER_SPAN, failed=True)])  # judged on a only
                wait_until(
                    lambda: b.get("/v1/approvals", status="pending")["approvals"],
                    90,  # a's runner first launches DBOS on the shared database
                    "the remediation on a asking for approval",
                )
                [asked] = b.get("/v1/approvals", status="pending")["approvals"]
                rid = asked["remediation_id"]
                b.post(f"/v1/approvals/{asked['id']}/approve", {"by": "oncall"})
                wait_until(
                    lambda: a.get(f"/v1/remediations/{rid}")["status"] == "SUCCESS",
                    30,
                    "the remediation on a going on",
                )
                done = a.get(f"/v1/remediations/{rid}")
                # b lists the fleet's remediations once its own runner is up (DBOS's launch
                # on a busy database can take seconds).
                wait_until(
                    lambda: b.get("/v1/remediations")["remediations"],
                    60,
                    "b listing the remediation",
                )
                listed_on_b = b.get("/v1/remediations")["remediations"]
            finally:
                b.stop()
        finally:
            a.stop()

    assert asked["judged_by"] == "sidecar-a"
    assert done["outcome"] == "escalated"
    # The answer given on b is what the wait on a received.
    received = [s["output"] for s in done["steps"] if s["name"] == "DBOS.recv"]
    assert received == [{"approved": True, "id": asked["id"]}]
    assert [(r["id"], r["executor_id"]) for r in listed_on_b] == [(rid, "sidecar-a")]


def test_either_sidecar_lists_the_fleet_s_runs_saying_which_tracks_each(
    tmp_path: Path, url: str
) -> None:
    with WebhookReceiver(lambda delivery: Answer(200)) as receiver:
        a = start(tmp_path, "sidecar-a", url, receiver.url)
        try:
            b = start(tmp_path, "sidecar-b", url, receiver.url)
            try:
                a.send(make_requests(1, 10, failure_rate=0.0, seed=5))
                b.send(make_requests(1, 10, failure_rate=0.0, seed=6))

                def fleet_runs(sidecar: Sidecar) -> set[str]:
                    runs = sidecar.get("/v1/runs", limit=1000)["runs"]
                    return {r["tracked_by"] for r in runs}

                # Published every 2 s: each lists the runs the other tracks.
                wait_until(
                    lambda: fleet_runs(a) == fleet_runs(b) == {"sidecar-a", "sidecar-b"},
                    15,
                    "each sidecar's runs listed by both",
                )
                listed = a.get("/v1/runs", limit=1000)
            finally:
                b.stop()
        finally:
            a.stop()

    assert listed["fleet"] is True
    assert listed["runs"] == sorted(
        listed["runs"], key=lambda r: (r["last_seen_at"], r["run_id"]), reverse=True
    )
