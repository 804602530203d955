"""Exactly-once delivery with a real ``spanvisor run``: re-sent spans and ``kill -9``.

A real sidecar process receives realistic failing spans over OTLP/HTTP (the
bytes an exporter sends, from :func:`bench.spans.make_requests`) and delivers
its commands by signed webhook to a receiver in this test, which records every
request with its ``Idempotency-Key``. What is pinned:

* an exporter re-sending the same payload makes no second command: the
  receiver gets each command once;
* after ``kill -9`` mid-delivery, a new process on the same state file
  delivers every command that was not acknowledged, and nothing that was;
  the original spans sent to it again make no new command.

The sidecar's in-memory memory of failing spans (``seen_failure_spans``) is
set to 1, so that refusing a re-sent span is the store's doing, as it is
after a restart.
"""

from __future__ import annotations

import secrets
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.kill_acknowledged import POLICY
from bench.spans import make_requests
from supervisor.act import signing
from supervisor.records import command_key
from supervisor.testing.sidecar_process import SidecarProcess, wait_until
from tests.test_dispatch import Answer, Delivery, WebhookReceiver

pytestmark = pytest.mark.slow

SECRET = "exactly-once-webhook-secret-0123"
# POLICY retries every failure at once: no breaker, budget or intensity changes the
# decision, and no backoff delays the command (so the test takes no waiting).
# 2 requests of 40 spans, 25 % failing: exactly 20 originating failures.
FAILURES = 20


