"""A 200 means the failures in that request will be judged, even after ``kill -9``.

A real ``spanvisor run`` gets requests of failing spans over OTLP/HTTP from
several clients at once (so a backlog builds), every one answered 200; it is
killed with SIGKILL right after the last answer. A new process on the same
state must end with one incident per acknowledged failure: those not judged
and stored before the kill come back from the ingest log.
"""

from __future__ import annotations

import signal
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.kill_acknowledged import POLICY, failures_by_request
from bench.spans import make_requests
from supervisor.testing.sidecar_process import SidecarProcess, wait_until

pytestmark = pytest.mark.slow

REQUESTS, SPANS, RATE = 40, 100, 0.5  # about 2,000 failures


def incidents(state: Path, distinct: bool = False) -> int:
    """Incidents of the sent failures (a cascade found among them is one more, of its own)."""
    what = "DISTINCT trace_id || span_id" if distinct else "*"
    query = f"SELECT count({what}) FROM incidents WHERE rule != 'builtin.detect.cascade'"
    with sqlite3.connect(f"file:{state}?mode=ro", uri=True) as db:
        return int(db.execute(query).fetchone()[0])


def test_every_acknowledged_failure_is_an_incident_after_kill_9(tmp_path: Path) -> None:
    payloads = make_requests(REQUESTS, SPANS, failure_rate=RATE, seed=31)
    (tmp_path / "policy.yaml").write_text(POLICY, encoding="utf-8")
    # The failing spans a pipeline finds in these requests when nothing is killed.
    failures = len(set().union(*failures_by_request(payloads, tmp_path / "policy.yaml")))
    assert failures >= 2000
    state = tmp_path / "state.db"
    settings = {
        "host": "127.0.0.1",
        "state_path": str(state),
        "policy_poll_s": 0,
        # No run detectors: every incident is one of the sent failures.
        "track_runs": False,
    }
    first = SidecarProcess(settings, tmp_path, policy=POLICY, name="first", startup_timeout_s=20)
    second: SidecarProcess | None = None
    try:
        first.start()
        url = f"{first.otlp_endpoint}/v1/traces"
        with httpx.Client(timeout=30, trust_env=False) as client:

            def send(payload: bytes) -> int:
                headers = {"Content-Type": "application/x-protobuf"}
                return client.post(url, content=payload, headers=headers).status_code

            with ThreadPoolExecutor(max_workers=8) as pool:
                answers = list(pool.map(send, payloads))
        assert first.kill() == -signal.SIGKILL  # right after the last answer
        assert answers == [200] * REQUESTS
        stored_before = incidents(state)

        # Its ports are chosen now: chosen earlier, a client socket may have taken one.
        second = SidecarProcess(settings, tmp_path, policy=POLICY, name="second")
        second.start()
        wait_until(
            lambda: incidents(state) >= failures,
            60,
            f"every acknowledged failure an incident ({stored_before} before the restart)",
        )
        stats = second.get("/v1/stats")
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert incidents(state, distinct=True) == failures  # none lost
    assert incidents(state) == failures  # none twice
    log = stats["ingest_log"]
    assert log["replayed"] == log["recovered"]
    assert log["torn_tails"] == 0
