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

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.spans import make_requests
from supervisor import signing
from supervisor.records import command_key
from tests.test_dispatch import Answer, Delivery, WebhookReceiver

pytestmark = pytest.mark.slow

SECRET = "exactly-once-webhook-secret-0123"
# Every failure is retried at once: no breaker, budget or intensity changes the
# decision, and no backoff delays the command (so the test takes no waiting).
POLICY = """\
version: 1
breakers: {enabled: false}
retry_budget: {enabled: false}
restart_intensity: {enabled: false}
policies:
  - name: retry_now
    match: {class: [transient, model, permanent, semantic]}
    action: retry
    max_attempts: 100
    wait: {type: fixed, seconds: 0}
    honour_retry_after: false
"""
# 2 requests of 40 spans, 25 % failing: exactly 20 originating failures.
FAILURES = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Sidecar:
    process: subprocess.Popen[bytes]
    http_port: int
    api: str
    token: str
    log: Path

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(
            f"{self.api}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=5,
        )
        response.raise_for_status()
        return response.json()

    def send(self, payloads: list[bytes]) -> None:
        """POST each request as the OTLP/HTTP exporter does."""
        for payload in payloads:
            response = httpx.post(
                f"http://127.0.0.1:{self.http_port}/v1/traces",
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
        self.webhook_url = webhook_url
        self.token = secrets.token_urlsafe(16)
        self.state = tmp_path / "state.db"
        self.policy = tmp_path / "policy.yaml"
        self.policy.write_text(POLICY, encoding="utf-8")
        self.started: list[Sidecar] = []

    def start(self) -> Sidecar:
        n = len(self.started)
        http_port, api_port = free_port(), free_port()
        settings = {
            "host": "127.0.0.1",
            "otlp_grpc_port": free_port(),
            "otlp_http_port": http_port,
            "api_port": api_port,
            "api_token": self.token,
            "token_file": str(self.tmp_path / "api-token"),
            "state_path": str(self.state),
            "policy": str(self.policy),
            "policy_poll_s": 0,
            "seen_failure_spans": 1,
            "agents": {
                "*": {
                    # Long enough that an attempt the receiver holds is still in
                    # flight when the process is killed.
                    "webhook": {"url": self.webhook_url, "secret": SECRET, "timeout_s": 10},
                    "max_attempts": 20,
                }
            },
        }
        config = self.tmp_path / f"spanvisor-{n}.yaml"
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
        # The settings file alone decides: no SPANVISOR_* variable (conftest sets
        # some) overrides it, and no OTEL_* variable sends spans anywhere.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANVISOR_", "OTEL_"))}
        log = self.tmp_path / f"spanvisor-{n}.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "supervisor.cli", "run", "--config", str(config)],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        sidecar = Sidecar(process, http_port, f"http://127.0.0.1:{api_port}", self.token, log)
        self.started.append(sidecar)

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"sidecar exited: {log.read_text(errors='replace')}")
            try:
                return httpx.get(f"{sidecar.api}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "the sidecar to be healthy")
        return sidecar

    def close(self) -> None:
        for sidecar in self.started:
            if sidecar.process.poll() is None:
                sidecar.process.kill()
            sidecar.process.wait(10)


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
    return statuses == {"delivered": delivered} and sidecar.stats()["delivery"]["in_flight"] == 0


def test_an_exporter_resending_the_same_spans_gets_each_command_delivered_once(
    tmp_path: Path, payloads: list[bytes]
) -> None:
    with WebhookReceiver() as receiver:
        sidecars = Sidecars(tmp_path, receiver.url)
        try:
            sidecar = sidecars.start()
            sidecar.send(payloads)
            wait_until(lambda: settled(sidecar, FAILURES), "every command delivered")

            sidecar.send(payloads)  # the exporter did not see our answer and sends again
            wait_until(
                lambda: sidecar.stats()["delivery"]["duplicate_incidents"] == FAILURES,
                "the re-sent failures refused as duplicates",
            )
            wait_until(lambda: settled(sidecar, FAILURES), "nothing left to deliver")
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
            wait_until(lambda: script.all_in_flight(FAILURES), "an attempt of every command")
            # The acknowledged ones are recorded delivered before the kill: what
            # the receiver acknowledged is exactly what the store says is done.
            wait_until(
                lambda: (
                    len(receiver.acknowledged()) == len(first.commands("delivered")) == script.ok
                ),
                "the acknowledged ones recorded delivered",
            )
            acknowledged = receiver.acknowledged()
            delivered_ids = {c["id"] for c in first.commands("delivered")}
            incidents = first.incidents()
            pending_before = len(first.commands("pending"))
            os.kill(first.process.pid, signal.SIGKILL)
            assert first.process.wait(10) == -signal.SIGKILL
            script.killed = True
            seen_before_kill = len(receiver.seen())

            second = sidecars.start()
            wait_until(lambda: settled(second, FAILURES), "every command delivered after restart")
            after_restart = len(receiver.seen())

            second.send(payloads)  # the exporter re-sends to the new process
            wait_until(
                lambda: second.stats()["delivery"]["duplicate_incidents"] == FAILURES,
                "the re-sent failures refused as duplicates",
            )
            wait_until(lambda: settled(second, FAILURES), "nothing left to deliver")
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