class Sidecar(SidecarProcess):
    def send(self, payloads: list[bytes]) -> None:
        """POST each request as the OTLP/HTTP exporter does."""
        for payload in payloads:
            response = httpx.post(
                f"{self.otlp_endpoint}/v1/traces",
                content=payload,
                headers={"Content-Type": "application/x-protobuf"},
                timeout=5,
            )
            assert response.status_code == 200, response.text

    def stats(self) -> Any:
        return self.get("/v1/stats")

    def incidents(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get("/v1/incidents", limit=1000)["incidents"]
        return found

    def commands(self, status: str | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": 1000}
        if status is not None:
            params["status"] = status
        found: list[dict[str, Any]] = self.get("/v1/commands/log", **params)["commands"]
        return found


class Sidecars:
    """Starts ``spanvisor run`` processes on one state file; kills what is left at the end."""

    def __init__(self, tmp_path: Path, webhook_url: str) -> None:
        self.tmp_path = tmp_path
        self.settings = {
            "host": "127.0.0.1",
            "api_token": secrets.token_urlsafe(16),
            "token_file": str(tmp_path / "api-token"),
            "state_path": str(tmp_path / "state.db"),
            "policy_poll_s": 0,
            "seen_failure_spans": 1,
            "agents": {
                "*": {
                    # Long enough that an attempt the receiver holds is still in
                    # flight when the process is killed.
                    "webhook": {"url": webhook_url, "secret": SECRET, "timeout_s": 10},
                    "max_attempts": 20,
                }
            },
        }
        self.started: list[Sidecar] = []

    def start(self) -> Sidecar:
        """A new process (new ports) on the same state file, once healthy."""
        sidecar = Sidecar(
            self.settings,
            self.tmp_path,
            policy=POLICY,
            name=f"spanvisor-{len(self.started)}",
            startup_timeout_s=10,
        )
        self.started.append(sidecar)
        sidecar.start()
        return sidecar

    def close(self) -> None:
        for sidecar in self.started:
            sidecar.kill()


@pytest.fixture
def payloads() -> list[bytes]:
    return make_requests(2, 40, failure_rate=0.25, seed=3)


def expected_keys(incidents: list[dict[str, Any]]) -> set[str]:
    """The Idempotency-Key of each incident's retry_step command."""
    return {command_key(i["trace_id"], i["span_id"], i["rule"], "retry") for i in incidents}


def settled(sidecar: Sidecar, delivered: int) -> bool:
    """Exactly ``delivered`` commands, all delivered, none in flight.

    Read from the command log (a query), not ``/v1/stats``, whose counts by
    status may be seconds old.
    """
    statuses = Counter(c["status"] for c in sidecar.commands())
    return (
        statuses == {"delivered": delivered}
        and sidecar.stats()["delivery"]["push"]["in_flight"] == 0
    )


def test_an_exporter_resending_the_same_spans_gets_each_command_delivered_once(
    tmp_path: Path, payloads: list[bytes]
) -> None:
    with WebhookReceiver() as receiver:
        sidecars = Sidecars(tmp_path, receiver.url)
        try:
            sidecar = sidecars.start()
            sidecar.send(payloads)
            wait_until(lambda: settled(sidecar, FAILURES), 10, "every command delivered")

            sidecar.send(payloads)  # the exporter did not see our answer and sends again
            wait_until(
                lambda: sidecar.stats()["delivery"]["duplicate_incidents"] == FAILURES,
                10,
                "the re-sent failures refused as duplicates",
            )
            wait_until(lambda: settled(sidecar, FAILURES), 10, "nothing left to deliver")
            incidents = sidecar.incidents()
            commands = sidecar.commands()
            stats = sidecar.stats()
        finally:
            sidecars.close()
        seen = receiver.seen()

    assert stats["pipeline"]["processed_batches"] == 2 * len(payloads)
    assert len(incidents) == FAILURES
    assert {i["action"] for i in incidents} == {"retry"}
    assert len(commands) == FAILURES
    keys = [d.key for d in seen]
    assert Counter(keys).most_common(1)[0][1] == 1  # no key twice
    assert set(keys) == expected_keys(incidents)
    assert {d.message_id for d in seen} == {c["id"] for c in commands}
    assert all(signing.verify(SECRET, d.headers, d.body) == d.message_id for d in seen)


class KilledMidDelivery:
    """Before the kill: the first ``ok`` commands are acknowledged; of the others,
    half are refused once (503) and then held unanswered, half are held at once.
    So when the process is killed every unacknowledged command has an attempt in
    flight, and none waits a backoff. After the kill everything is acknowledged.

    Keep ``total - ok`` at most 8: the webhook actuator has 8 connections, and
    attempts beyond those wait, unsent, for one (see test_dispatch's
    ``test_every_attempt_in_flight_is_sent_not_queued_behind_eight_slow_requests``)."""

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.roles: dict[str, str] = {}
        self.attempts: Counter[str] = Counter()
        self.killed = False

    def __call__(self, delivery: Delivery) -> Answer:  # called under the receiver's lock
        if self.killed:
            return Answer(200)
        role = self.roles.get(delivery.key)
        if role is None:
            n = len(self.roles)
            role = "ok" if n < self.ok else ("refuse" if n % 2 else "hold")
            self.roles[delivery.key] = role
        self.attempts[delivery.key] += 1
        if role == "ok":
            return Answer(200)
        if role == "refuse" and self.attempts[delivery.key] == 1:
            return Answer(503, body=b"warming up")
        return Answer(200, hang_s=30.0)  # answered only after the sender is gone

    def all_in_flight(self, total: int) -> bool:
        """Every command seen; every refused one sent again (and now held)."""
        return len(self.roles) == total and all(
            self.attempts[key] >= 2 for key, role in self.roles.items() if role == "refuse"
        )


def test_after_kill_9_mid_delivery_a_restart_delivers_what_was_not_acknowledged_and_only_that(
    tmp_path: Path, payloads: list[bytes]
) -> None:
    script = KilledMidDelivery(ok=14)
    with WebhookReceiver(script) as receiver:
        sidecars = Sidecars(tmp_path, receiver.url)
        try:
            first = sidecars.start()
            first.send(payloads)
            wait_until(lambda: script.all_in_flight(FAILURES), 10, "an attempt of every command")
            # The acknowledged ones are recorded delivered before the kill: what
            # the receiver acknowledged is exactly what the store says is done.
            wait_until(
                lambda: (
                    len(receiver.acknowledged()) == len(first.commands("delivered")) == script.ok
                ),
                10,
                "the acknowledged ones recorded delivered",
            )
            acknowledged = receiver.acknowledged()
            delivered_ids = {c["id"] for c in first.commands("delivered")}
            incidents = first.incidents()
            pending_before = len(first.commands("pending"))
            assert first.kill() == -signal.SIGKILL
            script.killed = True
            seen_before_kill = len(receiver.seen())

            second = sidecars.start()
            wait_until(
                lambda: settled(second, FAILURES), 10, "every command delivered after restart"
            )
            after_restart = len(receiver.seen())

            second.send(payloads)  # the exporter re-sends to the new process
            wait_until(
                lambda: second.stats()["delivery"]["duplicate_incidents"] == FAILURES,
                10,
                "the re-sent failures refused as duplicates",
            )
            wait_until(lambda: settled(second, FAILURES), 10, "nothing left to deliver")
            incidents_after = second.incidents()
            commands_after = second.commands()
        finally:
            sidecars.close()
        seen = receiver.seen()
        acknowledged_in_all = receiver.acknowledged()

    keys = expected_keys(incidents)
    counts = Counter(d.key for d in seen)
    assert len(incidents) == FAILURES
    assert pending_before == FAILURES - script.ok
    assert len(acknowledged) == script.ok
    assert {d.message_id for d in seen if d.key in acknowledged} == delivered_ids
    # Every command reached the agent at least once...
    assert set(counts) == keys
    assert keys <= acknowledged_in_all
    # ...and those not acknowledged before the kill (refused, or held unanswered
    # when it came) were sent again after the restart; none that was acknowledged.
    sent_again = {key for key, n in counts.items() if n > 1}
    assert sent_again == keys - acknowledged
    assert {key: counts[key] for key in acknowledged} == dict.fromkeys(acknowledged, 1)
    # What is sent again is the same command: same id, same signed body.
    for key in sent_again:
        copies = [d for d in seen if d.key == key]
        assert {d.message_id for d in copies} == {copies[0].message_id}
        assert {d.body for d in copies} == {copies[0].body}
    # The original spans again: no new incident, no new command, no new request.
    assert {i["key"] for i in incidents_after} == {i["key"] for i in incidents}
    assert len(commands_after) == FAILURES
    assert len(seen) == after_restart > seen_before_kill
